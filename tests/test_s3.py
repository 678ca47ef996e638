"""Checkpoints in an object store: a real S3-compatible server (moto's, on loopback) started here; the
workers write their own objects, a resume at another layout reads their slices by range, and broken or
unreachable locations are refused by name."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import NEVER_S, close, drive, full_state, job, losses, run
from offline import save_shards, small_state
from raytp.runtime.origin import from_checkpoint
from raytp.files import checkpoint
from raytp.files.storage import Storage

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "raytp-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server on a loopback port, with the bucket; the AWS_* environment pointing at it (for this
    process and for a Ray started after it: fixture s3); shut down afterwards."""
    server = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    port = _free_port()
    proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        deadline = time.monotonic() + NEVER_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "moto_server did not start"
                time.sleep(0.2)
        import boto3
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield env
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def s3(s3_server, no_shared_ray, tmp_path_factory):
    """s3_server, and a fresh local Ray started after it (so the workers have its environment too, and a
    cache of their own: RAYTP_CACHE)."""
    import ray
    saved = os.environ.get("RAYTP_CACHE")
    os.environ["RAYTP_CACHE"] = str(tmp_path_factory.mktemp("ray-cache"))
    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="raytp", log_to_driver=False)
    try:
        yield s3_server
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAYTP_CACHE", None)
        else:
            os.environ["RAYTP_CACHE"] = saved


@pytest.mark.slow
def test_workers_write_their_own_objects_and_a_resume_reads_its_slices(s3, tmp_path, monkeypatch):
    url = f"s3://{BUCKET}/run-a/checkpoints"
    driver_writes = []
    real_open = Storage.open_write
    # In this (the driver's) process only: a shard file written here would be recorded.
    monkeypatch.setattr(Storage, "open_write", lambda self, rel: driver_writes.append(rel) or real_open(self, rel))
    cfg = job(2, 2, steps=12, checkpoint={"every": 6, "keep": 2, "dir": url})
    d, _, saved_logits = drive(cfg, tmp_path / "a", "s3a", until=6)
    d.train_loop()
    close(d)
    names = checkpoint.list_checkpoints(Storage(url))
    assert names == ["step-00000006", "step-00000012"]
    assert not [w for w in driver_writes if w.endswith(".safetensors")], "the driver wrote a shard"
    assert [w for w in driver_writes if w.endswith("manifest.json")], "the driver commits with the manifest"
    ckpt = checkpoint.find(url + "/step-00000006")
    assert sorted(ckpt.manifest["files"]) == ["tp000.safetensors", "tp001.safetensors"]

    d, logits, _ = drive(job(1, 1, steps=12), tmp_path / "b", "s3b", init_state=from_checkpoint(ckpt.where))
    close(d)
    ref = np.array(losses(tmp_path / "a")[6:])
    rel = np.abs(np.array(losses(tmp_path / "b")) - ref) / ref
    assert rel.max() < 1e-5, f"resumed at TP=1 from S3: diverged by {rel.max():.2e}"
    full = full_state(url)
    assert full["model"]["wte.weight"].shape == (256, 64)


def test_broken_objects_are_refused_by_name_and_a_missing_bucket_before_anything_starts(s3_server, tmp_path):
    """A TP=2 checkpoint written to the bucket as the workers write theirs (offline.save_shards, without Ray:
    that the workers write their own objects is test_workers_write_their_own_objects'), then broken."""
    url = f"s3://{BUCKET}/run-c/checkpoints"
    cfg, _, shards = small_state(tp=2)
    save_shards(url, 4, shards, cfg)
    storage = Storage(url)
    storage.write_bytes("step-00000004/tp001.safetensors", storage.read_bytes("step-00000004/tp001.safetensors")[:64])
    with pytest.raises(checkpoint.CheckpointError, match=r"step-00000004/tp001\.safetensors: truncated"):
        checkpoint.find(url + "/step-00000004")
    storage.remove("step-00000004/tp000.safetensors")
    with pytest.raises(checkpoint.CheckpointError, match=r"tp000\.safetensors: missing shard file"):
        checkpoint.find(url + "/step-00000004")

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    p = subprocess.run([sys.executable, "-m", "raytp.cli", "train", "jobs/default.yaml", "--set",
                        "checkpoint.dir=s3://no-such-bucket/x", "--run-dir", str(tmp_path / "r")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "checkpoint.dir" in p.stderr and "no-such-bucket" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_run_mirrored_to_s3_is_described_from_there_after_its_directory_is_gone(s3, tmp_path):
    """runtime.storage on the S3 server: the run's records are copied there as they are written, and its
    checkpoints written there; with the run directory (the head) gone, `raytp status/logs RUN --storage URL`
    read the finished run from the bucket and a resume finds its checkpoint there."""
    url = f"s3://{BUCKET}/runs"
    cfg = job(1, 1, steps=3, storage=url, checkpoint={"every": 3, "keep": 1})
    run_dir = tmp_path / "mirrored"
    run(cfg, run_dir, "mirrored")
    local = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    from raytp.runtime.driver.mirror import read_run
    assert read_run(url, "mirrored")[0] == local
    shutil.rmtree(run_dir)
    p = subprocess.run([sys.executable, "-m", "raytp.cli", "status", "mirrored", "--storage", url],
                       capture_output=True, text=True, timeout=NEVER_S)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"mirrored: FINISHED  step 3/3  TP=1 x PP=1 x DP=1  loss {local[-1]['loss']:.4f}" in p.stdout, p.stdout
    logs = subprocess.run([sys.executable, "-m", "raytp.cli", "logs", "mirrored", "--storage", url],
                          capture_output=True, text=True, timeout=NEVER_S)
    assert logs.returncode == 0 and "[raytp] step 3/3" in logs.stdout, logs
    missing = subprocess.run([sys.executable, "-m", "raytp.cli", "status", "nosuch", "--storage", url],
                             capture_output=True, text=True, timeout=NEVER_S)
    assert missing.returncode == 1 and "error: no run 'nosuch' under" in missing.stderr
    # Its checkpoints went there too (no checkpoint.dir): `--resume` finds them from any machine.
    from raytp.runtime.origin import starting_state
    _, (step, _, found) = starting_state(cfg, "latest", tmp_path / "elsewhere", say=lambda m: None, run="mirrored")
    assert step == 3 and found.startswith(f"{url}/mirrored/checkpoints/")


def test_a_prepared_dataset_at_a_url_is_fetched_once_per_node(s3, tmp_path, monkeypatch):
    """data.source = s3://...: the driver's check reads only the manifest; a worker's open copies the shards
    into the node's cache once (the next open maps the same files), and again only when the dataset at the URL
    was prepared anew."""
    from offline import write_prepared
    from raytp.data.token_sources import open_source
    local = Path(write_prepared(tmp_path / "ds", 0, 0, 200))
    url = f"s3://{BUCKET}/datasets/ds"
    store = Storage(url)
    for f in sorted(local.iterdir()):  # the manifest last, as raytp prepare writes it
        if f.name != "manifest.json":
            store.write_bytes(f.name, f.read_bytes())
    with pytest.raises(ValueError, match=r"s3://raytp-test/datasets/ds: no manifest.json"):
        open_source(url, 0.1)
    store.write_bytes("manifest.json", (local / "manifest.json").read_bytes())
    monkeypatch.setenv("RAYTP_CACHE", str(tmp_path / "cache"))
    seen = open_source(url, 0.1, peek=True)
    assert seen.train is None and seen.vocab_size == 256 and seen.eod_id == 255
    assert not (tmp_path / "cache" / "datasets").exists()  # peeking fetches nothing
    opened, direct = open_source(url, 0.1), open_source(str(local), 0.1)
    for a, b in ((opened.train, direct.train), (opened.val, direct.val)):
        assert np.array_equal(np.concatenate(a.pieces), np.concatenate(b.pieces))
    (copy,) = (tmp_path / "cache" / "datasets").iterdir()
    stamps = {p.name: p.stat().st_mtime_ns for p in copy.glob("shard-*")}
    assert len(stamps) == 4
    open_source(url, 0.1)
    assert {p.name: p.stat().st_mtime_ns for p in copy.glob("shard-*")} == stamps  # mapped again, not copied
    again = Path(write_prepared(tmp_path / "ds2", 1, 0, 200))  # prepared anew at the same URL
    for f in sorted(again.iterdir()):
        store.write_bytes(f.name, f.read_bytes())
    fresh = open_source(url, 0.1)
    assert np.array_equal(np.concatenate(fresh.train.pieces), np.concatenate(open_source(str(again), 0.1).train.pieces))


def _upload(local: Path, url: str) -> None:
    store = Storage(url)
    for f in sorted(local.iterdir()):  # the manifest last, as raytp prepare writes it
        if f.name != "manifest.json":
            store.write_bytes(f.name, f.read_bytes())
    store.write_bytes("manifest.json", (local / "manifest.json").read_bytes())


@pytest.mark.slow
def test_a_run_copies_its_dataset_at_a_url_to_its_nodes_before_workers_start(s3, tmp_path):
    """data.source = s3://...: the launcher has the node copy the dataset in a task before the workers start
    (so a long copy is not cut by the workers' start timeout), the workers train on that copy; a copy that
    fails stops the start with its message, before any worker starts."""
    import io
    import ray
    from offline import write_prepared
    from raytp.config import from_dict
    from raytp.runtime.driver.driver import Driver
    local = Path(write_prepared(tmp_path / "ds", 0, 0, 200))
    url = f"s3://{BUCKET}/datasets/run-ds"
    _upload(local, url)

    def job_on(source):
        d = job(1, 2, steps=3).to_dict()
        d["data"]["source"] = source
        return from_dict(d)
    said = io.StringIO()
    d = Driver(job_on(url), tmp_path / "run", "urlds", out=said)
    try:
        d.start()
        text = said.getvalue()
        assert f"data: copying {url} to 1 node(s)" in text and f"data: {url} on 1 node(s) in" in text, text
        d.train_loop()
    finally:
        close(d)
    assert len(losses(tmp_path / "run")) == 3
    (copy,) = (Path(os.environ["RAYTP_CACHE"]) / "datasets").iterdir()
    assert sorted(p.name for p in copy.glob("shard-*")) == sorted(p.name for p in local.glob("shard-*"))

    broken = f"s3://{BUCKET}/datasets/broken-ds"
    _upload(local, broken)
    Storage(broken).remove("shard-00001.bin")
    d = Driver(job_on(broken), tmp_path / "broken", "urlbroken", out=io.StringIO())
    try:
        with pytest.raises(ValueError, match=rf"{broken}: cannot copy the dataset to .*shard-00001.bin"):
            d.start()
    finally:
        close(d)
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if "urlbroken" in str(a)]


@pytest.mark.slow  # Ray Data reading and writing through a local S3 server: ~17 s
def test_a_corpus_in_s3_is_prepared_into_s3(s3, tmp_path):
    """raytp prepare reading its corpus from S3 and writing the dataset there (moto's server), as it does
    locally: the same shards, byte for byte."""
    import boto3
    from prepare_corpus import SHARD_TOKENS, expected, make_corpus, read_back
    from raytp.data import manifest as manifest_mod
    from raytp.data.prepare import outdir, prepare, prepare_local
    (tmp_path / "corpus").mkdir()
    data, docs, tok_file, tok = make_corpus(tmp_path / "corpus")
    client = boto3.client("s3")
    for p in sorted(data.iterdir()):
        client.upload_file(str(p), BUCKET, f"corpus/{p.name}")
    url = f"s3://{BUCKET}/prepared"
    m = prepare([f"s3://{BUCKET}/corpus/*.jsonl*", f"s3://{BUCKET}/corpus/c.parquet"], str(tok_file), url,
                shard_tokens=SHARD_TOKENS, progress=False)
    store = Storage(url)
    for s in m.shards:
        for suffix in (".bin", ".idx"):
            (tmp_path / f"{s.prefix}{suffix}").write_bytes(store.read_bytes(s.prefix + suffix))
    assert read_back(tmp_path, m) == expected(tok, docs)
    assert store.exists(manifest_mod.NAME) and store.exists(outdir.MARKER)
    local = prepare_local([data], str(tok_file), str(tmp_path / "local"), shard_tokens=SHARD_TOKENS)
    assert local.shards == m.shards
    assert all(store.read_bytes(s.prefix + ".bin") == (tmp_path / "local" / f"{s.prefix}.bin").read_bytes()
               for s in m.shards)
