"""A live TP resize moves the state worker to worker (the driver touches references only), and a resize
that cannot reserve ahead on a cluster the job fills switches inside the job's own bundles."""
import io
import sys

import numpy as np
import pytest
import ray
import torch

from helpers import FIXED, job, one_device_losses, ray_actors
from raytp.runtime.driver.driver import Driver

TENSOR_LIMIT = 4096  # bytes: what the driver may see of any one object (a rendezvous address, some sizes)


def big_objects(obj, found, seen=None):
    """Tensors and arrays over TENSOR_LIMIT bytes inside `obj` (lists, tuples, dicts, dataclasses)."""
    seen = seen if seen is not None else set()
    if id(obj) in seen:
        return found
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor) and obj.numel() * obj.element_size() > TENSOR_LIMIT:
        found.append(f"tensor {tuple(obj.shape)}")
    elif isinstance(obj, np.ndarray) and obj.nbytes > TENSOR_LIMIT:
        found.append(f"array of {obj.nbytes} bytes")
    elif isinstance(obj, dict):
        for v in obj.values():
            big_objects(v, found, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            big_objects(v, found, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        big_objects(vars(obj), found, seen)
    return found


@pytest.mark.slow  # over 10 s: the full suite's, not the quick tier's
def test_tp_2_4_1_moves_state_worker_to_worker_and_the_driver_never_fetches_a_shard(ray_local, tmp_path, monkeypatch):
    d = Driver(job(2, 1, steps=12), tmp_path / "run", "p2p", out=io.StringIO())
    try:
        d.start()
        d.train_loop(until=3)
        fetched, put = [], []
        real_get, real_put = ray.get, ray.put

        def watched_get(refs, *a, **k):
            out = real_get(refs, *a, **k)
            fetched.extend(big_objects(out, []))
            return out

        def watched_put(value, *a, **k):
            put.extend(big_objects(value, []) or ["an object"])
            return real_put(value, *a, **k)

        for tp in (4, 1):
            before = d.logits(FIXED)
            monkeypatch.setattr(ray, "get", watched_get)
            monkeypatch.setattr(ray, "put", watched_put)
            outcome = d.resize(tp=tp, dp=1)
            monkeypatch.setattr(ray, "get", real_get)
            monkeypatch.setattr(ray, "put", real_put)
            assert outcome.ok, outcome
            assert not fetched and not put, f"the driver fetched {fetched} and put {put} during TP -> {tp}"
            assert float((d.logits(FIXED) - before).abs().max()) < 1e-5, f"logits moved at TP -> {tp}"
            assert outcome.bytes > 0
            d.train_loop(until=d.step + 2)
        assert (d.layout.tp, d.layout.dp) == (1, 1) and d.step == 7
    finally:
        d.release()
        d.log.close()


@pytest.mark.slow
def test_a_reshape_on_a_cluster_the_job_fills_switches_in_its_own_bundles(ray_local, tmp_path):
    """TP=4 x DP=1 on all 4 CPUs: TP=1 x DP=2 cannot be reserved beside it, and fits in its bundles. That is
    known from the nodes' free resources at the request (the placement timeout, NEVER_S here, is never
    waited out), the switch happens at the next step boundary, and the pause the resized event reports is
    the gap metrics.jsonl shows between the last step before and the first after. The old processes in the
    new ranks' bundles take the new ranks (no process start), and the loss curve tracks one device's."""
    out = io.StringIO()
    d = Driver(job(4, 1, steps=10), tmp_path / "run", "inplace", out=out)
    try:
        d.start()
        d.train_loop(until=3)
        before = d.logits(FIXED)
        pids = {n: a["pid"] for n, a in ray_actors("raytp.inplace.rank").items()}
        outcome = d.request_resize(d.layout.changed(tp=1, dp=2))
        assert outcome is not None and outcome.ok, outcome  # switched at this boundary: nothing to wait for
        assert "switching inside its own bundles" in out.getvalue()
        assert (d.layout.tp, d.layout.dp) == (1, 2)
        assert float((d.logits(FIXED) - before).abs().max()) < 1e-5
        names = ray_actors("raytp.inplace.rank")
        assert sorted(names) == ["raytp.inplace.rank0", "raytp.inplace.rank1"]
        assert {n: a["pid"] for n, a in names.items()} == {n: pids[n] for n in names}  # the same processes
        d.train_loop()
        assert d.step == 10
    finally:
        d.release()
        d.log.close()
    import json
    (ev,) = [json.loads(line) for line in open(tmp_path / "run" / "events.jsonl") if '"resized"' in line]
    assert (ev["old"], ev["new"]) == ({"tp": 4, "pp": 1, "dp": 1}, {"tp": 1, "pp": 1, "dp": 2}) and ev["lost_steps"] == 0
    assert "in place" in ev["reason"]
    assert ev["seconds"] < d.cfg.runtime.placement_timeout_s  # the timeout was not waited out
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(10))
    after = next(i for i, m in enumerate(metrics) if m["dp"] == 2)
    gap = metrics[after]["time"] - metrics[after]["step_time_s"] - metrics[after - 1]["time"]
    assert ev["stall_s"] == pytest.approx(gap, abs=1e-6), (ev, gap)  # the pause as the curve shows it
    ours, theirs = np.array([m["loss"] for m in metrics]), np.array(one_device_losses(job(1, 1, steps=10)))
    assert (np.abs(ours - theirs) / theirs).max() < 1e-4, "the loss curve left one device's"
    print(ev, file=sys.stderr)
