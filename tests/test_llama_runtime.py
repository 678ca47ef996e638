"""The runtime on the Llama at TP=4 (more ranks than its 2 KV heads: each KV head is held by two ranks):
a SIGKILLed worker is replaced with nothing lost, bit for bit; a live TP resize 4 -> 2 -> 4 -> 2 keeps
the model and tracks the unresized run; the checkpoint reads back at any TP degree."""
import io
import json
import signal

import numpy as np
import pytest
import ray
import torch

from helpers import FIXED, assert_bitwise_equal, events, final_state, job, losses, run, signal_rank
from reference_runs import unbroken_run
from raytp.runtime.driver.driver import Driver
from raytp.files import checkpoint

LLAMA = {"arch": "llama", "n_head": 4, "n_kv_head": 2, "intermediate_size": 96}
STEPS = 8


def llama_job(tp, dp):
    """A checkpoint at the end, a snapshot after every step."""
    return job(tp, dp, steps=STEPS, checkpoint={"every": STEPS, "keep": 2}, recovery={"snapshot_every": 1},
               step_timeout_s=30.0, model=LLAMA)


@pytest.fixture(scope="module")
def ray_eight(no_shared_ray):
    """Room for two TP=4 layouts at once (a resize reserves the new one first)."""
    ray.init(address="local", num_cpus=8, include_dashboard=False, namespace="raytp", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(ray_eight, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("llama-ref")
    unbroken_run(llama_job(4, 1), run_dir, "llamaref")  # forked ranks, no Ray (tests/reference_runs.py)
    return run_dir


@pytest.mark.slow
def test_sigkill_on_llama_with_shared_kv_heads_loses_nothing(reference, tmp_path):
    run(llama_job(4, 1), tmp_path / "run", "llamakill", faults=[(3, signal_rank(1, signal.SIGKILL))])
    assert_bitwise_equal(final_state(tmp_path / "run", STEPS), final_state(reference, STEPS))
    (fail,), (rec,) = events(tmp_path / "run", "failure"), events(tmp_path / "run", "recovered")
    assert fail["rank"] == 1 and rec["source"] == "snapshot"


@pytest.mark.slow
def test_checkpoint_with_shared_kv_heads_reads_at_every_tp(reference):
    """Saved at TP=4 (two ranks hold each KV head; only its owner writes it): read at TP=1, 2, 4, the
    shards join to the same model."""
    ckpt = checkpoint.find(str(reference / "checkpoints"))
    key = "model/layers.0.self_attn.k_proj.weight"
    assert ckpt.manifest["tensors"][key]["shape"] == [2 * 16, 64] and ckpt.manifest["tensors"][key]["heads"] == 2
    whole = ckpt.read(key, 0, 1)
    assert torch.equal(torch.cat([ckpt.read(key, r, 2) for r in range(2)]), whole)
    assert all(torch.equal(ckpt.read(key, r, 4), whole[16 * (r // 2):16 * (r // 2 + 1)]) for r in range(4))


@pytest.mark.slow
def test_live_tp_resize_on_llama(reference, tmp_path):
    phases = [(4, 1), (2, 1), (4, 1), (2, 1)]
    per = STEPS // len(phases)
    d = Driver(llama_job(4, 1), tmp_path / "run", "llamaresize", out=io.StringIO())
    try:
        d.start()
        for i, (tp, dp) in enumerate(phases):
            if i:
                before = d.logits(FIXED)
                outcome = d.resize(tp=tp, dp=dp)
                assert outcome.ok, outcome
                assert float((d.logits(FIXED) - before).abs().max()) < 1e-5, f"logits moved at -> TP={tp}"
            d.train_loop(until=per * (i + 1))
    finally:
        d.release()
        d.log.close()
    ours, theirs = np.array(losses(tmp_path / "run")), np.array(losses(reference))
    assert len(ours) == STEPS and (np.abs(ours - theirs) / theirs).max() < 1e-4
    resized = [json.loads(line) for line in open(tmp_path / "run" / "events.jsonl")]
    assert [e["new"]["tp"] for e in resized if e["kind"] == "resized"] == [2, 4, 2]
