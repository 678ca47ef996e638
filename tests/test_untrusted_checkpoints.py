"""Checkpoints, datasets and Hugging Face directories as untrusted input (issue 50, items 3, 5, 7, 8), without
Ray: a tampered manifest or header, names in them that are paths, sizes that would build a model for hours;
each refused with one `error:` line (a resume: status 2 before anything starts; an export: status 1, a
broken checkpoint) and nothing outside the directory read."""
import json
import os
import time

import pytest
import torch

from raytp.data import manifest as mf
from raytp.files import checkpoint, safetensors_io
from raytp.files.interop import hf
from raytp.files.checkpoint import CheckpointError
from raytp.files.checkpoint_format import FORMAT_V1
from raytp.files.storage import Storage
from raytp.models.args import ModelArgs
from offline import write_prepared
from untrusted_files import (Sentinel, checkpointed_run, cli, edit_manifest, files_opened, one_error, opened_under,
                             rewrite_header, small_job, tree)


def resume_job(tmp_path):
    """A job of the small state's model (vocabulary 37) that a checkpoint of it resumes."""
    return small_job(tmp_path / "job.yaml", model={"vocab_size": 37})


# -- 3: every tensor's bytes checked against its header and manifest --------------------------------
def test_a_manifest_shape_smaller_than_the_files_is_refused_before_a_resume_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, _, ckpt = checkpointed_run(tmp_path / "run")
    edit_manifest(ckpt, lambda m: m["tensors"]["model/wte.weight"].__setitem__("shape", [18, 16]))
    code, out = cli("train", resume_job(tmp_path), "--resume", ckpt, "--run-dir", tmp_path / "new")
    assert code == 2 and one_error(out) and "model/wte.weight: shape [18, 16]" in out, out
    assert not (tmp_path / "new").exists()


def test_a_manifest_shape_larger_than_the_files_exports_nothing(tmp_path):
    _, _, ckpt = checkpointed_run(tmp_path / "run")
    edit_manifest(ckpt, lambda m: m["tensors"]["model/h.0.ln_1.weight"].__setitem__("shape", [32]))
    code, out = cli("export", ckpt, "--out", tmp_path / "m.safetensors")
    assert code == 1 and one_error(out) and "model/h.0.ln_1.weight: holds F32 [16], the manifest says F32 [32]" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_every_files_shapes_are_held_to_the_manifest_not_only_replicated_ones(tmp_path):
    """The manifest's layout says TP 1: tp000 would hold whole tensors; it holds halves, and is refused."""
    cfg, _, ckpt = checkpointed_run(tmp_path / "run")
    edit_manifest(ckpt, lambda m: m["layout"].__setitem__("tp", 1))
    with pytest.raises(CheckpointError, match=r"tp000\.safetensors: model/.*holds F32 \[.*the manifest says"):
        checkpoint.find(str(ckpt), cfg)


def test_a_read_stays_inside_its_tensors_own_bytes(tmp_path):
    _, _, ckpt = checkpointed_run(tmp_path / "run", tp=1)
    reader = safetensors_io.Reader(Storage(ckpt), "tp000.safetensors")
    rows = reader.tensors["model/wte.weight"]["shape"][0]
    with pytest.raises(safetensors_io.FormatError, match="rows 36..38 asked of a tensor of 37"):
        reader.rows("model/wte.weight", rows - 1, 2)  # one row past it: the next tensor's bytes
    with pytest.raises(safetensors_io.FormatError, match="block"):
        reader.block("model/wte.weight", range(0, 1), range(0, 17))


@pytest.mark.parametrize("change, says", [
    (lambda h: h.__setitem__("junk", 5), "'junk': a header entry needs exactly dtype, shape and data_offsets"),
    (lambda h: h["model/wte.weight"].__setitem__("dtype", "F8_E4M3"), "dtype 'F8_E4M3' is not one raytp reads"),
    (lambda h: h["model/wte.weight"].__setitem__("shape", [37, 17]), "hold 2368 bytes; F32 [37, 17] is 2516"),
    (lambda h: h["model/wte.weight"].__setitem__("data_offsets", [0, 10 ** 12]), "hold 1000000000000 bytes"),
    (lambda h: h["__metadata__"].__setitem__("format", "pt"), "not a raytp checkpoint file"),
])
def test_a_tampered_header_is_refused_by_name_with_one_error_line(tmp_path, change, says):
    """Item 8's junk entry and unknown dtype among them: each refused, none a traceback."""
    _, _, ckpt = checkpointed_run(tmp_path / "run", tp=1)
    rewrite_header(ckpt, "tp000.safetensors", change)
    code, out = cli("export", ckpt, "--out", tmp_path / "m.safetensors")
    assert code == 1 and one_error(out) and "tp000.safetensors" in out and says in out, out
    assert not (tmp_path / "m.safetensors").exists()


# -- 5: names in manifests are names, never paths -------------------------------------------------
@pytest.mark.parametrize("name", ["/dev/zero", "../outside.bin", "sub/../../x", ".hidden"])
def test_a_format_1_manifest_naming_a_path_is_refused_and_reads_nothing(tmp_path, name):
    cfg = ModelArgs(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=37)
    outside = Sentinel(tmp_path / "outside.bin")
    (tmp_path / "ckpt").mkdir()
    from dataclasses import asdict
    (tmp_path / "ckpt" / "manifest.json").write_text(json.dumps(
        {"format": FORMAT_V1, "step": 1, "model": asdict(cfg), "layout": {"tp": 1, "dp": 1}, "files": {name: 0}}))
    with files_opened() as seen, pytest.raises(CheckpointError, match="is not a file name of this directory"):
        checkpoint.find(str(tmp_path / "ckpt"))
    assert "/dev/zero" not in seen and opened_under(seen, outside.path) == [] and outside.untouched()


def test_a_shard_file_linked_out_of_its_checkpoint_is_refused_unread(tmp_path):
    _, _, ckpt = checkpointed_run(tmp_path / "run", tp=1)
    outside = tmp_path / "outside.safetensors"
    os.replace(ckpt / "tp000.safetensors", outside)
    os.symlink(outside, ckpt / "tp000.safetensors")
    with files_opened() as seen, pytest.raises(CheckpointError, match="leads outside"):
        checkpoint.find(str(ckpt))
    assert opened_under(seen, outside) == []


def test_a_datasets_shard_prefix_cannot_lead_out_of_it(tmp_path):
    from raytp.data.token_sources import open_source
    ds = write_prepared(tmp_path / "ds", 0, 1, 200)
    write_prepared(tmp_path / "other", 1, 1, 200)
    before = tree(tmp_path / "other")
    m = json.loads((tmp_path / "ds" / mf.NAME).read_text())
    m["shards"][0]["prefix"] = "../other/shard-00000"
    (tmp_path / "ds" / mf.NAME).write_text(json.dumps(m))
    with files_opened() as seen, pytest.raises(ValueError, match="'../other/shard-00000': '..' is not a file name"):
        open_source(ds, 0.1)
    assert opened_under(seen, tmp_path / "other") == [] and tree(tmp_path / "other") == before
    with pytest.raises(ValueError, match="is not a file name"):
        mf.parse(json.dumps({**m, "shards": [{**m["shards"][0], "prefix": "/etc/passwd"}]}), "m.json")


def test_a_hugging_face_index_cannot_point_out_of_its_directory(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16,
                                                   "n_positions": 8, "vocab_size": 37}))
    outside = Sentinel(tmp_path / "weights.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"wte.weight": "../weights.safetensors"}}))
    with files_opened() as seen, pytest.raises(ValueError, match="'../weights.safetensors' is not a file name"):
        hf.inspect(model)
    assert opened_under(seen, outside.path) == [] and outside.untouched()


# -- 7: sizes bounded before anything is built ------------------------------------------------------
def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]  # 10^10 leaves
    (tmp_path / "bomb.yaml").write_text("\n".join(lines) + "\nname: *a9\n")
    t0 = time.perf_counter()
    code, out = cli("train", tmp_path / "bomb.yaml")
    assert code == 2 and one_error(out) and "alias bomb" in out, out
    assert time.perf_counter() - t0 < 5 and [p.name for p in tmp_path.iterdir()] == ["bomb.yaml"]


def test_a_huge_model_in_init_from_or_a_manifest_is_refused_before_it_is_built(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 10 ** 9, "n_head": 2,
                                                   "n_embd": 16, "n_positions": 8, "vocab_size": 37}))
    t0 = time.perf_counter()
    code, out = cli("train", small_job(tmp_path / "job.yaml", model={"init_from": str(model)}),
                    "--run-dir", tmp_path / "r")
    assert code == 2 and one_error(out) and "n_layer 1,000,000,000 is past" in out, out
    _, _, ckpt = checkpointed_run(tmp_path / "run", tp=1)
    edit_manifest(ckpt, lambda m: m["model"].__setitem__("n_layer", 10 ** 9))
    code, out = cli("export", ckpt, "--out", tmp_path / "m.safetensors")
    assert code == 1 and one_error(out) and "n_layer 1,000,000,000 is past" in out, out
    assert time.perf_counter() - t0 < 10 and not (tmp_path / "r").exists()


def test_a_model_file_saying_n_layer_1e9_is_refused_before_it_is_built(tmp_path):
    import struct
    _, _, ckpt = checkpointed_run(tmp_path / "run", tp=1)
    assert cli("export", ckpt, "--out", tmp_path / "m.safetensors")[0] == 0
    raw = (tmp_path / "m.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    head["__metadata__"]["config"] = json.dumps({**json.loads(head["__metadata__"]["config"]), "n_layer": 10 ** 9})
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    t0 = time.perf_counter()
    code, out = cli("sample", tmp_path / "m.safetensors", "--tokens", "1")
    assert code == 1 and one_error(out) and "n_layer 1,000,000,000 is past" in out, out
    assert time.perf_counter() - t0 < 10


def test_an_untouched_checkpoint_still_exports_exactly(tmp_path):
    """The checks refuse what is wrong, not what is right: every tensor of the export is the state's."""
    from raytp.models.files import load_model
    _, full, ckpt = checkpointed_run(tmp_path / "run")
    code, out = cli("export", ckpt, "--out", tmp_path / "m.safetensors")
    assert code == 0, out
    got = load_model(tmp_path / "m.safetensors").state_dict()
    assert all(torch.equal(got[k], v) for k, v in full["model"].items())
