"""What raytp's models share: ``CausalLM``, their base, and ``LMLoss``.

Every parameter gets its seeded values from raytp.initialization (so a TP
shard can compute its slices alone), a tied head shares the input embedding's
weight, dropout sites can be keyed (``set_dropout_key``), and a model writes
the one-device file `raytp export` makes (raytp.models.files reads it back).
"""
from __future__ import annotations

import json
from dataclasses import asdict

import torch
import torch.nn as nn
import torch.nn.functional as F

from raytp.initialization import InitRule, no_init, values
from raytp.models import documents as docs
from raytp.models.args import ModelArgs

MODEL_FORMAT, MODEL_FORMAT_V1 = "raytp-model/2", "raytp-model/1"  # 2: safetensors; 1: a torch pickle


class LMLoss(nn.Module):
    """Mean cross entropy over all tokens, in float32 (bf16 logits are upcast); targets of -1 are ignored.
    `summed`: their sum instead (raytp.train.token_loss divides it by the global batch's trained tokens)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor, summed: bool = False) -> torch.Tensor:
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1,
                               reduction="sum" if summed else "mean")


def set_dropout_key(model: nn.Module, key: int | None, sites: list[nn.Module] | None = None) -> None:
    """Key every dropout site of `model` (None = ordinary, unkeyed dropout): the modules that declare
    ``keyed_dropout = True`` draw their masks from (key, site), never from the global RNG.

    Call once per micro-batch with a key derived from (seed, step, micro-batch)
    so masks depend on the step, not on the history of a global RNG. `sites`:
    ``dropout_sites(model)``, for a caller that keys the same model many times
    (a pipeline stage, twice per micro-batch: finding them costs ~0.3 ms).
    """
    for m in dropout_sites(model) if sites is None else sites:
        m.key = key


def dropout_sites(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that declare ``keyed_dropout = True``."""
    return [m for m in model.modules() if getattr(m, "keyed_dropout", False)]


class CausalLM(nn.Module):
    """What GPT and Llama share: seeded init of every parameter, the tied head, files, generation."""

    cfg: ModelArgs
    lm_head: nn.Linear
    activation_checkpointing = False  # recompute each block in backward (train.activation_checkpointing)
    document_eod: int | None = None   # attention stops at this end-of-document id (data.document_mask)

    @staticmethod
    def init_rule(name: str, cfg: ModelArgs) -> InitRule:
        raise NotImplementedError

    def input_embedding(self) -> nn.Module:
        raise NotImplementedError

    def build(self, seed: int | None, make_layers) -> None:
        """Make the modules (`make_layers()`, which allocates but initialises nothing), tie the head,
        and give every parameter its seeded values; on the meta device, shapes only."""
        with no_init():
            make_layers()
        if self.cfg.tied:
            self.lm_head.weight = self.input_embedding().weight
        if self.lm_head.weight.is_meta:
            return
        if seed is None:
            seed = int(torch.randint(2**62, (1,), device="cpu"))
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(values(name, self.init_rule(name, self.cfg), seed, tuple(p.shape)))

    def run_block(self, block: nn.Module, *args) -> torch.Tensor:
        """block(*args), its activations recomputed in backward when activation checkpointing is on
        (the recomputation draws the same keyed dropout masks, so results are bitwise the same)."""
        if self.activation_checkpointing and self.training and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint
            return checkpoint(block, *args, use_reentrant=False)
        return block(*args)

    def document_ids(self, idx: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor | None:
        """Each position's document id (B, T) (raytp.models.documents): `documents` when the batch carries them
        (packed conversations), else those ended by `document_eod` tokens (data.document_mask), else None
        (causal attention over the whole sequence). Every pipeline stage has idx, so each makes them."""
        if documents is not None:
            return documents
        if self.document_eod is None:
            return None
        return docs.from_eod(idx, self.document_eod)

    def position_ids(self, documents: torch.Tensor | None) -> torch.Tensor | None:
        """Positions restarting at each document the batch carries (None: 0..T-1 in every row, as they are
        under data.document_mask's end tokens)."""
        return None if documents is None else docs.positions(documents)

    def block_dict(self) -> nn.ModuleDict:
        """The transformer blocks, keyed by their global layer index (a pipeline stage holds some)."""
        raise NotImplementedError

    def blocks(self, layers=None) -> list[nn.Module]:
        """The blocks of `layers` (global indices; default: every block held), in order."""
        held = self.block_dict()
        if layers is None:
            return list(held.values())
        return [held[str(i)] for i in layers]

    def ends_model(self, layers=None) -> bool:
        """Whether running `layers` reaches the output (the last layer of the model, or the whole model)."""
        return layers is None or self.cfg.n_layer - 1 in layers

    def check_length(self, idx: torch.Tensor) -> int:
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size={self.cfg.block_size}")
        return T

    @classmethod
    def from_state_dict(cls, cfg: ModelArgs, state: dict, where: str = "state") -> "CausalLM":
        """A model holding `state` (a tied lm_head.weight may be absent), built without an init."""
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device="cpu")
        if cfg.tied:
            model.lm_head.weight = model.input_embedding().weight  # to_empty made two tensors of the tied one
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (cfg.tied and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"{where}: weights do not fit the model: missing {missing}, unexpected {unexpected}")
        return model

    def save(self, path) -> None:
        """Write this (one-device) model as a file `load` reads (safetensors)."""
        from safetensors.torch import save_file
        state = {k: v.contiguous() for k, v in self.state_dict().items()
                 if not (self.cfg.tied and k == "lm_head.weight")}
        save_file(state, str(path), metadata={"format": MODEL_FORMAT, "config": json.dumps(asdict(self.cfg))})

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 stop: int | None = None) -> torch.Tensor:
        """Append `tokens` sampled tokens to idx (B, T); temperature 0 is greedy; `stop`: sooner, once every
        row has sampled this id (an end of turn)."""
        done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        for _ in range(tokens):
            if stop is not None and bool(done.all()):
                break
            logits = self(idx[:, -self.cfg.block_size:])[:, -1, :]  # (B, V)
            if temperature == 0.0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
            if stop is not None:
                done |= nxt[:, 0] == stop
        return idx
