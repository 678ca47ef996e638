"""Checkpoints: exact resume, resume at other layouts, atomic saves, clear errors on bad ones."""
import errno
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from helpers import close, drive, job, losses, small_state
from raytp.model import GPTConfig
from raytp.train import checkpoint
from raytp.train.checkpoint import CheckpointError

def full_state(path):
    return checkpoint.load(path)[1]


def test_resume_at_same_layout_is_bitwise_exact(ray_local, tmp_path):
    cfg = job(2, 2, steps=20, checkpoint={"every": 10, "keep": 3})
    d, _, _ = drive(cfg, tmp_path / "straight", "straight")
    close(d)
    ckpts = checkpoint.list_checkpoints(tmp_path / "straight" / "checkpoints")
    assert [p.name for p in ckpts] == ["step-00000010", "step-00000020"]
    manifest, state10 = checkpoint.load(ckpts[0])
    d, _, _ = drive(cfg, tmp_path / "resumed", "resumed", init_state=(manifest["step"], state10, "ckpt"))
    close(d)
    a, b = full_state(ckpts[1]), full_state(tmp_path / "resumed" / "checkpoints" / "step-00000020")
    for n in a["model"]:
        assert torch.equal(a["model"][n], b["model"][n]), n
        for k in a["optim"][n]:
            assert torch.equal(a["optim"][n][k], b["optim"][n][k]), (n, k)
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")[10:]


def test_save_at_tp4_resume_at_other_layouts(ray_local, tmp_path):
    cfg = job(4, 1, steps=20, checkpoint={"every": 10, "keep": 3})
    d, _, saved_logits = drive(cfg, tmp_path / "tp4", "tp4", until=10)
    d.train_loop()  # the run that never changes layout
    close(d)
    ref = np.array(losses(tmp_path / "tp4")[10:])
    manifest, state = checkpoint.load(tmp_path / "tp4" / "checkpoints" / "step-00000010")
    assert manifest["layout"] == {"tp": 4, "dp": 1}
    for tp, dp in [(1, 1), (2, 1), (2, 2)]:
        run = f"from-tp4-to-tp{tp}-dp{dp}"
        d, logits, _ = drive(job(tp, dp, steps=20), tmp_path / run, run, init_state=(10, state, "tp4"))
        close(d)
        assert float((logits - saved_logits).abs().max()) < 1e-5, f"TP={tp} x DP={dp}: logits moved"
        rel = np.abs(np.array(losses(tmp_path / run)) - ref) / ref
        assert rel.max() < 1e-4, f"TP={tp} x DP={dp}: diverged by {rel.max():.2e}"


def test_shards_round_trip_through_disk_with_padding(tmp_path):
    cfg, full, shards = small_state(tp=2)  # vocab 37 at TP=2: padded to 38
    assert shards[1]["model"]["wte.weight"].shape[0] == 19
    path = checkpoint.save(tmp_path, 3, shards, cfg, tp=2, dp=1, keep=2)
    manifest, loaded = checkpoint.load(path, cfg)
    assert manifest["tensors"]["wte.weight"]["shape"] == [37, 16]
    for n in full["model"]:
        assert torch.equal(loaded["model"][n], full["model"][n]), n
        for k in full["optim"][n]:
            assert torch.equal(loaded["optim"][n][k], full["optim"][n][k]), (n, k)


def test_keep_bounds_the_number_of_checkpoints(tmp_path):
    cfg, _, shards = small_state(tp=1)
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, step, shards, cfg, 1, 1, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]


CRASHING_SAVE = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {tests!r})
    from helpers import small_state
    from raytp.train import checkpoint
    cfg, _, shards = small_state(tp=2)
    checkpoint.save({root!r}, 10, shards, cfg, 2, 1, keep=3)
    real_save, calls = torch.save, []
    def save_then_die(obj, f, *a, **k):  # the process dies after the first shard file of the second save
        real_save(obj, f, *a, **k)
        calls.append(1)
        if len(calls) == 1:
            f.flush()
            os._exit(17)
    torch.save = save_then_die
    checkpoint.save({root!r}, 20, shards, cfg, 2, 1, keep=3)
    print("not reached")
""")


def test_process_killed_mid_save_leaves_previous_checkpoint_loadable(tmp_path):
    script = CRASHING_SAVE.format(tests=str(__import__("pathlib").Path(__file__).parent), root=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 17, p.stderr
    assert [x.name for x in tmp_path.iterdir() if x.name.startswith(".tmp-step-00000020")], "no partial save seen"
    path, manifest, _ = checkpoint.load_latest(tmp_path)
    assert path.name == "step-00000010" and manifest["step"] == 10
    cfg, _, shards = small_state(tp=2)
    checkpoint.save(tmp_path, 30, shards, cfg, 2, 1, keep=3)  # the next save sweeps the leftovers
    assert not list(tmp_path.glob(".tmp-*"))


def test_full_disk_mid_save_keeps_previous_and_cleans_up(tmp_path, monkeypatch):
    cfg, _, shards = small_state(tp=2)
    checkpoint.save(tmp_path, 10, shards, cfg, 2, 1, keep=3)
    real_save, calls = torch.save, []

    def failing_save(obj, f, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(tmp_path, 20, shards, cfg, 2, 1, keep=3)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000010"]
    assert checkpoint.load(tmp_path / "step-00000010", cfg)[0]["step"] == 10


@pytest.fixture
def two_checkpoints(tmp_path):
    cfg, _, shards = small_state(tp=2)
    for step in (10, 20):
        checkpoint.save(tmp_path / "checkpoints", step, shards, cfg, 2, 1, keep=3)
    return cfg, tmp_path, tmp_path / "checkpoints" / "step-00000020"


def test_truncated_shard_is_named_and_resume_falls_back(two_checkpoints):
    cfg, run_dir, newest = two_checkpoints
    shard = newest / "shard-tp1.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"shard-tp1\.pt: truncated"):
        checkpoint.load(newest, cfg)
    warnings = []
    path, manifest, _ = checkpoint.load_latest(run_dir, cfg, warn=warnings.append)
    assert path.name == "step-00000010" and "shard-tp1.pt: truncated" in warnings[0]


def test_corrupt_shard_of_the_right_size_is_named(two_checkpoints):
    cfg, _, newest = two_checkpoints
    shard = newest / "shard-tp0.pt"
    shard.write_bytes(b"\0" * shard.stat().st_size)
    with pytest.raises(CheckpointError, match=r"shard-tp0\.pt: cannot be read"):
        checkpoint.load(newest, cfg)


def test_missing_file_and_missing_manifest_are_named(two_checkpoints):
    cfg, _, newest = two_checkpoints
    (newest / "shard-tp0.pt").unlink()
    with pytest.raises(CheckpointError, match=r"shard-tp0\.pt: missing shard file"):
        checkpoint.load(newest, cfg)
    (newest / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json: missing; the checkpoint is incomplete"):
        checkpoint.load(newest, cfg)


def test_checkpoint_of_another_model_shape_is_refused(two_checkpoints):
    cfg, _, newest = two_checkpoints
    other = GPTConfig(**{**cfg.__dict__, "n_embd": 32})
    with pytest.raises(CheckpointError, match=r"another model shape: n_embd 16 \(checkpoint\) vs 32 \(job\)"):
        checkpoint.load(newest, other)
    with pytest.raises(CheckpointError, match="holds no whole checkpoint"):
        checkpoint.load_latest(newest.parent.parent, other)


def test_loading_never_unpickles_code(two_checkpoints, tmp_path):
    cfg, _, newest = two_checkpoints
    shard = newest / "shard-tp0.pt"

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"model": Evil()}, shard)
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"]["shard-tp0.pt"] = shard.stat().st_size
    (newest / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="cannot be read"):
        checkpoint.load(newest, cfg)


def test_packed_snapshot_round_trips_exactly():
    _, full, _ = small_state(tp=1)
    packed = checkpoint.pack_state(full)
    assert set(packed) == {"packed", "data"} and packed["data"].ndim == 1  # one buffer for Ray to store
    back = checkpoint.unpack_state(packed)
    for n in full["model"]:
        assert torch.equal(back["model"][n], full["model"][n])
        for k, v in full["optim"][n].items():
            assert torch.equal(back["optim"][n][k], v) and back["optim"][n][k].dtype == v.dtype
    assert checkpoint.unpack_state(full) is full  # an unpacked state passes through
