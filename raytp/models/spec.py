"""ModelSpec: everything that knows one architecture, in one value (torchtitan's ``ModelSpec``).

An architecture is a folder of raytp.models (gpt2/, llama/) whose ``spec.py``
builds its ModelSpec from the folder's modules: the plain PyTorch model, how
its parameters split over TP ranks and the plan that swaps in the parallel
layers, its Hugging Face spelling, and the job checks that only it needs.
raytp.models.registry is the one place that names the architectures; the rest
of raytp asks it, never an architecture's modules, so a third architecture
is one new folder and one line there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from raytp.models.args import ModelArgs
from raytp.models.base import CausalLM
from raytp.parallel.sharding import Sharding

# A job check: (the dotted keys it reads, the first one named in the message; ok(v); message(v)),
# v mapping dotted job keys to values (raytp.config.rules runs them, only on jobs of this architecture).
JobRule = tuple[tuple[str, ...], Callable[[dict], Any], Callable[[dict], str]]


@dataclass(frozen=True)
class HFAdapter:
    """The Hugging Face spelling of an architecture (raytp.models.hf reads and writes the directories)."""
    model_types: tuple[str, ...]                       # config.json model_type values it reads
    config_to_hf: Callable[[ModelArgs], dict]          # -> config.json
    config_from_hf: Callable[[dict, str], ModelArgs]   # (config.json, where) -> args; refuses what it cannot be
    to_hf: Callable[[str, ModelArgs], tuple[str, bool]]  # raytp name -> (HF name, stored transposed)
    from_hf: Callable[[str, ModelArgs], str | None]    # HF name -> raytp name; None: not kept
    bin_state: Callable[[dict], dict] | None = None    # a pytorch_model.bin state -> raytp's (None: refused)
    block_size: Callable[[int, int], int] = lambda job, model: model  # (job's, directory's) -> the one trained


@dataclass(frozen=True)
class ModelSpec:
    name: str                                # model.arch
    title: str                               # for messages ("GPT-2")
    summary: str                             # the job key's help text
    model: type[CausalLM]
    sharding: tuple[tuple[str, Sharding], ...]  # (regex over parameter names, how it splits); else replicated
    parallelize: Callable                    # (model, group, sequence_parallel, sliced, rank, tp): swap modules
    tag: Callable                            # (model, group, sequence_parallel, rank, tp): mark what TP sums
    width_key: str                           # the job key that sets the MLP width, for job messages
    width_name: str                          # the MLP width's name in the model's terms, for check_tp
    hf: HFAdapter
    job_rules: tuple[JobRule, ...] = field(default=())


def divisors(n: int) -> str:
    """'1, 2, 4' for 4: the valid choices a job check names."""
    return ", ".join(str(i) for i in range(1, n + 1) if n % i == 0)
