"""Checkpoints: written by the workers, read slice by slice at any layout, atomic, refused by name when
broken; format-1 checkpoints still load."""
import errno
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from helpers import close, drive, full_state, job, losses
from offline import save_shards, small_state
from reference_runs import unbroken_run
from raytp.models.args import ModelArgs
from raytp.runtime.origin import from_checkpoint
from raytp.files import checkpoint, safetensors_io
from raytp.files.checkpoint import CheckpointError
from raytp.files.storage import Storage


def assert_states_equal(a, b):
    assert a["model"].keys() == b["model"].keys()
    for n in a["model"]:
        assert torch.equal(a["model"][n], b["model"][n]), n
        for k in a["optim"].get(n, {}):
            assert torch.equal(a["optim"][n][k], b["optim"][n][k]), (n, k)


@pytest.mark.slow  # a Ray job; the format and its reads are tested below without Ray
def test_resume_at_same_layout_is_bitwise_exact(ray_local, tmp_path):
    cfg = job(2, 2, steps=20, checkpoint={"every": 10, "keep": 3})
    unbroken_run(cfg, tmp_path / "straight", "straight")  # forked ranks, bit for bit a Ray run's (reference_runs)
    ckpts = checkpoint.list_checkpoints(Storage(tmp_path / "straight" / "checkpoints"))
    assert ckpts == ["step-00000010", "step-00000020"]
    d, _, _ = drive(cfg, tmp_path / "resumed", "resumed",
                    init_state=from_checkpoint(tmp_path / "straight" / "checkpoints" / ckpts[0]))
    close(d)
    assert_states_equal(full_state(tmp_path / "straight"), full_state(tmp_path / "resumed"))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")[10:]


RESHARD_MODEL = {"n_head": 12, "n_embd": 48, "vocab_size": 257}  # TP 1, 2, 3 and 4 all valid; vocab padded


@pytest.mark.slow
def test_save_at_tp4_dp2_resume_at_other_layouts(ray_local, tmp_path):
    """Every worker reads only its own slices of the files TP=4 wrote, at TP=2 x DP=1 and TP=3."""
    cfg = job(4, 2, steps=14, model=RESHARD_MODEL, checkpoint={"every": 10, "keep": 3}, cpus_per_worker=0.5)
    d, _, saved_logits = drive(cfg, tmp_path / "tp4", "tp4", until=10)
    d.train_loop()  # the run that never changes layout
    close(d)
    ref = np.array(losses(tmp_path / "tp4")[10:])
    ckpt = checkpoint.find(str(tmp_path / "tp4" / "checkpoints" / "step-00000010"))
    assert ckpt.manifest["layout"] == {"tp": 4, "pp": 1, "dp": 2}
    assert sorted(ckpt.manifest["files"]) == [f"tp{i:03d}.safetensors" for i in range(4)]
    for tp, dp in [(2, 1), (3, 1)]:
        run = f"from-tp4-to-tp{tp}-dp{dp}"
        d, logits, _ = drive(job(tp, dp, steps=14, model=RESHARD_MODEL), tmp_path / run, run,
                             init_state=from_checkpoint(ckpt.storage.path(ckpt.dir)))
        close(d)
        assert float((logits - saved_logits).abs().max()) < 1e-5, f"TP={tp} x DP={dp}: logits moved"
        rel = np.abs(np.array(losses(tmp_path / run)) - ref) / ref
        assert rel.max() < 1e-5, f"TP={tp} x DP={dp}: diverged by {rel.max():.2e}"


def test_shards_round_trip_with_padding_and_reshard_on_read(tmp_path):
    cfg, full, shards = small_state(tp=2)  # vocab 37 at TP=2: padded to 38
    path = save_shards(tmp_path, 3, shards, cfg)
    ckpt = checkpoint.find(path)
    assert ckpt.manifest["tensors"]["model/wte.weight"]["shape"] == [37, 16]
    assert_states_equal(full_state(path), full)
    for tp in (1, 3):  # read at another layout straight from the TP=2 files
        from raytp.train.shard_state import slice_state
        for rank in range(tp):
            want = slice_state(full, rank, tp)
            for n, t in want["model"].items():
                assert torch.equal(ckpt.read(f"model/{n}", rank, tp), t), (tp, rank, n)


def test_files_are_plain_safetensors_with_the_split_dim_first(tmp_path):
    from safetensors import safe_open
    cfg, full, shards = small_state(tp=2)
    path = save_shards(tmp_path, 3, shards, cfg)
    with safe_open(os.path.join(path, "tp001.safetensors"), framework="pt") as f:
        w = f.get_tensor("model/h.0.attn.c_proj.weight")  # row-parallel: stored transposed, rows = its slice
        assert torch.equal(w, shards[1]["model"]["h.0.attn.c_proj.weight"].t())
        assert "model/ln_f.weight" not in f.keys()  # replicated tensors are in tp000 only


def test_a_read_touches_only_the_byte_ranges_of_its_slices(tmp_path, monkeypatch):
    cfg, full, shards = small_state(tp=2)
    path = save_shards(tmp_path, 3, shards, cfg)
    ckpt = checkpoint.find(path)
    reads = []
    real = Storage.read_into
    monkeypatch.setattr(Storage, "read_into", lambda self, rel, start, buf: reads.append((rel, len(buf))) or
                        real(self, rel, start, buf))
    t = ckpt.read("model/h.0.mlp.c_fc.weight", 1, 4)  # rows 16..31 of 64: half of TP=2 rank 0's rows
    want = full["model"]["h.0.mlp.c_fc.weight"][16:32]
    assert torch.equal(t, want)
    data = [(rel, n) for rel, n in reads if n == want.numel() * 4]
    assert len(data) == 1, reads  # one ranged read of exactly its bytes (headers aside)


def test_keep_bounds_the_number_of_checkpoints(tmp_path):
    cfg, _, shards = small_state(tp=1)
    for step in (1, 2, 3, 4):
        save_shards(tmp_path, step, shards, cfg, keep=2)
    assert checkpoint.list_checkpoints(Storage(tmp_path)) == ["step-00000003", "step-00000004"]


CRASHING_SAVE = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    from offline import save_shards, small_state
    from raytp.files import safetensors_io
    cfg, _, shards = small_state(tp=2)
    save_shards({root!r}, 10, shards, cfg)
    real, calls = safetensors_io.write, []
    def write_then_die(f, *a, **k):  # the process dies after the first shard file of the second save
        n = real(f, *a, **k)
        calls.append(1)
        if len(calls) == 1:
            f.flush()
            os._exit(17)
        return n
    safetensors_io.write = write_then_die
    save_shards({root!r}, 20, shards, cfg)
    print("not reached")
""")


def test_process_killed_mid_save_leaves_previous_checkpoint_loadable(tmp_path):
    script = CRASHING_SAVE.format(tests=os.path.dirname(__file__), root=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 17, p.stderr
    assert [x.name for x in tmp_path.iterdir() if x.name.startswith(".tmp-step-00000020")], "no partial save seen"
    found = checkpoint.find(str(tmp_path))
    assert found.dir == "step-00000010" and found.step == 10
    cfg, _, shards = small_state(tp=2)
    save_shards(tmp_path, 30, shards, cfg)  # the next save sweeps the leftovers
    assert not list(tmp_path.glob(".tmp-*"))


def test_full_disk_mid_save_keeps_previous_and_cleans_up(tmp_path, monkeypatch):
    cfg, _, shards = small_state(tp=2)
    save_shards(tmp_path, 10, shards, cfg)
    real, calls = safetensors_io.write, []

    def failing(f, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(f, *a, **k)

    monkeypatch.setattr(safetensors_io, "write", failing)
    with pytest.raises(OSError, match="No space left"):
        save_shards(tmp_path, 20, shards, cfg)
    assert checkpoint.find(str(tmp_path)).step == 10


@pytest.fixture
def two_checkpoints(tmp_path):
    cfg, _, shards = small_state(tp=2)
    for step in (10, 20):
        save_shards(tmp_path / "checkpoints", step, shards, cfg)
    return cfg, tmp_path, tmp_path / "checkpoints" / "step-00000020"


def test_truncated_shard_is_named_and_resume_falls_back(two_checkpoints):
    cfg, run_dir, newest = two_checkpoints
    shard = newest / "tp001.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"tp001\.safetensors: truncated"):
        checkpoint.find(str(newest), cfg)
    warnings = []
    found = checkpoint.find(str(run_dir), cfg, warn=warnings.append)
    assert found.dir == "step-00000010" and "tp001.safetensors: truncated" in warnings[0]


def test_corrupt_shard_of_the_right_size_is_named(two_checkpoints):
    cfg, _, newest = two_checkpoints
    shard = newest / "tp000.safetensors"
    shard.write_bytes(b"\0" * shard.stat().st_size)
    with pytest.raises(CheckpointError, match=r"tp000\.safetensors: cannot be read"):
        checkpoint.find(str(newest), cfg)  # sizes match, and still refused: every header is read before a step


def test_missing_file_and_missing_manifest_are_named(two_checkpoints):
    cfg, _, newest = two_checkpoints
    (newest / "tp000.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"tp000\.safetensors: missing shard file"):
        checkpoint.find(str(newest), cfg)
    (newest / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json: missing; the checkpoint is incomplete"):
        checkpoint.find(str(newest), cfg)


def test_checkpoint_of_another_model_shape_is_refused(two_checkpoints):
    cfg, _, newest = two_checkpoints
    other = ModelArgs(**{**cfg.__dict__, "n_embd": 32})
    with pytest.raises(CheckpointError, match=r"another model shape: n_embd 16 \(checkpoint\) vs 32 \(job\)"):
        checkpoint.find(str(newest), other)
    with pytest.raises(CheckpointError, match="holds no whole checkpoint"):
        checkpoint.find(str(newest.parent.parent), other)


def write_format_1(root, step, cfg, shards):
    """A checkpoint as raytp wrote them before format 2: a torch pickle per TP rank and a manifest."""
    from dataclasses import asdict
    from raytp.models.registry import split_of
    d = root / checkpoint.step_dir(step)
    d.mkdir(parents=True)
    files = {}
    for i, sh in enumerate(shards):
        torch.save(sh, d / f"shard-tp{i}.pt")
        files[f"shard-tp{i}.pt"] = (d / f"shard-tp{i}.pt").stat().st_size
    tensors = {n: {**asdict(split_of(n)), "shape": list(t.shape)} for n, t in shards[0]["model"].items()}
    (d / "manifest.json").write_text(json.dumps({"format": checkpoint.FORMAT_V1, "step": step, "model": asdict(cfg),
                                                 "layout": {"tp": len(shards), "dp": 1}, "files": files,
                                                 "tensors": tensors}))
    return d


def test_format_1_checkpoints_still_load_and_never_unpickle_code(tmp_path):
    cfg, full, shards = small_state(tp=2)
    d = write_format_1(tmp_path, 5, cfg, shards)
    assert_states_equal(full_state(d), full)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"model": Evil()}, d / "shard-tp0.pt")
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["files"]["shard-tp0.pt"] = (d / "shard-tp0.pt").stat().st_size
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="cannot be read"):
        checkpoint.find(str(d)).read("model/wte.weight", 0, 1)


def test_packed_snapshot_round_trips_exactly():
    from raytp.train.shard_state import pack_state, unpack_state
    _, full, _ = small_state(tp=1)
    packed = pack_state(full)
    assert set(packed) == {"packed", "data"} and packed["data"].ndim == 1  # one buffer for Ray to store
    back = unpack_state(packed)
    assert_states_equal(back, full)
    assert unpack_state(full) is full  # an unpacked state passes through


def test_a_checkpoint_is_the_directory_holding_its_manifest_whatever_its_name(two_checkpoints, tmp_path):
    """`cp -r .../step-00000020 best/` then `--resume best`: a copy under any name is a checkpoint."""
    import shutil
    cfg, _, newest = two_checkpoints
    best = tmp_path / "copies" / "best"
    shutil.copytree(newest, best)
    found = checkpoint.find(str(best), cfg)
    assert found.step == 20 and found.where.endswith("copies/best")
    assert torch.equal(found.read("model/wte.weight", 0, 1), checkpoint.find(str(newest)).read("model/wte.weight", 0, 1))
    # A directory without a manifest is no checkpoint, and is not taken for one.
    (best / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="holds no whole checkpoint"):
        checkpoint.find(str(best), cfg)
