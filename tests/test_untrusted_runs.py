"""Run dirs, names and outputs as untrusted input (issue 50, items 1, 2, 4, 6, 8, 9), without Ray: each try
as a careful user or someone who can write a shared run or checkpoint directory would make it, its refusal
(one `error:` line, status 2, before anything starts), and that nothing outside the run's own files was
read, written or deleted."""
import json

import pytest
from safetensors import safe_open

from raytp.files import checkpoint
from raytp.files.storage import Storage
from raytp.models.files import load_model
from raytp.runtime.state.checkpoints import Checkpoints
from offline import Events, save_shards, small_state
from untrusted_files import (Sentinel, checkpointed_run, cli, files_opened, one_error, opened_under, small_job,
                             tree)


# -- 1: an export ships only what its command line names ---------------------------------------------
def test_export_ships_no_file_a_run_dirs_config_names(tmp_path):
    """A run dir's config.yaml naming ~/.ssh/id_rsa as data.tokenizer and another directory as model.init_from:
    the export reads neither (a note says how to ship them), and its metadata holds only what it wrote."""
    secret = Sentinel(tmp_path / "home" / ".ssh" / "id_rsa", "-----BEGIN OPENSSH PRIVATE KEY----- s3cret\n")
    elsewhere = Sentinel(tmp_path / "elsewhere" / "generation_config.json", '{"s3cret": true}\n')
    run = tmp_path / "run"
    checkpointed_run(run, config={"data": {"tokenizer": str(secret.path)},
                                  "model": {"init_from": str(elsewhere.path.parent)}})
    with files_opened() as seen:
        code, out = cli("export", run, "--out", tmp_path / "m.safetensors")
        code_hf, out_hf = cli("export", run, "--format", "hf", "--out", tmp_path / "hf")
    assert code == 0 and code_hf == 0, out + out_hf
    assert "data.tokenizer" in out and "--tokenizer PATH" in out and "--init-from DIR" in out_hf
    assert opened_under(seen, tmp_path / "home") == [] and opened_under(seen, tmp_path / "elsewhere") == []
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        assert set(f.metadata()) == {"format", "config"}  # no tokenizer: none was named
    written = b"".join(p.read_bytes() for p in [tmp_path / "m.safetensors", *(tmp_path / "hf").iterdir()])
    assert b"s3cret" not in written
    assert secret.untouched() and elsewhere.untouched()


def test_a_tokenizer_named_on_the_command_line_is_shipped_only_if_it_is_one(tmp_path):
    run = tmp_path / "run"
    checkpointed_run(run)
    secret = Sentinel(tmp_path / "id_rsa", "not a tokenizer\n")
    code, out = cli("export", run, "--tokenizer", secret.path, "--out", tmp_path / "m.safetensors")
    assert code == 2 and one_error(out) and "not a Hugging Face tokenizer.json" in out
    assert not (tmp_path / "m.safetensors").exists() and secret.untouched()


# -- 2: checkpoints of other runs are not deleted, nor taken for this run's ----------------------------
def test_runs_sharing_a_checkpoint_dir_prune_and_restore_only_their_own(tmp_path):
    cfg, _, shards = small_state(tp=1)
    shared = tmp_path / "shared"
    save_shards(shared, 10, shards, cfg, keep=1, run_id="run-a")
    save_shards(shared, 5, shards, cfg, keep=1, run_id="legacy")  # a checkpoint written before run ids:
    m = json.loads((shared / "step-00000005" / "manifest.json").read_text())
    del m["run_id"]
    (shared / "step-00000005" / "manifest.json").write_text(json.dumps(m))
    a_files = tree(shared / "step-00000010"), tree(shared / "step-00000005")
    for step in (20, 30):
        save_shards(shared, step, shards, cfg, keep=1, run_id="run-b")
    assert checkpoint.list_checkpoints(Storage(shared)) == ["step-00000005", "step-00000010", "step-00000030"]
    assert (tree(shared / "step-00000010"), tree(shared / "step-00000005")) == a_files  # run a's, and unmarked
    save_shards(shared, 40, shards, cfg, keep=1, run_id="run-a")  # a foreign newest
    b = Checkpoints(str(shared), 1, Events(), "run-b")
    assert b.newest().step == 30  # run b's own newest, not run a's step 40
    assert checkpoint.list_checkpoints(Storage(shared)) == ["step-00000005", "step-00000030", "step-00000040"]


def test_a_checkpoint_written_before_run_ids_still_resumes_and_is_never_pruned(tmp_path):
    import torch
    cfg, full, shards = small_state(tp=1)
    save_shards(tmp_path, 10, shards, cfg, run_id="old")
    m = json.loads((tmp_path / "step-00000010" / "manifest.json").read_text())
    del m["run_id"]  # as every manifest before run ids
    (tmp_path / "step-00000010" / "manifest.json").write_text(json.dumps(m))
    found = checkpoint.find(str(tmp_path), cfg, run_id="new")  # a bare --resume of a run that lost its run_id
    assert found.step == 10 and torch.equal(found.read("model/wte.weight", 0, 1), full["model"]["wte.weight"])
    assert Checkpoints(str(tmp_path), 1, Events(), "new").newest().step == 10
    before = tree(tmp_path / "step-00000010")
    for step in (20, 30):
        save_shards(tmp_path, step, shards, cfg, keep=1, run_id="new")
    assert checkpoint.list_checkpoints(Storage(tmp_path)) == ["step-00000010", "step-00000030"]
    assert tree(tmp_path / "step-00000010") == before


def test_a_run_dir_holding_another_runs_files_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = small_job(tmp_path / "job.yaml")
    other = tmp_path / "other"
    checkpointed_run(other, config={"model": {"n_layer": 3}, "train": {"steps": 9}})  # no metrics.jsonl
    before = tree(other)
    code, out = cli("train", job, "--run-dir", other)
    assert code == 2 and one_error(out) and "holds another run's files" in out, out
    (other / "config.yaml").unlink()  # its checkpoints alone are another run's too
    before = tree(other)
    code, out = cli("train", job, "--run-dir", other)
    assert code == 2 and one_error(out) and "holds checkpoints this run did not write" in out, out
    assert tree(other) == before


def test_a_fresh_run_refuses_a_checkpoint_dir_holding_another_runs_checkpoints(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, _, shards = small_state(tp=1)
    save_shards(tmp_path / "team", 10, shards, cfg, run_id="someone-else")
    before = tree(tmp_path / "team")
    job = small_job(tmp_path / "job.yaml", checkpoint={"dir": str(tmp_path / "team"), "every": 1, "keep": 1})
    code, out = cli("train", job, "--run-dir", tmp_path / "mine")
    assert code == 2 and one_error(out) and "step-00000010" in out and "--resume" in out, out
    assert tree(tmp_path / "team") == before and not (tmp_path / "mine").exists()


# -- 4: names are names, in every entry point --------------------------------------------------------
@pytest.mark.parametrize("name", ["../../x", "a/b", "has space", "-lead", "naïve", "x" * 200, ".hidden"])
def test_a_run_name_that_is_not_one_is_refused_and_nothing_is_written(tmp_path, monkeypatch, name):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    job = small_job(tmp_path / "job.yaml")
    code, out = cli("train", job, "--name", name)
    assert code == 2 and one_error(out) and "is not valid" in out, out
    assert list((tmp_path / "cwd").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "job.yaml"]


@pytest.mark.parametrize("run_dir, says", [("my run", "pass --name"), ("d" * 5000, "cannot be used"),
                                           ("a/" * 2100 + "b", "cannot be used")])
def test_a_run_dir_whose_name_or_length_cannot_be_used_is_refused(tmp_path, monkeypatch, run_dir, says):
    monkeypatch.chdir(tmp_path)
    job = small_job(tmp_path / "job.yaml")
    code, out = cli("train", job, "--run-dir", run_dir)
    assert code == 2 and one_error(out) and says in out, out
    assert [p.name for p in tmp_path.iterdir()] == ["job.yaml"]


def test_submit_and_the_job_key_check_names_as_train_does(tmp_path):
    job = small_job(tmp_path / "job.yaml")
    code, out = cli("submit", job, "--name", "../x", "--address", "http://127.0.0.1:1")
    assert code == 2 and one_error(out) and "is not valid" in out
    job = small_job(tmp_path / "named.yaml", name={"x": 1})
    job.write_text(job.read_text().replace("name:\n  x: 1\n", "name: a b\n"))
    code, out = cli("train", job)
    assert code == 2 and "is not a valid run name" in out and "Traceback" not in out


# -- 6: outputs never replace an existing file without --overwrite ------------------------------------
def test_export_does_not_replace_an_existing_file_without_overwrite(tmp_path):
    run = tmp_path / "run"
    checkpointed_run(run)
    victim = Sentinel(tmp_path / "theirs" / "tp000.safetensors", "another run's file\n")
    code, out = cli("export", run, "--out", victim.path)
    assert code == 2 and one_error(out) and "exists; pass --overwrite" in out and victim.untouched()
    code, out = cli("export", run, "--out", tmp_path / "theirs")  # a directory
    assert code == 2 and one_error(out) and "is a directory" in out and victim.untouched()
    assert sorted(p.name for p in (tmp_path / "theirs").iterdir()) == ["tp000.safetensors"]  # nothing partial
    code, out = cli("export", run, "--out", victim.path, "--overwrite")
    assert code == 0, out
    assert load_model(victim.path).cfg.vocab_size == 37


# -- 8: one error line where a traceback was ---------------------------------------------------------
@pytest.mark.parametrize("key, value, says", [("parallel.zero", "-1", "parallel.zero: -1 is not valid"),
                                              ("model.n_embd", str(10 ** 24), "parameters is past"),
                                              ("model.n_layer", str(10 ** 9), "n_layer 1,000,000,000 is past")])
def test_bad_values_give_one_error_line_and_start_nothing(tmp_path, monkeypatch, key, value, says):
    monkeypatch.chdir(tmp_path)
    job = small_job(tmp_path / "job.yaml")
    code, out = cli("train", job, "--set", f"{key}={value}", "--run-dir", tmp_path / "r")
    assert code == 2 and one_error(out) and says in out, out
    assert [p.name for p in tmp_path.iterdir()] == ["job.yaml"]


# -- 9: answers that do not mislead -----------------------------------------------------------------
@pytest.mark.parametrize("args, says", [
    (["scale", "r", "--tp", "0"], "--tp 0: must be at least 1"),
    (["scale", "r", "--dp", "-2"], "--dp -2: must be at least 1"),
    (["scale", "r", "--workers", "0"], "--workers 0: must be at least 1"),
    (["stop", "r", "--timeout", "-5"], "--timeout -5: must be a number of seconds > 0"),
    (["scale", "r", "--tp", "2", "--timeout", "0"], "--timeout 0: must be"),
    (["stop", "../r"], "RUN '../r' is not valid"),
    (["status", "../../etc", "--storage", "/tmp"], "is not valid"),
])
def test_requests_that_cannot_mean_what_they_say_are_refused_before_a_cluster_is_asked(args, says):
    code, out = cli(*args, "--address", "http://127.0.0.1:1")  # nothing listens there: it is never reached
    assert code == 2 and one_error(out) and says in out, out
