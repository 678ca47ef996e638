"""A checkpoint's manifest held to what raytp writes, before any tensor of it is read.

A checkpoint directory may be shared with others who can write it, so its manifest is input, not truth.
``check_manifest`` refuses one whose fields have the wrong types or ranges, whose file names are not plain
names of the directory, or whose model is too large to build (raytp.trust); ``check_model_tensors``
holds every ``model/`` and ``optim/`` entry to the shape the manifest's own model gives that parameter;
``holdings`` says, from the entries, which file holds which tensor at which stored shape, so that a
reader checks each file's safetensors header against it (dtype and shape, every byte accounted for)
before it reads a row. A manifest's ``run_id`` (written since run ids exist) says which run wrote it:
a run prunes only its own checkpoints (raytp.files.checkpoint.prune).
"""
from __future__ import annotations

import functools

from raytp import trust
from raytp.files.checkpoint_format import FORMAT, CheckpointError, shard_file
from raytp.models.args import ModelArgs
from raytp.parallel.placements import REPLICATE, Split, split_from
from raytp.parallel.sharding import local_shape

DTYPES = ("F32", "F64", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL")
OPTIM_STATES = ("exp_avg", "exp_avg_sq", "step")


def _int(x, lo: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo


def check_manifest(m: dict, where: str) -> dict:
    """`m` (a manifest read from `where`) if every field is of the type and range raytp writes; else
    CheckpointError naming the field."""
    def bad(what: str):
        raise CheckpointError(f"{where}/manifest.json: {what}")
    if not _int(m.get("step")):
        bad(f"step {str(m.get('step'))[:40]!r} is not an integer >= 0")
    if not isinstance(m.get("model"), dict):
        bad("model is not a mapping of ModelArgs")
    try:
        trust.check_model_size(ModelArgs(**m["model"]), "model")
    except (TypeError, ValueError) as e:
        bad(f"model: {str(e)[:300]}")
    lay = m.get("layout")
    if not isinstance(lay, dict) or not all(_int(lay.get(k, 1), 1) for k in ("tp", "pp", "dp")) \
            or "tp" not in lay or "dp" not in lay or not _int(lay.get("zero", 0)):
        bad(f"layout {str(lay)[:80]} is not {{tp, pp, dp[, zero]}} of integers >= 1")
    files = m.get("files")
    if not isinstance(files, dict) or not files or not all(_int(v) for v in files.values()):
        bad("files is not a mapping of file names to sizes")
    if lay["tp"] * lay.get("pp", 1) > len(files) or lay["dp"] > 1 << 20 or lay.get("zero", 0) > 1:
        bad(f"layout {lay} does not fit its {len(files)} files (each TP rank of each stage writes one)")
    try:
        for name in files:
            trust.plain_name(name, "files")
        if m.get("run_id") is not None:
            trust.plain_name(m["run_id"], "run_id")
    except trust.Untrusted as e:
        bad(str(e))
    if m["format"] == FORMAT:
        tensors = m.get("tensors")
        if not isinstance(tensors, dict) or not tensors:
            bad("tensors is not a mapping of entries")
        for key, spec in tensors.items():
            problem = _entry_problem(key, spec, lay)
            if problem:
                bad(f"tensors: {str(key)[:80]!r}: {problem}")
    return m


def _entry_problem(key, spec, lay: dict) -> str | None:
    """What is wrong with one entry of a manifest's tensor table; None if nothing."""
    if not isinstance(key, str) or key.split("/")[0] not in ("model", "optim"):
        return "keys are model/<name> or optim/<name>/<state>"
    if not isinstance(spec, dict) or not {"dim", "parts", "pad", "shape", "dtype", "transposed"} <= set(spec):
        return "not a mapping of dim, parts, pad, shape, dtype and transposed"
    shape = spec.get("shape")
    if not isinstance(shape, list) or not all(_int(x) for x in shape) or len(shape) > trust.MAX_DIMS:
        return f"shape {str(shape)[:60]} is not a list of integers >= 0"
    if spec.get("dtype") not in DTYPES:
        return f"dtype {str(spec.get('dtype'))[:20]!r} is not one of {', '.join(DTYPES)}"
    dim = spec.get("dim")
    if dim is not None and not (_int(dim) and dim < len(shape)):
        return f"dim {dim!r} is not a dimension of shape {shape}"
    if not _int(spec.get("parts"), 1) or not isinstance(spec.get("pad"), bool) \
            or not isinstance(spec.get("transposed"), bool) or not _int(spec.get("heads", 0)):
        return "parts, pad, transposed or heads of the wrong type"
    if spec["parts"] > 64 or (dim is not None and (spec["parts"] > max(shape[dim], 1)
                                                   or spec.get("heads", 0) > max(shape[dim], 1))):
        return f"parts {spec['parts']} or heads {spec.get('heads', 0)} more than the tensor has rows"
    if spec["transposed"] and (dim != 1 or len(shape) != 2):
        return "transposed is for a matrix split along dim 1 only"
    if spec.get("stage") is not None and not (_int(spec["stage"]) and spec["stage"] < lay.get("pp", 1)):
        return f"stage {spec['stage']!r} is not a stage of pp {lay.get('pp', 1)}"
    for k in ("dp", "tp_file"):
        if k in spec and not _int(spec[k]):
            return f"{k} {spec[k]!r} is not an integer >= 0"
    if "tp" in spec and spec["tp"] not in (1, lay["tp"]):
        return f"tp {spec['tp']!r} is neither 1 nor the layout's {lay['tp']}"
    if "tp_file" in spec and dim is not None and spec.get("tp") != 1:
        return "tp_file names the one file of a tensor held whole (tp: 1) only"
    blocks = spec.get("blocks")
    if blocks is not None and (not isinstance(blocks, list) or not blocks or not all(
            isinstance(b, list) and len(b) in (3, 4) and all(_int(x) for x in b) and b[1] <= b[2] for b in blocks)):
        return "blocks is not a list of [dp, first, end(, tp_file)]"
    return None


@functools.lru_cache(maxsize=8)
def _model_table(cfg: ModelArgs) -> dict[str, tuple[tuple[int, ...], Split]]:
    """Every parameter of a model of `cfg`: its shape (built on the meta device: no memory) and its split."""
    import torch

    from raytp.models.registry import build_model, split_of
    with torch.device("meta"):
        return {n: (tuple(p.shape), split_of(n, cfg)) for n, p in build_model(cfg).named_parameters()}


def check_model_tensors(m: dict, where: str, cfg: ModelArgs | None = None) -> None:
    """Every entry of a format-2 manifest is a parameter of its model (`cfg`, else the manifest's own) or its
    AdamW state, at that parameter's shape and split as the model's table splits it (a flipped `transposed`
    of a square matrix would read its transpose), and every parameter has its weights; else CheckpointError
    naming the first that is not."""
    try:
        cfg = cfg if cfg is not None else ModelArgs(**m["model"])
        expected = _model_table(cfg)
    except Exception as e:  # noqa: BLE001 - numbers no model is built from: a refusal, never a traceback
        raise CheckpointError(f"{where}/manifest.json: model: {str(e)[:300]}") from None
    for key, spec in m["tensors"].items():
        section, name, *state = key.split("/")
        want, s = expected.get(name, (None, None))
        ok = (section == "model" and not state) or (section == "optim" and len(state) == 1
                                                    and state[0] in OPTIM_STATES)
        if want is None or not ok:
            raise CheckpointError(f"{where}/manifest.json: tensors: {key}: not a parameter of its model (or its "
                                  "AdamW state)")
        s, want = (REPLICATE, ()) if state == ["step"] else (s, want)
        split = (spec["dim"], spec["parts"], spec["pad"], spec.get("heads", 0), spec["transposed"])
        if tuple(spec["shape"]) != want or split != (s.dim, s.parts, s.pad, s.heads, s.dim == 1 and len(want) == 2):
            raise CheckpointError(f"{where}/manifest.json: tensors: {key}: shape {spec['shape']} split {split[:4]}; "
                                  f"the model's is {list(want)} split {(s.dim, s.parts, s.pad, s.heads)}")
    for name in {key.split("/")[1] for key in m["tensors"] if key.startswith("optim/")}:
        have = [k for k in OPTIM_STATES if f"optim/{name}/{k}" in m["tensors"]]
        if len(have) != len(OPTIM_STATES):  # AdamW keeps all three of a parameter or none
            raise CheckpointError(f"{where}/manifest.json: tensors: optim/{name}: holds {', '.join(have)} of "
                                  f"{', '.join(OPTIM_STATES)}")
    missing = [n for n in expected if f"model/{n}" not in m["tensors"]]
    if missing:
        raise CheckpointError(f"{where}/manifest.json: holds no model/{missing[0]}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


def holdings(m: dict) -> dict[str, dict[str, tuple[str, tuple[int, ...]]]]:
    """file -> {key: (dtype, the shape the file stores it at)} for every tensor of a format-2 manifest, as
    raytp.files.checkpoint.Checkpoint.read finds them (any layout reads them from these files only)."""
    out: dict[str, dict] = {}
    tp = m["layout"]["tp"]
    for key, spec in m["tensors"].items():
        s = split_from(spec["dim"], spec["parts"], spec["pad"], spec.get("heads", 0))
        shape, stage, src_tp = tuple(spec["shape"]), spec.get("stage"), spec.get("tp", tp)
        local = local_shape(s, shape, src_tp) if s.dim is not None else shape
        srcs = [0] if s.dim is None else [p for p in range(src_tp) if s.owns(p, src_tp)]
        for src in srcs:
            if spec.get("blocks"):
                for blk in spec["blocks"]:
                    rows = blk[2] - blk[1]
                    at = (local[1], rows) if spec["transposed"] else (rows, *local[1:])
                    file = shard_file(blk[3] if len(blk) > 3 else src, stage, blk[0])
                    out.setdefault(file, {})[key] = (spec["dtype"], at)  # one block of a tensor a file
                continue
            at = local[::-1] if spec["transposed"] else local
            file = shard_file(spec.get("tp_file", src), stage, spec.get("dp", 0))
            out.setdefault(file, {})[key] = (spec["dtype"], at)
    return out


def check_file(metadata: dict, tensors: dict, held: dict, where: str) -> None:
    """A checkpoint file's header (`metadata`, `tensors`) against what the manifest places in it (`held`, one
    file's holdings): raytp's format tag (its tensors in written order), every tensor at its dtype and shape."""
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{where}: cannot be read (not a raytp checkpoint file: format "
                              f"{str(metadata.get('format'))[:40]!r})")
    for key, (dtype, shape) in held.items():
        have = tensors.get(key)
        if have is None or have["dtype"] != dtype or tuple(have["shape"]) != tuple(shape):
            found = f"{have['dtype']} {have['shape']}" if have else "nothing"
            raise CheckpointError(f"{where}: {key}: holds {found}, the manifest says {dtype} {list(shape)}")


def check_blocks(m: dict, where: str) -> None:
    """The blocks of every entry that has them tile the rows of its TP slice, in order, with no gap."""
    tp = m["layout"]["tp"]
    for key, spec in m["tensors"].items():
        if not spec.get("blocks"):
            continue
        s = split_from(spec["dim"], spec["parts"], spec["pad"], spec.get("heads", 0))
        shape = tuple(spec["shape"])
        rows = (local_shape(s, shape, spec.get("tp", tp)) if s.dim is not None else shape)[0] if shape else 0
        at = 0
        for blk in spec["blocks"]:
            if blk[1] != at:
                raise CheckpointError(f"{where}/manifest.json: tensors: {key}: blocks do not tile its {rows} rows")
            at = blk[2]
        if at != rows:
            raise CheckpointError(f"{where}/manifest.json: tensors: {key}: blocks do not tile its {rows} rows")
