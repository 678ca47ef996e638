"""Context parallelism through Ray: a CP=2 run trains like the same job at cp 1, a SIGKILLed CP rank is replaced
and the run ends with the very weights of an unbroken CP=2 run, every step's record once; the same at PP=2 x CP=2
under the distributed optimizer (its AdamW rows cut over the two CP ranks of each stage), whose checkpoint holds the
state of the CP=2 run at zero 0; and an MoE job at CP=2 x EP=2 under zero 1 (experts over the CP ranks). (Its pieces against one device: test_context_parallel.py,
test_context_parallel_training.py.)"""
import dataclasses
import signal

import numpy as np
import pytest
import torch

from helpers import (EP_STEPS, RECOVERY_STEPS, assert_bitwise_equal, ep_job, events, final_state, losses, parallel,
                     recovery_job, run, signal_rank, steps_logged)
from reference_runs import unbroken_run


def _healed(run_dir, steps=RECOVERY_STEPS) -> None:
    assert steps_logged(run_dir) == steps
    recovered = events(run_dir, "recovered")
    assert len(recovered) == 1 and recovered[0]["lost_steps"] == 0


@pytest.mark.slow
def test_a_cp2_run_trains_like_cp1_and_a_killed_cp_rank_heals_bit_for_bit(ray_local, shared_run, tmp_path):
    one = recovery_job(1, 1)
    two = parallel(one, cp=2)
    staged = parallel(two, pp=2, zero=1)
    kill = ((RECOVERY_STEPS // 2, signal_rank(1, signal.SIGKILL)),)
    kill_stage = ((RECOVERY_STEPS // 2 - 3, signal_rank(2, signal.SIGKILL)),)  # stage 1's first CP rank
    dirs = {"cp1": shared_run("ref-tp1-dp1", one)}
    for name, cfg, faults in (("cp2", two, None), ("cp2kill", two, kill), ("pp2cp2z", staged, None),
                              ("pp2cp2zkill", staged, kill_stage)):
        dirs[name] = tmp_path / name
        if faults is None:  # the unbroken runs: in forked ranks, bit for bit a Ray run's (tests/reference_runs.py)
            unbroken_run(cfg, dirs[name], name)
        else:
            run(cfg, dirs[name], name, faults)
    got = {n: np.array(losses(d)) for n, d in dirs.items()}
    a = got["cp1"]
    for n in ("cp2", "pp2cp2z"):
        assert len(got[n]) == RECOVERY_STEPS and np.abs(got[n] - a).max() / np.abs(a).max() < 1e-5, n
    for broken, whole in (("cp2kill", "cp2"), ("pp2cp2zkill", "pp2cp2z")):
        _healed(dirs[broken])
        assert np.array_equal(got[broken], got[whole]), broken
        assert_bitwise_equal(final_state(dirs[broken]), final_state(dirs[whole]))
    zero1, dense = final_state(dirs["pp2cp2z"]), final_state(dirs["cp2"])  # the checkpoints' rows, read back whole
    for n, t in dense["model"].items():
        assert torch.allclose(zero1["model"][n], t, rtol=0, atol=1e-5), n
        for k, v in dense["optim"][n].items():
            assert torch.allclose(zero1["optim"][n][k], v, rtol=1e-3, atol=1e-7), (n, k)


@pytest.mark.slow
def test_a_live_cp_change_2_to_4_to_1_tracks_an_unresized_run(ray_local, shared_run, tmp_path):
    """What `raytp scale RUN --cp N` files, served at step boundaries while the run trains: CP 2 -> 4 -> 1 (every
    worker of the new layout started ahead, the state moved by the planner), the loss curve the cp 1 run's within
    1e-5 relative, every step's record once, each resize's event naming both layouts."""
    import json
    import time

    import ray

    from raytp.runtime.driver.driver import Driver
    one = recovery_job(1, 1)
    ref = shared_run("ref-tp1-dp1", one)
    cfg = parallel(one, cp=2)
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, cpus_per_worker=0.5))  # both layouts fit
    d = Driver(cfg, tmp_path / "run", "cpscale", out=open(tmp_path / "cpscale.out", "w"))
    try:
        d.start()
        for until, cp in ((5, 4), (10, 1)):
            d.train_loop(until=until)
            rid = ray.get(d.control.actor.request.remote("scale", cp=cp))  # what `raytp scale RUN --cp N` files
            d.train_loop(until=until + 1)  # served at this boundary: the new layout's workers start
            while d.pending_resize is not None:  # switched at the next boundary once they are all up (steps
                d.advance_resize()  # of this tiny job are shorter than their start: no step is taken meanwhile)
                time.sleep(0.1)
            assert d.layout.cp == cp
            answer = ray.get(d.control.actor.outcome.remote(rid))
            assert answer["ok"], answer
        d.train_loop()
    finally:
        d.release()
        d.log.close()
    ours, theirs = np.array(losses(tmp_path / "run")), np.array(losses(ref))
    assert len(ours) == RECOVERY_STEPS and np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-5
    resized = [json.loads(line) for line in open(tmp_path / "run" / "events.jsonl") if '"resized"' in line]
    assert [(e["old"].get("cp", 1), e["new"].get("cp", 1)) for e in resized] == [(2, 4), (4, 1)]
    assert all(e["lost_steps"] == 0 and e["bytes"] > 0 for e in resized)
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(RECOVERY_STEPS))


@pytest.mark.slow
def test_an_moe_job_at_cp2_x_ep2_trains_like_one_rank_and_heals_bit_for_bit(ray_local, shared_run, tmp_path):
    """The experts spread over the two CP ranks of the one replica, the AdamW rows cut over them: the one-rank
    job's losses within 1e-5 relative and its checkpoint's state within 1e-5 (read back whole: the expert files
    are named by DP x CP place); a killed rank healed bit for bit."""
    one = ep_job(1, 1, 1)
    dirs = {"moe1": shared_run("moe-ep1", one)}
    split = parallel(one, cp=2, ep=2, zero=1)
    dirs["moecp2"] = tmp_path / "moecp2"
    unbroken_run(split, dirs["moecp2"], "moecp2")  # in forked ranks (tests/reference_runs.py)
    dirs["moecp2kill"] = tmp_path / "moecp2kill"
    run(split, dirs["moecp2kill"], "moecp2kill", ((EP_STEPS // 2, signal_rank(0, signal.SIGKILL)),))
    a, b, c = (np.array(losses(dirs[n])) for n in ("moe1", "moecp2", "moecp2kill"))
    assert len(b) == EP_STEPS and np.abs(b - a).max() / np.abs(a).max() < 1e-5
    _healed(dirs["moecp2kill"], EP_STEPS)
    assert np.array_equal(b, c)
    got, want = final_state(dirs["moecp2"], EP_STEPS), final_state(dirs["moe1"], EP_STEPS)
    assert_bitwise_equal(final_state(dirs["moecp2kill"], EP_STEPS), got)
    for n, t in want["model"].items():
        assert torch.allclose(got["model"][n], t, rtol=0, atol=1e-5), n
        for k, v in want["optim"][n].items():
            assert torch.allclose(got["optim"][n][k], v, rtol=1e-3, atol=1e-7), (n, k)
