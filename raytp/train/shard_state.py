"""A rank's state in memory: weights and AdamW state keyed by parameter name, packed for the object store.

``shard_state`` copies a rank's weights and optimizer state out (CPU tensors),
``load_shard_state`` puts one back; ``pack_state`` makes it one flat byte
buffer (what snapshots and worker-to-worker copies travel as: Ray stores one
numpy buffer in a single copy); ``slice_state`` / ``unshard_state`` cut a rank's
part out of a one-device state and join the parts again (tests, and format-1
checkpoints).
"""
from __future__ import annotations

import torch

from raytp.models.args import ModelArgs
from raytp.models.registry import split_of
from raytp.parallel.sharding import shard_tensor, unshard_tensors


class StateError(RuntimeError):
    """A state that does not fit the shard it is loaded into."""


def shard_state(model: torch.nn.Module, optimizer, copy: bool = True) -> dict:
    """This rank's weights and AdamW state, keyed by parameter name, on the CPU (the AdamW state of the
    rows it keeps only, under the distributed optimizer: raytp.train.optimizer).

    With copy=False, CPU tensors are the live ones: only for a caller that serializes them at once
    (a yield to Ray copies them into the object store), which saves a copy per snapshot."""
    def out(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.clone() if copy and t.device.type == "cpu" else t.cpu()

    optimizer.settle()  # the new weights all here (zero 1 may still be gathering them)
    optim = {n: {k: out(v) for k, v in st.items()} for n, st in optimizer.named_state().items()}
    return {"model": {n: out(p) for n, p in model.named_parameters()}, "optim": optim}


@torch.no_grad()
def load_shard_state(model: torch.nn.Module, optimizer, state: dict, whole: bool = False) -> None:
    """Copy a shard_state (of this rank's shapes) into the model and optimizer (None: the weights only).
    `whole`: its AdamW state is of whole parameters (a one-device state sliced over TP), of which this rank
    takes the rows it keeps."""
    params = dict(model.named_parameters())
    missing = set(params) - set(state["model"])
    if missing:
        raise StateError(f"state lacks parameters {sorted(missing)}")
    for n, p in params.items():
        src = state["model"][n]
        if src.shape != p.shape:
            raise StateError(f"{n}: state has shape {tuple(src.shape)}, this shard needs {tuple(p.shape)}")
        p.copy_(src)
    if optimizer is None:
        return
    optimizer.clear_state()
    for n, st in state["optim"].items():
        try:  # copies: `state` may be a read-only view of Ray's object store
            optimizer.load_param_state(n, st, whole=whole)
        except ValueError as e:
            raise StateError(str(e)) from None


def live_state(model: torch.nn.Module, optimizer) -> dict:
    """shard_state's layout holding the live tensors themselves, on their device (no copy)."""
    optimizer.settle()
    optim = {n: {k: v.detach() for k, v in st.items()} for n, st in optimizer.named_state().items()}
    return {"model": {n: p.detach() for n, p in model.named_parameters()}, "optim": optim}


def state_bytes(state: dict) -> int:
    """Bytes of a state's tensors (weights and optimizer state)."""
    n = sum(t.numel() * t.element_size() for t in state["model"].values())
    return n + sum(t.numel() * t.element_size() for st in state.get("optim", {}).values() for t in st.values())


def pack_state(state: dict, out: torch.Tensor | None = None) -> dict:
    """A shard_state as one flat byte buffer plus its layout: Ray stores one numpy buffer in a
    single copy, where a dict of tensors costs a pickle per tensor (half the time, measured).
    `out`: a CPU uint8 tensor of state_bytes(state) to pack into (reused, its pages are already
    mapped: a fresh buffer each time cost page faults worth as much as the copy itself)."""
    entries, tensors = [], []
    for section in ("model", "optim"):
        for name, value in state[section].items():
            for key, t in ([(None, value)] if section == "model" else value.items()):
                t = t.detach().contiguous()
                entries.append((section, name, key, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.nbytes))
                tensors.append(t.reshape(-1).view(torch.uint8))
    if not tensors:
        flat = torch.empty(0, dtype=torch.uint8)
    elif out is None:
        flat = torch.cat(tensors).cpu()
    elif not any(t.is_cuda for t in tensors):
        flat = torch.cat(tensors, out=out)
    else:  # tensor by tensor from the device into `out` (pinned: the copies are asynchronous)
        offset = 0
        for t in tensors:
            out[offset:offset + t.numel()].copy_(t, non_blocking=True)
            offset += t.numel()
        if any(t.is_cuda for t in tensors):
            torch.cuda.current_stream().synchronize()
        flat = out
    return {"packed": entries, "data": flat.numpy()}


def unpack_state(packed: dict, views: bool = False) -> dict:
    """Inverse of pack_state: tensors are copies, or, with `views`, views of the packed buffer."""
    if "packed" not in packed:
        return packed
    raw = packed["data"] if views else packed["data"].copy()
    data = torch.from_numpy(raw) if len(raw) else torch.empty(0, dtype=torch.uint8)
    out: dict = {"model": {}, "optim": {}}
    offset = 0
    for section, name, key, shape, dtype, nbytes in packed["packed"]:
        t = data[offset:offset + nbytes].view(getattr(torch, dtype)).reshape(shape)
        offset += nbytes
        if section == "model":
            out["model"][name] = t
        else:
            out["optim"].setdefault(name, {})[key] = t
    return out


def unshard_state(shards: list[dict], cfg: ModelArgs) -> dict:
    """Join the shard_states of all TP ranks (rank order) into the one-device state, padding dropped."""
    def join(name, tensors):
        s = split_of(name, cfg)
        return unshard_tensors(tensors, s, cfg.vocab_size if s.pad else None)

    model = {n: join(n, [sh["model"][n] for sh in shards]) for n in shards[0]["model"]}
    optim = {}
    for n, st in shards[0]["optim"].items():
        optim[n] = {k: (v.clone() if v.dim() == 0 else join(n, [sh["optim"][n][k] for sh in shards]))
                    for k, v in st.items()}
    return {"model": model, "optim": optim}


def slice_state(full: dict, rank: int, tp: int, cfg: ModelArgs | None = None) -> dict:
    """The shard_state of TP rank `rank` out of a full state (weights, and AdamW state if any) of a model
    of `cfg` (needed for a Llama's key/value projections)."""
    model = {n: shard_tensor(t, split_of(n, cfg), rank, tp) for n, t in full["model"].items()}
    optim = {n: {k: (v.clone() if v.dim() == 0 else shard_tensor(v, split_of(n, cfg), rank, tp))
                 for k, v in st.items()} for n, st in full.get("optim", {}).items()}
    return {"model": model, "optim": optim}
