"""ModelSpec: everything that knows one architecture, in one value (torchtitan's ``ModelSpec``).

An architecture is a folder of raytp.models (gpt2/, llama/) whose ``spec.py``
builds its ModelSpec from the folder's modules: the plain PyTorch model, how
its parameters split over TP ranks and the plan that swaps in the parallel
layers, its Hugging Face spelling, and its facts for a job (``facts.py``: name,
help, the job checks that only it needs; torch-free, raytp.models.facts).
raytp.models.arch is the one place that names the architectures and
raytp.models.registry builds their specs from it; the rest of raytp asks the
registry (or, for a job's checks, arch), never an architecture's modules, so a
third architecture is one new folder and one line there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from raytp.models.facts import ArchFacts
from raytp.models.args import ModelArgs
from raytp.models.base import CausalLM
from raytp.parallel.placements import Shard, Split

KV_HEADS = Shard(0, heads=-1)  # in a model's table: split by the model's n_kv_head (filled in by the registry)


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
    facts: ArchFacts                         # its name and job checks (raytp.models.facts: no torch there)
    model: type[CausalLM]
    sharding: tuple[tuple[str, Split], ...]  # (regex over parameter names, how it splits); else replicated
    parallelize: Callable                    # (model, group, sequence_parallel, sliced, rank, tp, experts=): swap
                                             # modules, place experts (raytp.models.moe.plan.ExpertPlace)
    tag: Callable                            # (model, group, sequence_parallel, rank, tp): mark what TP sums
    hf: HFAdapter

    @property
    def name(self) -> str:
        return self.facts.name

    @property
    def title(self) -> str:
        return self.facts.title

    @property
    def width_name(self) -> str:
        return self.facts.width_name
