"""`raytp export`: a checkpoint as one raytp model file, or as a Hugging Face directory that serves.

Each tensor is read whole from the checkpoint's slices (raytp.files.checkpoint,
TP degree 1) and written to the output at once, so the export holds one tensor
at a time, never the model. The raytp format is a safetensors file with the
model's config in its metadata (``raytp.models.files.load_model`` reads it).
The Hugging Face format (write_hf) is a directory as transformers, vLLM and
lm-eval expect one: the weights in fp32 or bf16 (raytp.files.interop.hf: one file, or
shards with their index past a size), config.json with the special token ids,
generation_config.json, and the tokenizer with its side files
(raytp.files.interop.hf_tokenizer). Both are written under a hidden name beside the
output and renamed into place whole, so a failed export leaves nothing that
looks like one.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from raytp.models.args import ModelArgs
from raytp.models.base import MODEL_FORMAT
from raytp import trust
from raytp.files import safetensors_io
from raytp.files.interop import chat_template, hf, hf_tokenizer

# What an hf export writes: an --out directory holding only these is a previous export, replaced whole.
EXPORT_FILE = re.compile(r"(config|generation_config|tokenizer|tokenizer_config|special_tokens_map)\.json"
                         r"|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|chat_template\.jinja")


def unmap_large_frees() -> None:
    """Make every allocation of 1 MiB or more a mapping of its own, returned to the system when freed.
    glibc otherwise raises that threshold to the largest block freed so far, after which freed tensors
    stay in the heap and a larger one grows it: an export would hold two tensors' worth. Exports are
    I/O-bound, so the page faults this costs do not show (a training step's allocations would)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: its own policy


def write_model(ckpt, out: Path, tokenizer: Path | None = None, overwrite: bool = False) -> int:
    """The weights of `ckpt` (a Checkpoint) as a raytp model file at `out`, with the text of `tokenizer`
    (a tokenizer.json) in its metadata so that `raytp sample` finds it; bytes written. Written beside `out`
    under a hidden name and moved into place: over an existing file only with `overwrite` (else ValueError,
    and the file is left as it was)."""
    unmap_large_frees()
    items = []
    for key in ckpt.keys():
        if not key.startswith("model/"):
            continue
        spec = ckpt.manifest.get("tensors", {}).get(key)
        t_shape = tuple(spec["shape"]) if spec else None
        if t_shape is None:  # a format-1 checkpoint: shapes from the tensors themselves
            t_shape = tuple(ckpt.read(key, 0, 1).shape)
        dtype = safetensors_io.TORCH[spec["dtype"]] if spec else torch.float32
        items.append((key.removeprefix("model/"), dtype, t_shape,
                      lambda key=key, spec=spec: _whole(ckpt, key, spec)))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": MODEL_FORMAT, "config": json.dumps(ckpt.manifest["model"])}
    if tokenizer is not None:
        meta["tokenizer"] = Path(tokenizer).read_text()
        template, _ = chat_template.find_template(Path(tokenizer))
        if template is not None:  # `raytp sample --chat` renders it (and its special tokens)
            meta["chat"] = json.dumps(chat_template.chat_spec(Path(tokenizer), template))
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            n = safetensors_io.write(f, items, meta)
        if overwrite:
            os.replace(tmp, out)
        else:
            try:
                os.link(tmp, out)  # fails if `out` appeared meanwhile: never replaced unasked
            except FileExistsError:
                raise ValueError(f"--out {out}: exists; pass --overwrite to replace it, or give a new name") from None
            except OSError:  # a filesystem without hard links: checked, then renamed
                if out.exists():
                    raise ValueError(f"--out {out}: exists; pass --overwrite to replace it") from None
                os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return n


def write_hf(ckpt, out: Path, dtype: str = "fp32", max_shard_size: str | int = hf.DEFAULT_SHARD_SIZE,
             tokenizer: Path | None = None, init_from: Path | None = None) -> list[str]:
    """The checkpoint `ckpt` as a Hugging Face directory `out` of its architecture, weights in `dtype`
    ("fp32" or "bf16") in files of at most `max_shard_size` ("5GB", "500MB", bytes). With `tokenizer` (a
    tokenizer.json) the tokenizer and its side files, and the special token ids in config.json and
    generation_config.json; `init_from` (the model.init_from directory the run started from) gives the
    model's own ids, generation_config.json and side files where it has them. `out` must be new, empty or
    a previous export (replaced whole). The names of the files written; ValueError for a bad argument."""
    out = Path(out).absolute()
    _check_out(out)
    if dtype not in hf.DTYPES:
        raise ValueError(f"--dtype: {dtype!r}; valid: {', '.join(hf.DTYPES)}")
    hf.parse_size(max_shard_size)  # refused before anything is written
    files = _beside_weights(ModelArgs(**ckpt.manifest["model"]), hf.DTYPES[dtype], tokenizer,
                            Path(init_from) if init_from else None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    unmap_large_frees()
    try:
        written = hf.save_weights(ckpt, tmp, hf.DTYPES[dtype], max_shard_size)
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        _swap_in(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted([*written, *files])


def _beside_weights(cfg: ModelArgs, dtype: torch.dtype, tokenizer: Path | None,
                    init_from: Path | None) -> dict[str, bytes]:
    """Every file of the export but the weights: config.json, generation_config.json (init_from's, else
    the special ids), and the tokenizer's files, by name."""
    files, tokens = hf_tokenizer.tokenizer_files(Path(tokenizer), init_from, cfg.block_size) if tokenizer else ({}, {})
    ids = hf_tokenizer.special_ids(tokens, _token_ids(files), _json_of(init_from, "config.json"))
    config = hf.config_json(cfg, dtype, ids)
    files["config.json"] = json.dumps(config, indent=2).encode()
    own = init_from / "generation_config.json" if init_from is not None else None
    if own is not None and own.is_file():
        files["generation_config.json"] = own.read_bytes()
    else:
        ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        files["generation_config.json"] = json.dumps(ids, indent=2).encode()
    return files


def _check_out(out: Path) -> None:
    """An hf export replaces `out` whole (a previous export): refuse a file, or a directory holding anything an
    export does not write (whatever --out names, nothing else is ever deleted)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file; give a directory (--format hf writes one)")
    others = sorted(p.name for p in out.iterdir() if not EXPORT_FILE.fullmatch(p.name)) if out.is_dir() else []
    if others:
        raise ValueError(f"--out {out}: holds files an export does not write ({', '.join(others[:3])}"
                         f"{', ...' if len(others) > 3 else ''}); give a new or empty directory, or a previous export")


def _swap_in(tmp: Path, out: Path) -> None:
    """`tmp` renamed to `out`; a previous `out` moved aside first and removed after."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old)


def _token_ids(files: dict[str, bytes]):
    """token -> id of the tokenizer.json among `files` (none: no id)."""
    if "tokenizer.json" not in files:
        return lambda token: None
    from tokenizers import Tokenizer
    return Tokenizer.from_str(files["tokenizer.json"].decode()).token_to_id


def _json_of(directory: Path | None, name: str) -> dict | None:
    """The JSON of `directory`/`name`, if both exist."""
    path = directory / name if directory is not None else None
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None


def check_out(out: Path, fmt: str, overwrite: bool) -> None:
    """Refuse an --out that cannot or may not be written, before anything is read (ValueError): too long a path;
    for a raytp file, a directory, or an existing file without `overwrite`; for hf, see _check_out."""
    trust.check_path(out, "--out")
    if fmt == "hf":
        return _check_out(Path(out).absolute())
    if Path(out).is_dir():
        raise ValueError(f"--out {out}: is a directory; give a file name (--format raytp writes one file)")
    if (Path(out).exists() or Path(out).is_symlink()) and not overwrite:
        raise ValueError(f"--out {out}: exists; pass --overwrite to replace it, or give a new name")


def unshipped(source: str, tokenizer, init_from) -> list[str]:
    """What the run dir `source`'s config.yaml names that an export does not ship unless the command line
    names it too (a run dir may be anyone's: its paths are never followed). Lines of advice; [] for anything
    else."""
    try:
        job = trust.inside(source, "config.yaml", "config.yaml")
        if not job.is_file() or job.stat().st_size > 1 << 20:
            return []
        d = trust.load_yaml(job.read_text(), str(job))
    except Exception:  # noqa: BLE001 - advice only: a URL, an unreadable or odd file gives none
        return []
    d = d if isinstance(d, dict) else {}
    tok = (d.get("data") or {}).get("tokenizer") if isinstance(d.get("data"), dict) else None
    init = (d.get("model") or {}).get("init_from") if isinstance(d.get("model"), dict) else None
    lines = []
    if isinstance(tok, str) and not tokenizer:
        lines.append(f"the run's data.tokenizer ({tok[:200]}) is not shipped unless named: --tokenizer PATH")
    if isinstance(init, str) and not init_from:
        lines.append(f"the run's model.init_from ({init[:200]}) is not read unless named: --init-from DIR")
    return lines


def _whole(ckpt, key: str, spec: dict | None):
    """Tensor `key` whole, in its model layout. One stored transposed (a row-parallel weight, split dim
    first) is read as stored and handed out as its transpose 64 rows at a time: one copy in memory."""
    if not (spec and spec.get("transposed")):
        return ckpt.read(key, 0, 1)
    stored = ckpt.read(key, 0, 1, stored=True)  # (in, out)
    return (stored[:, i:i + 64].t() for i in range(0, stored.shape[1], 64))


def embedded_tokenizer(model_file, what: str = "tokenizer") -> str | None:
    """The tokenizer.json text a raytp model file carries, if any (`what` "chat": its chat template and
    special tokens, as JSON)."""
    with open(model_file, "rb") as f:
        if f.read(9)[8:9] != b"{":
            return None  # a format-1 torch file: byte level
    from safetensors import safe_open
    with safe_open(str(model_file), framework="pt") as f:
        return (f.metadata() or {}).get(what)
