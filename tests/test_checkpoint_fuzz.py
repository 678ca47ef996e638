"""Fuzzing what a checkpoint says about itself (issue 50): seeded random changes to a TP=2 checkpoint's
manifest and its files' safetensors headers, and random safetensors files. Every case ends in a clean
refusal (CheckpointError, FormatError) or an exact load: every tensor read, at TP 1 and at TP 2, is the
untampered checkpoint's to the byte; never another exception, a hang, or other bytes."""
import json
import math
import os
import random
import shutil
import struct
import tempfile
import time
from pathlib import Path

import pytest
import torch

from raytp.files import checkpoint, safetensors_io
from raytp.files.checkpoint import CheckpointError
from raytp.files.checkpoint_manifest import check_model_tensors
from raytp.files.storage import Storage
from untrusted_files import checkpointed_run

CASES = 1000  # of each kind: checkpoints and headers (2,000 in all)
# The cases write files by the thousand: in memory where the machine has a tmpfs (a loaded disk takes ~2 ms a
# write), else under pytest's tmp_path.
FAST_DIR = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
NASTY = [-1, 0, 1, 2, 3, 8, 16, 17, 36, 37, 48, 64, 10 ** 12, 2 ** 63, 1.5, float("nan"), True, False, None, "",
         "F32", "I32", "BF16", "F8_E4M3", "../x", "/dev/zero", "tp001.safetensors", "model/wte.weight",
         [], [16], [37, 16], [16, 37], [0, 4], [[0, 0, 16]], {}, {"a": 1}]


def _spot(doc, rng: random.Random) -> tuple:
    """A random path into a JSON value: a walk down from the top that stops at each level with odds 1/3."""
    path, node = (), doc
    while isinstance(node, (dict, list)) and node and (not path or rng.random() > 1 / 3):
        k = rng.choice(list(node) if isinstance(node, dict) else range(len(node)))
        path, node = path + (k,), node[k]
    return path


def mutate(doc, rng: random.Random):
    """`doc` (a JSON value) with one random change: a value replaced, a key removed, renamed or added, or a
    number nudged; what was done, for the failure message."""
    path = _spot(doc, rng)
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    last, kind = path[-1], rng.random()
    value = parent[last]
    if isinstance(value, int) and not isinstance(value, bool) and kind < 0.3:
        parent[last] = value + rng.choice([-8, -4, -1, 1, 4, 8, 16])
        return f"{path} {value} -> {parent[last]}"
    if isinstance(parent, dict) and kind < 0.45:
        del parent[last]
        return f"{path} removed"
    if isinstance(parent, dict) and kind < 0.6:
        keys = [k for k in parent if k != last]
        new = rng.choice(keys + ["junk", "model/h.0.ln_2.weight", "optim/wte.weight/step"])
        parent[new] = parent.pop(last)
        return f"{path} renamed {new!r}"
    parent[last] = json.loads(json.dumps(rng.choice(NASTY)))
    return f"{path} -> {parent[last]!r}"


def _header(f: Path):
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _with_header(head, data: bytes) -> bytes:
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _reads(found, keys) -> dict:
    """Every tensor whole (TP 1: read from both files), and the weights as TP 2's second slice, as bytes."""
    out = {}
    for k in keys:
        t = found.read(k, 0, 1)
        out[k] = (t.dtype, tuple(t.shape), _bytes(t))
        if k.startswith("model/"):
            out[k, 2] = _bytes(found.read(k, 1, 2))
    return out


@pytest.fixture
def scratch(tmp_path):
    """A directory for the cases' files, removed after."""
    root = Path(tempfile.mkdtemp(prefix="raytp-fuzz-", dir=FAST_DIR or tmp_path))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def original(scratch):
    cfg, _, ckpt = checkpointed_run(scratch / "run", tp=2)
    found = checkpoint.find(str(ckpt), cfg)
    files = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    return cfg, ckpt, files, sorted(found.keys()), _reads(found, found.keys())


def tamper_and_load(original, seed: int, cases: int) -> int:
    """`cases` seeded changes to the checkpoint, each undone after; how many were refused."""
    cfg, ckpt, files, keys, want = original
    rng, refused = random.Random(seed), 0
    try:
        for case in range(cases):
            target = rng.choice(["manifest.json", "tp000.safetensors", "tp001.safetensors"])
            if target == "manifest.json":
                m = json.loads(files[target])
                what = mutate(m, rng)
                (ckpt / target).write_text(json.dumps(m))
            else:
                head, data = _header(ckpt / target)
                what = mutate(head, rng)
                raw = _with_header(head, data)
                (ckpt / target).write_bytes(raw)
                if rng.random() < 0.8:  # the manifest's size made to match: only the header check is left
                    m = json.loads(files["manifest.json"])
                    m["files"][target] = len(raw)
                    (ckpt / "manifest.json").write_text(json.dumps(m))
            try:
                if case % 2:  # as an export reads it: the manifest's own model
                    found = checkpoint.find(str(ckpt))
                    check_model_tensors(found.manifest, found.where)
                else:  # as a resume reads it: the job's model
                    found = checkpoint.find(str(ckpt), cfg)
                got = _reads(found, found.keys())
            except CheckpointError:
                refused += 1
            else:
                assert sorted(found.keys()) == keys and got == want, f"case {case}: {target}: {what}"
            finally:
                for name in {target, "manifest.json"}:
                    (ckpt / name).write_bytes(files[name])
    finally:
        for name, raw in files.items():
            (ckpt / name).write_bytes(raw)
    return refused


def test_every_tampered_manifest_or_header_is_refused_or_loads_exactly(original):
    t0 = time.perf_counter()
    refused = tamper_and_load(original, 50, CASES)
    assert 0.5 * CASES < refused < CASES  # both outcomes happen: the changes reach the checks and the loads
    assert time.perf_counter() - t0 < 120  # no hang (~4 s on an idle machine)


@pytest.mark.slow  # ten times the quick tier's cases, other seeds
def test_ten_thousand_more_tampered_checkpoints_are_refused_or_load_exactly(original):
    assert tamper_and_load(original, 51, 10 * CASES) < 10 * CASES


DTYPES = list(safetensors_io.TORCH) + ["F8_E4M3", "U16", "X"]


def _random_file(rng: random.Random) -> tuple[bytes, dict]:
    """A safetensors file of up to four tensors, usually well formed, sometimes not: (its bytes, its header)."""
    head, at = {}, 0
    for i in range(rng.randint(0, 4)):
        dtype = rng.choice(DTYPES)
        shape = [rng.randint(0, 4) for _ in range(rng.randint(0, 3))]
        n = math.prod(shape) * safetensors_io.TORCH.get(dtype, torch.uint8).itemsize if dtype in safetensors_io.TORCH \
            else math.prod(shape)
        head[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    if rng.random() < 0.2:
        head["__metadata__"] = {"format": rng.choice(["pt", "raytp-checkpoint/2", 3])}
    if head and rng.random() < 0.5:
        mutate(head, rng)
    data = rng.randbytes(max(0, at + rng.choice([0, 0, 0, -1, 1, 8])))
    return _with_header(head, data), head


def test_random_safetensors_files_are_refused_or_read_as_the_format_says(scratch):
    """Our reader against the safetensors library's: what ours reads, byte for byte theirs too."""
    from safetensors import safe_open
    rng, refused, t0 = random.Random(5), 0, time.perf_counter()
    storage, tmp_path = Storage(scratch), scratch
    for case in range(CASES):
        raw, head = _random_file(rng)
        (tmp_path / "f.safetensors").write_bytes(raw)
        try:
            reader = safetensors_io.Reader(storage, "f.safetensors", len(raw))
            got = {name: _bytes(reader.rows(name)) for name in reader.tensors}
        except safetensors_io.FormatError:
            refused += 1
            continue
        (n,) = struct.unpack("<Q", raw[:8])
        data = raw[8 + n:]
        assert got == {k: data[v["data_offsets"][0]:v["data_offsets"][1]] for k, v in reader.tensors.items()}, case
        with safe_open(str(tmp_path / "f.safetensors"), framework="pt") as f:
            assert sorted(f.keys()) == sorted(got) and all(_bytes(f.get_tensor(k)) == got[k] for k in got), case
    assert 0.1 * CASES < refused < CASES
    assert time.perf_counter() - t0 < 60  # no hang (~0.3 s)
