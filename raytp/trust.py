"""What raytp checks in the files it reads but did not just write: one place, used by every reader.

raytp trusts the job file the user passes and the cluster it runs on. It does not trust run directories,
checkpoints, prepared datasets, Hugging Face directories or any directory others can write: a name read
from one of them is a name, never a path to follow (``inside``), a safetensors header is held to the
format before a byte of data is read (``check_header``), a name given to a run is one name for Ray and
the disk alike (``check_name``), YAML aliases are expanded under a budget (``load_yaml``), and a model's
size is bounded before anything is built from it (``check_model_size``). Each refusal is an
``Untrusted`` (a ValueError): one line saying what, where, and what would be valid.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a file name: no separator, no leading '.' or '-'
MAX_PATH = 4096  # characters of a path (Linux's PATH_MAX)
# Bytes per element of each safetensors dtype raytp reads (the format's names); anything else is refused.
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
MAX_DIMS = 8
YAML_NODES = 100_000  # nodes of a YAML document with its aliases expanded (a job file has a few hundred)
MAX_PARAMS, MAX_LAYERS = 10 ** 13, 4096  # past these no model is built (the largest trained: ~2e12, 126 layers)


class Untrusted(ValueError):
    """What a file raytp did not write says is refused: the message says what, where, and what is valid."""


# -- names and paths --------------------------------------------------------------------------------
def check_path(path: Any, what: str) -> None:
    """A path the user gave that the system can hold: Untrusted for one too long or with a NUL."""
    text = str(path)
    if len(text) > MAX_PATH or any(len(part.encode()) > 255 for part in Path(text).parts) or "\0" in text:
        raise Untrusted(f"{what}: a path of {len(text):,} characters (components of at most 255 bytes, "
                        f"{MAX_PATH} in all) cannot be used")


def plain_name(name: Any, what: str) -> str:
    """`name`, a file name read from a file, if it is one plain name in its directory (no separator, no
    '..', not hidden); else Untrusted."""
    if not isinstance(name, str) or not NAME.fullmatch(name) or len(name) > 255:
        raise Untrusted(f"{what}: {str(name)[:80]!r} is not a file name of this directory (letters, digits, "
                        "'.', '_', '-'; no '/' or '..')")
    return name


def relative(rel: Any, what: str) -> str:
    """`rel` if it is a relative path of plain names ('a/b.bin'); else Untrusted."""
    if not isinstance(rel, str) or not rel or len(rel) > MAX_PATH:
        raise Untrusted(f"{what}: {str(rel)[:80]!r} is not a relative path")
    for part in rel.split("/"):
        plain_name(part, f"{what}: {rel[:80]!r}")
    return rel


def inside(root, rel: Any, what: str) -> Path:
    """root/rel, where `rel` (read from a file describing `root`) is a relative path that stays inside
    `root` once links are followed; else Untrusted naming it."""
    relative(rel, what)
    root = Path(root)
    path = root / rel
    if not path.resolve().is_relative_to(root.resolve()):
        raise Untrusted(f"{what}: {rel!r} leads outside {root} (through a link)")
    return path


# -- safetensors headers ------------------------------------------------------------------------------
def check_header(tensors: Any, data_bytes: int | None, in_order: bool = False) -> dict:
    """A safetensors header's tensors ({name: {dtype, shape, data_offsets}}, "__metadata__" removed) held
    to the format: a known dtype, a shape of non-negative integers, offsets whose span is dtype x shape
    bytes, all of them tiling the data section (`data_bytes` long, if known) with no gap and no overlap;
    `in_order`: in the order the header lists them (as raytp writes its files). The tensors; Untrusted."""
    if not isinstance(tensors, dict):
        raise Untrusted("header is not a JSON object")
    spans = []
    for name, v in tensors.items():
        if not isinstance(v, dict) or set(v) != {"dtype", "shape", "data_offsets"}:
            raise Untrusted(f"{str(name)[:80]!r}: a header entry needs exactly dtype, shape and data_offsets")
        dtype, shape, offsets = v["dtype"], v["shape"], v["data_offsets"]
        if not isinstance(dtype, str) or dtype not in ITEM_BYTES:
            raise Untrusted(f"{name}: dtype {str(dtype)[:20]!r} is not one raytp reads ({', '.join(ITEM_BYTES)})")
        if not _ints(shape) or len(shape) > MAX_DIMS:
            raise Untrusted(f"{name}: shape {str(shape)[:80]} is not a list of at most {MAX_DIMS} integers >= 0")
        if not _ints(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
            raise Untrusted(f"{name}: data_offsets {str(offsets)[:80]} is not [begin, end] with begin <= end")
        if offsets[1] - offsets[0] != math.prod(shape) * ITEM_BYTES[dtype]:
            raise Untrusted(f"{name}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes; {dtype} "
                            f"{shape} is {math.prod(shape) * ITEM_BYTES[dtype]}")
        spans.append((offsets[0], offsets[1], name))
    at = 0
    for begin, end, name in (spans if in_order else sorted(spans, key=lambda s: (s[0], s[1]))):
        if begin != at:
            raise Untrusted(f"{name}: data at bytes {begin}..{end}, {'overlapping' if begin < at else 'past a gap'}"
                            f" ({'the tensors before it in the header end' if in_order else 'the data before it ends'}"
                            f" at {at})")
        at = end
    if data_bytes is not None and at != data_bytes:
        raise Untrusted(f"the tensors' data ends at byte {at} of a data section of {data_bytes}")
    return tensors


def _ints(xs: Any) -> bool:
    return isinstance(xs, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs)


# -- YAML -------------------------------------------------------------------------------------------
def load_yaml(text, where: str, budget: int = YAML_NODES) -> Any:
    """yaml.safe_load of `text` (a str or a file) whose aliases, expanded, make at most `budget` nodes (an
    alias bomb is refused before it is built); yaml.YAMLError for bad YAML, Untrusted for a bomb."""
    import yaml

    class Loader(yaml.SafeLoader):
        def compose_document(self):
            node = super().compose_document()
            _weigh(node, budget, where)
            return node

    loader = Loader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _weigh(root, budget: int, where: str) -> None:
    """Refuse a YAML node graph of more than `budget` nodes once aliases are expanded, or a cyclic one."""
    sizes: dict[int, int] = {}
    stack, open_ = [(root, False)], set()
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            open_.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in _children(node))
            if sizes[key] > budget:
                raise Untrusted(f"{where}: its aliases expand to more than {budget:,} YAML nodes (an alias bomb?)")
            continue
        if key in sizes:
            continue
        if key in open_:
            raise Untrusted(f"{where}: an alias refers to the node holding it (a cycle)")
        open_.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)


def _children(node) -> list:
    if isinstance(node.value, list):
        return [c for item in node.value for c in (item if isinstance(item, tuple) else (item,))]
    return []


# -- sizes ------------------------------------------------------------------------------------------
def approx_params(cfg) -> int:
    """About how many parameters a model of `cfg` (ModelArgs) has, from its numbers alone (nothing built)."""
    hd = cfg.head_width
    attn = cfg.n_embd * hd * (2 * cfg.n_head + 2 * cfg.kv_heads)
    mlp = 3 * cfg.n_embd * cfg.mlp_width
    if cfg.moe is not None:
        mlp += 3 * cfg.n_embd * cfg.moe.moe_ffn * cfg.moe.n_experts
    return cfg.n_layer * (attn + mlp) + 2 * cfg.vocab_size * cfg.n_embd + cfg.block_size * cfg.n_embd


def check_model_size(cfg, where: str) -> None:
    """Refuse (Untrusted) a model too large to be built, before anything is: past MAX_LAYERS layers or
    about MAX_PARAMS parameters."""
    for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
        v = getattr(cfg, key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise Untrusted(f"{where}: {key} {str(v)[:40]!r} is not an integer > 0")
    if cfg.n_layer > MAX_LAYERS:
        raise Untrusted(f"{where}: n_layer {cfg.n_layer:,} is past the {MAX_LAYERS:,} layers raytp builds")
    try:
        n = approx_params(cfg)
    except (ArithmeticError, TypeError, ValueError) as e:
        raise Untrusted(f"{where}: not the numbers of a model ({e})") from None
    if n > MAX_PARAMS:
        raise Untrusted(f"{where}: a model of about {n:.3g} parameters is past the {MAX_PARAMS:.0e} raytp builds")
