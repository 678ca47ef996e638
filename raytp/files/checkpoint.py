"""Checkpoints that load at any layout, written by the workers themselves and read slice by slice.

A checkpoint is the directory holding a ``manifest.json`` (raytp names the ones it
writes ``step-00000100/``; a copy under any other name, ``best/``, is one too), in
a Storage (raytp.files.storage):

- ``tp000.safetensors``, ``tp001.safetensors``, ...: what TP rank i of DP
  replica 0 holds (replicas hold the same; with pipeline stages, one file per
  stage and TP rank, ``pp001-tp000.safetensors``, each with the tensors of its
  stage's layers under their global names, and the manifest names each
  tensor's stage): its slices of the weights
  (``model/<name>``) and AdamW state (``optim/<name>/<key>``), each stored with
  its split dim first (a row-parallel weight transposed), so that any slice
  along it is one contiguous byte range. Replicated tensors are in tp000 only.
  Plain safetensors: no pickle, readable by any tool.
- ``manifest.json``, written last by the driver: the step, the model shape, the
  layout, every file's size, and for every tensor how it is split and its full
  shape. A directory without one is not a checkpoint (a save cut short).

Each worker writes its own file (``write_shard``), all at once; a resume at any
layout has each worker read only the byte ranges of its new slices
(``Checkpoint.read``, through raytp.parallel.reshard_plan). A checkpoint is
untrusted input: its manifest and every file's header are held to what raytp
writes before a row is read (raytp.files.checkpoint_manifest), and a truncated,
corrupt, missing or inconsistent file is refused by name. Format-1 checkpoints (one
``torch.save`` pickle per rank, read with ``weights_only=True``) still load, whole.

Exact resumption needs nothing more: data and dropout are pure functions of
(seed, step), and the LR schedule is a function of the step.
"""
from __future__ import annotations

import os

import torch

from raytp.models.args import ModelArgs
from raytp.models.registry import split_of, tensor_split
from raytp.models.stage import replicated_copy
from raytp.parallel.reshard_plan import pieces
from raytp.parallel.zero_plan import BUCKET_NUMEL
from raytp.parallel.placements import REPLICATE, Split, split_from
from raytp.parallel.sharding import local_shape
from raytp.files import checkpoint_blocks, checkpoint_manifest, safetensors_io
from raytp.files.checkpoint_manifest import check_model_tensors
from raytp.files.checkpoint_format import (FORMAT, FORMAT_V1, MANIFEST, STEP_DIR, CheckpointError,  # noqa: F401
                                           check_files, check_model, list_checkpoints, manifest, read_manifest, shard_file,
                                           step_dir, step_of)
from raytp.files.checkpoint_owner import prune  # noqa: F401 - a run prunes only its own checkpoints
from raytp.files.checkpoint_v1 import LegacyCheckpoint
from raytp.files.storage import Storage

# -- what a rank holds, as named tensors --------------------------------------------------------
def named_tensors(model: torch.nn.Module, optimizer, weights: bool = True) -> dict[str, tuple[Split, torch.Tensor]]:
    """key -> (how it splits, live tensor) for the weights (unless not `weights`) and the optimizer state
    of a shard (a tied embedding's copy on the last pipeline stage left out: the first stage writes it).
    Under the distributed optimizer the AdamW tensors are those of the rows this rank keeps."""
    out = {}
    if optimizer is not None:
        optimizer.settle()  # the new weights all here (zero 1 may still be gathering them)
    state = optimizer.named_state() if optimizer is not None else {}
    for name, p in model.named_parameters():
        if replicated_copy(model, name):
            continue
        s = split_of(name, model.cfg)
        if weights:
            out[f"model/{name}"] = (s, p.detach())
        for k, v in state.get(name, {}).items():
            if torch.is_tensor(v):
                out[f"optim/{name}/{k}"] = (s if v.dim() else REPLICATE, v.detach())
    return out


def zero_table(params: dict[str, torch.Tensor], cfg: ModelArgs, tp: int, dp: int, stage: int | None = None,
               copy: str | None = None, bucket_numel: int = BUCKET_NUMEL) -> dict[str, dict]:
    """For the manifest under the distributed optimizer: the AdamW entries of a shard whose parameters are
    `params` (name -> tensor of the local shape, every one, in the model's order), each moment's rows in
    blocks over the `dp` ranks' files, each step count in the file of the holder of its first row
    (raytp.files.checkpoint_blocks); parameter `copy` (a tied embedding's second copy) left out."""
    blocks = checkpoint_blocks.blocks_of([tuple(t.shape) for t in params.values()], dp, bucket_numel)
    virtual = {}
    for name, t in params.items():
        if name != copy:
            virtual.update({f"optim/{name}/{k}": (split_of(name, cfg), t) for k in checkpoint_blocks.MOMENTS})
            virtual[f"optim/{name}/step"] = (REPLICATE, torch.zeros((), dtype=torch.float32))
    table = tensor_table(virtual, tp, cfg.vocab_size, stage)
    for name, blk in zip(params, blocks):
        if name != copy:
            for k in checkpoint_blocks.MOMENTS:
                table[f"optim/{name}/{k}"]["blocks"] = blk
            table[f"optim/{name}/step"]["dp"] = checkpoint_blocks.step_holder(blk)
    return table


def state_tensors(state: dict, cfg: ModelArgs | None = None) -> dict[str, tuple[Split, torch.Tensor]]:
    """The same keys for a shard_state ({"model": {name: t}, "optim": {name: {k: t}}}) of a model of
    `cfg` (needed for a Llama's key/value projections)."""
    out = {f"model/{n}": (split_of(n, cfg), t) for n, t in state["model"].items()}
    out.update({f"optim/{n}/{k}": (tensor_split(n, t, cfg), t)
                for n, st in state.get("optim", {}).items() for k, t in st.items()})
    return out


def without_copies(tensors: dict, copy: str | None) -> dict:
    """`tensors` (keys as named_tensors') less those of parameter `copy`: the tied embedding's copy a last
    pipeline stage holds (raytp.models.stage.copied_name), which the first stage writes; None: all."""
    if copy is None:
        return tensors
    return {k: v for k, v in tensors.items() if k.split("/")[1] != copy}


def tensor_table(tensors: dict[str, tuple[Split, torch.Tensor]], tp: int, vocab_size: int,
                 stage: int | None = None) -> dict[str, dict]:
    """For the manifest: every key's split and full shape (from the tensors of a shard at TP degree `tp`),
    and the pipeline stage whose files hold it (`stage`, when written by stages)."""
    table = {}
    for key, (s, t) in tensors.items():
        shape = list(t.shape)
        if s.dim is not None:
            shape[s.dim] = s.full_size(shape[s.dim], tp, vocab_size)
        table[key] = {"dim": s.dim, "parts": s.parts, "pad": s.pad, "shape": shape,
                      "dtype": safetensors_io.DTYPES[t.dtype], "transposed": s.dim == 1 and t.dim() == 2}
        if s.heads:
            table[key]["heads"] = s.heads
        if stage is not None:
            table[key]["stage"] = stage
    return table


def write_shard(storage: Storage, directory: str, tensors: dict[str, tuple[Split, torch.Tensor]], tp_rank: int,
                to_host=None, written=None, tp: int = 1, stage: int | None = None, dp_rank: int = 0,
                whole: frozenset = frozenset()) -> dict:
    """Write TP rank `tp_rank`'s file of a checkpoint, one tensor at a time, each with its split dim first
    (the caller keeps the tensors unchanged until `written()` is called, or until this returns: once
    every byte is handed to the file the tensors may change while it is made durable; a device tensor
    is copied to the host one at a time, by `to_host(t)` if given). {"file", "bytes"}."""
    to_host = to_host or (lambda t: t.cpu())
    items = []
    for key, (s, t) in tensors.items():
        if key not in whole and ((s.dim is None and tp_rank != 0) or not s.owns(tp_rank, tp)):
            continue  # replicated: written once, by TP rank 0; a shared KV head by its owner; `whole`: by this rank
        stored = t.t() if s.dim == 1 and t.dim() == 2 else t
        items.append((key, t.dtype, tuple(stored.shape), lambda stored=stored: to_host(stored).contiguous()))
    name = shard_file(tp_rank, stage, dp_rank)
    with storage.open_write(f"{directory}/{name}") as f:
        n = safetensors_io.write(f, items, {"format": FORMAT, "tp_rank": str(tp_rank)})
        if storage.local:
            f.flush()
            if written:
                written()  # the bytes are the kernel's now: only the fsync is left
            os.fsync(f.fileno())
    if written:
        written()
    return {"file": name, "bytes": n}


# -- finding and reading ----------------------------------------------------------------------------
class Checkpoint:
    """One checkpoint directory: validated against its manifest, read slice by slice."""

    reads_into = True  # read() fills a given tensor in place (no copy on a filesystem)

    def __init__(self, storage: Storage, directory: str, manifest_: dict | None = None):
        self.storage, self.dir = storage, directory
        self.manifest = manifest_ or read_manifest(storage, directory)
        self.where = f"{storage.url.rstrip('/')}/{directory}"
        self.step, self.tp = self.manifest["step"], self.manifest["layout"]["tp"]
        self._readers: dict[str, safetensors_io.Reader] = {}
        self._held: dict[str, dict] = {}  # file -> {key: (dtype, stored shape)}, set by validate

    def validate(self) -> "Checkpoint":
        """Every file there at its size, the entries' blocks whole, every file named (no byte read)."""
        check_files(self.storage, self.dir, self.manifest, self.where)
        checkpoint_manifest.check_blocks(self.manifest, self.where)
        self._held = checkpoint_manifest.holdings(self.manifest)
        unlisted = sorted(set(self._held) - set(self.manifest["files"]))
        if unlisted:
            raise CheckpointError(f"{self.where}/{MANIFEST}: tensors are in {unlisted[0]}, which files does not list")
        return self

    def check_all(self) -> "Checkpoint":
        """Every file's header held to the manifest (what a reader of any layout reads is checked first)."""
        for name in self._held:
            self._reader(name)
        return self

    def keys(self) -> list[str]:
        return list(self.manifest["tensors"])

    def _reader(self, name: str) -> safetensors_io.Reader:
        """The file's reader, its header first held to the format and to every entry the manifest puts there."""
        if name not in self._readers:
            try:
                reader = safetensors_io.Reader(self.storage, f"{self.dir}/{name}", self.manifest["files"][name])
            except (safetensors_io.FormatError, OSError, KeyError) as e:
                raise CheckpointError(f"{self.where}/{name}: cannot be read ({e})") from None
            checkpoint_manifest.check_file(reader.metadata, reader.tensors, self._held.get(name, {}),
                                           f"{self.where}/{name}")
            self._readers[name] = reader
        return self._readers[name]

    def read(self, key: str, rank: int, tp: int, out: torch.Tensor | None = None, stored: bool = False) -> torch.Tensor:
        """TP rank `rank`'s slice (of TP degree `tp`) of tensor `key`, reading only its byte ranges; into
        `out` if given (a contiguous tensor of the slice's shape and dtype: no copy on a filesystem).
        `stored`: in the orientation it is stored in (split dim first: a row-parallel weight transposed),
        which reads every piece straight into place."""
        spec = self.manifest["tensors"][key]
        s, shape = split_from(spec["dim"], spec["parts"], spec["pad"], spec.get("heads", 0)), tuple(spec["shape"])
        dtype = safetensors_io.TORCH[spec["dtype"]]
        stage = spec.get("stage")
        blocks = spec.get("blocks")  # rows written by several DP ranks (raytp.files.checkpoint_blocks)
        dp, src_tp = spec.get("dp", 0), spec.get("tp", self.tp)  # an expert's file's DP rank, its written TP degree
        if s.dim is None and not blocks:
            return self._rows(shard_file(spec.get("tp_file", 0), stage, dp), key, None, None, dtype, shape, out)
        local = local_shape(s, shape, tp) if s.dim is not None else shape
        flip = spec["transposed"] and stored
        if out is None:
            out = torch.zeros(local[::-1] if flip else local, dtype=dtype)
        elif s.pad:
            out.zero_()  # padding positions are read from nowhere
        if blocks:
            def read_rows(src, blk, start, count):  # a block's file: its DP rank's, its own TP rank's if it names one
                return self._rows(shard_file(blk[3] if len(blk) > 3 else src, stage, blk[0]), key, start, count,
                                  dtype, None)
            spans = [(0, 0, shape[0], 0)] if s.dim is None else \
                [(p.src, p.src_at, p.length, p.dst_at) for p in pieces(s, shape[s.dim], src_tp, tp, rank)]
            for src, src_at, length, dst_at in spans:
                checkpoint_blocks.read_blocks(read_rows, spec, src, src_at, length, out, dst_at, flip)
            return out
        for p in pieces(s, shape[s.dim], src_tp, tp, rank):
            file = shard_file(spec.get("tp_file", p.src), stage, dp)
            if spec["transposed"] and not stored:
                rows = self._rows(file, key, p.src_at, p.length, dtype, None)
                out.narrow(s.dim, p.dst_at, p.length).copy_(rows.t())
            else:  # rows of `out` along dim 0: read straight into them
                self._rows(file, key, p.src_at, p.length, dtype, None, out.narrow(0, p.dst_at, p.length))
        return out

    def _rows(self, file: str, key: str, start, count, dtype, shape, into=None) -> torch.Tensor:
        reader = self._reader(file)
        try:
            have, saved, _ = reader.info(key)
            if have != dtype:
                raise safetensors_io.FormatError(f"is {have}, the manifest says {dtype}")
            if shape is not None and tuple(saved) != shape:
                raise safetensors_io.FormatError(f"has shape {tuple(saved)}, the manifest says {shape}")
            return reader.rows(key, start or 0, count, out=into)
        except safetensors_io.FormatError as e:
            raise CheckpointError(f"{self.where}/{file}: {key}: {e}") from None


def open_checkpoint(storage: Storage, directory: str, manifest_: dict | None = None):
    """The checkpoint in `directory` (validated), of either format."""
    m = checkpoint_manifest.check_manifest(manifest_ or read_manifest(storage, directory),
                                           f"{storage.url.rstrip('/')}/{directory}")
    if m["format"] == FORMAT_V1:
        return LegacyCheckpoint(storage, directory, m).validate()
    return Checkpoint(storage, directory, m).validate()


def load_into(ckpt, model, optimizer, rank: int, tp: int) -> None:
    """Give a shard (built empty) its slices of the checkpoint's weights and, if it has any, AdamW state (a
    parameter the shard holds whole though TP splits its kind, an expert at etp 1, reads all of it)."""
    keys = set(ckpt.keys())
    if "tensors" in ckpt.manifest:  # every entry at the shape of this model's parameter, before a byte is read
        check_model_tensors(ckpt.manifest, ckpt.where, model.cfg)
    at = (rank, tp)
    with torch.no_grad():
        for name, p in model.named_parameters():
            rank, tp = (0, 1) if getattr(p, "whole_on_rank", False) else at
            if f"model/{name}" not in keys:
                raise CheckpointError(f"{ckpt.where}: holds no model/{name}")
            direct = p.device.type == "cpu" and p.is_contiguous() and ckpt.reads_into  # straight into the tensors
            if direct:
                ckpt.read(f"model/{name}", rank, tp, out=p.data)
            else:
                p.copy_(ckpt.read(f"model/{name}", rank, tp))
            state = {}
            for k in ("step", "exp_avg", "exp_avg_sq"):
                if f"optim/{name}/{k}" not in keys:
                    continue
                if direct and k != "step":
                    state[k] = ckpt.read(f"optim/{name}/{k}", rank, tp, out=torch.empty_like(p.data))
                else:
                    v = ckpt.read(f"optim/{name}/{k}", rank, tp)
                    state[k] = v if k == "step" else v.to(p.device)
            if state:  # the whole TP slice; under the distributed optimizer this rank keeps its rows of it
                optimizer.load_param_state(name, state, whole=True)


def find(location: str, cfg: ModelArgs | None = None, warn=None, run_id: str | None = None):
    """The checkpoint at `location` (a checkpoint dir: one holding a manifest, whatever its name; a
    checkpoints dir or a run dir; a path or URL), or the newest whole one under it; a broken newest one is
    reported through `warn` and skipped, as is one another run wrote when `run_id` names this run's (one
    without a run id, written before them, is taken). Its model shape is checked against `cfg` if given
    (and every entry against the model's parameters), every file's header against its manifest. Raises
    CheckpointError."""
    location = str(location).rstrip("/")
    head, _, last = location.rpartition("/")
    if STEP_DIR.fullmatch(last) or Storage(head or ".").exists(last, MANIFEST):
        found = open_checkpoint(Storage(head or "."), last)
        if cfg is not None:
            check_model(found.manifest, cfg, found.where)
            check_model_tensors(found.manifest, found.where)
        return found.check_all()
    for root in (f"{location}/checkpoints", location):
        storage = Storage(root)
        for name in reversed(list_checkpoints(storage)):
            try:
                found = open_checkpoint(storage, name)
                if run_id is not None and found.manifest.get("run_id") not in (None, run_id):
                    raise CheckpointError(f"written by another run ({found.manifest['run_id']})")
                if cfg is not None:
                    check_model(found.manifest, cfg, found.where)
                    check_model_tensors(found.manifest, found.where)
                return found.check_all()
            except CheckpointError as e:
                if warn:
                    warn(f"skipping {storage.url}/{name}: {e}")
    raise CheckpointError(f"{location}: holds no whole checkpoint (looked in {location}/checkpoints and {location})")
