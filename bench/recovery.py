"""recovery: seconds from SIGKILL of one worker to the next completed step, raytp vs Ray Train.

Both train the same GPT (raytp.models.gpt2; jobs/default.yaml's shape: 4 layers x
128 wide, 4 heads, block 128, batch 8, builtin data, the same batches from
raytp.data.corpus.batch, AdamW, 1 torch thread per worker) on 4 CPU workers,
in one embedded Ray (loopback, 8 CPUs), and both lose the process of world
rank 1 to SIGKILL (pid as the workers report it) right after ``kill_step``
steps completed.

- raytp: its ``Driver`` in a thread, TP=2 x DP=2 and TP=4 x DP=1, in-memory
  snapshots every step (the default), and TP=2 x DP=2 with one warm spare
  (``recovery.spares: 1``; killed once the spare is up). Measured: kill -> the ``recovered``
  event (the first step completed after healing; wall clock), kill -> the
  next metrics.jsonl line, and the ``recovered`` event's own ``seconds``
  (from the driver noticing to that step), with its ``source`` and
  ``lost_steps``; split at the ``failure`` event (the driver found the dead
  rank), the replacement's process being up (imports done, ``Worker.where``'s
  ``up``; a spare's is before the failure, counted as at it) and the ``placed``
  event (it joined the process groups and holds the shard).
- Ray Train 2.60 ``TorchTrainer`` (DDP via ``prepare_model``, 4 workers x 1
  CPU), rank 0 reports a checkpoint every step (``ray.train.report``),
  ``FailureConfig(max_failures=1)``; on restart the loop resumes from
  ``ray.train.get_checkpoint()``. Each worker appends (step, rank, pid, time)
  to a file after each ``report`` returns. Measured: kill -> the first step
  line written by a process of the new worker group, and the steps redone.
  Also ``fit()`` -> first step, for comparison with raytp's start.

- "hang": SIGSTOP instead of SIGKILL (the process stays, answering nothing), raytp TP=2 x DP=2 with the
  default ``recovery.hang_s`` (0.5 s) and the step deadline of the issue's runs (``runtime.step_timeout_s: 8``,
  ``recovery.ping_timeout_s: 3``, the last resort), against Ray Train with ``TorchConfig(timeout_s=30)``
  (gloo's collective timeout: its only hang handling; the default is 1800 s). Measured: stop -> the next
  completed step (raytp: its ``recovered`` event's ``seconds``, the record gap, too). The same with one warm
  spare (``hang_tp2_dp2_spare1``): the detection plus a recovery that starts no process.

- "client killed" (bench/client_killed): SIGKILL of `raytp train` of a run joined to this Ray; the longest
  gap between steps after it against a normal step.

An untimed TP=4 raytp job runs first (a fresh Ray's first actors start slowly);
then per rep: raytp TP=2 x DP=2, raytp TP=4 x DP=1, Ray Train, client killed.
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.client_killed import client_killed_once, figures as client_figures
from bench.snapshots import MODEL, driver, job, jsonl, med, ray_session, say, warm_up

PEER = ("Ray Train 2.60 TorchTrainer (DDP, 4 CPU workers, same GPT and batches, checkpoint every step via "
        "ray.train.report, FailureConfig(max_failures=1), resume from get_checkpoint)")
GOAL_RATIO, GOAL_S = 0.3, 3.5
FULL = {"model": MODEL["FULL"], "batch_size": 8, "kill_step": 6, "after": 6, "reps": 2, "spare_steps": 150}
QUICK = {"model": MODEL["QUICK"], "batch_size": 4, "kill_step": 3, "after": 3, "reps": 1, "spare_steps": 200}
LAYOUTS = ((2, 2, 0), (4, 1, 0), (2, 2, 1))  # (tp, dp, warm spares)
HANG = {"runtime": {"step_timeout_s": 8.0}, "recovery": {"ping_timeout_s": 3.0}}  # the settings
RAY_TRAIN_HANG_TIMEOUT_S = 30.0
GOAL_HANG_S = 3.5
GOAL_SPARE_S = 2.0
KILL_RANK = 1


def _wait(cond, thread: threading.Thread, errors: list | None = None, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the run ended or stalled before the kill step: {errors or 'no error'}")
        time.sleep(0.005)


def _in_thread(fn) -> tuple[threading.Thread, list]:
    errors: list = []

    def body():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errors.append(e)
    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, errors


# ---------------------------------------------------------------- raytp

def _key(tp: int, dp: int, spares: int) -> str:
    return f"tp{tp}_dp{dp}" + (f"_spare{spares}" if spares else "")


def raytp_once(p: dict, tp: int, dp: int, spares: int, run_dir: Path, sig=signal.SIGKILL) -> dict:
    k = p["kill_step"]
    # With a spare, the kill waits for its process to be up, as it is in a job that has run a while: the
    # job runs long enough for that (seconds), and the kill comes after step k or later.
    steps = k + p["after"] + (p["spare_steps"] if spares else 0)
    hang = HANG if sig == signal.SIGSTOP else {"runtime": {}, "recovery": {}}
    cfg = job(p["model"], p["batch_size"], tp, dp, steps, recovery={"spares": spares, **hang["recovery"]},
              runtime=hang["runtime"])
    d = driver(cfg, run_dir)
    t, errors = _in_thread(d.run_to_end)
    _wait(lambda: len(jsonl(run_dir / "metrics.jsonl")) >= k, t, errors)
    if spares:
        _wait(lambda: any(e["kind"] == "spares" and "ready" in e for e in jsonl(run_dir / "events.jsonl")), t,
              errors)
        k = len(jsonl(run_dir / "metrics.jsonl"))
    pid = next(w["pid"] for w in d.group.placement if w["rank"] == KILL_RANK)
    killed = time.time()
    os.kill(pid, sig)
    t.join(timeout=600)
    if t.is_alive() or errors:
        raise RuntimeError(f"raytp TP={tp} x DP={dp} did not finish after the kill: {errors}")
    ev = {e["kind"]: e for e in jsonl(run_dir / "events.jsonl")}  # the last of each kind
    rec, fail, placed = ev["recovered"], ev["failure"], ev["placed"]  # placed: the replacement wired in
    up = max(placed["ranks"][KILL_RANK]["up"], fail["time"])  # the replacement's process ready (a spare: before)
    nxt = next(m for m in jsonl(run_dir / "metrics.jsonl") if m["time"] > killed)
    return {"kill_to_step_s": rec["time"] - killed, "kill_to_next_metrics_line_s": nxt["time"] - killed,
            "event_seconds": rec["seconds"], "kill_to_failure_event_s": fail["time"] - killed,
            "failure_to_placed_s": placed["time"] - fail["time"], "placed_to_step_s": rec["time"] - placed["time"],
            "failure_to_up_s": up - fail["time"], "up_to_placed_s": placed["time"] - up,
            "source": rec["source"], "lost_steps": rec["lost_steps"], "killed_after_step": k,
            "cause": fail["cause"], "detect_s": rec.get("detect_s"),
            "spares_used": len(rec.get("spares", [])),
            "first_step_s": ev["first_step"]["seconds"]}


# ---------------------------------------------------------------- Ray Train

def train_loop(c: dict) -> None:
    """Ray Train's per-worker loop: the same GPT, data and AdamW as raytp, DDP, a checkpoint a step."""
    import json as json_
    import torch
    import ray.train
    import ray.train.torch
    from raytp.models.args import ModelArgs
    from raytp.models.gpt2.model import GPT
    from raytp.data.corpus import batch, load_corpus
    from raytp.train.hyper import Hyper, lr_at
    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    h = Hyper(lr=3e-3, min_lr=3e-4, warmup_steps=2, steps=c["steps"], seed=1337)
    torch.manual_seed(h.seed)
    model = GPT(ModelArgs(**c["model"], dropout=0.0))
    # torch's AdamW, as a Ray Train user has it (decay on matrices only, as raytp's): raytp's own optimizer
    # keeps its state in DP buckets and has no state_dict to checkpoint.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": h.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=h.lr, betas=(h.beta1, h.beta2))
    start, ckpt = 0, ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as cdir:
            st = torch.load(os.path.join(cdir, "state.pt"), weights_only=True)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optim"])
        start = st["step"]
    ddp = ray.train.torch.prepare_model(model)
    corpus = load_corpus("builtin")
    for step in range(start, c["steps"]):
        x, y = batch(corpus, "train", h.seed, step, rank, world, c["batch_size"], c["model"]["block_size"])
        opt.zero_grad(set_to_none=True)
        loss = ddp(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), h.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, h)
        opt.step()
        with tempfile.TemporaryDirectory() as tmp:
            out = None
            if rank == 0:
                torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step + 1},
                           os.path.join(tmp, "state.pt"))
                out = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report({"step": step, "loss": float(loss)}, checkpoint=out)
        with open(c["log"], "a") as f:
            f.write(json_.dumps({"step": step, "rank": rank, "pid": os.getpid(), "time": time.time(),
                                 "start": start}) + "\n")


def ray_train_once(p: dict, work: Path, sig=signal.SIGKILL) -> dict:
    import ray.cloudpickle
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import bench
    k, log = p["kill_step"], work / "steps.jsonl"
    c = {"model": p["model"], "batch_size": p["batch_size"], "steps": k + p["after"], "log": str(log)}
    trainer = TorchTrainer(
        train_loop, train_loop_config=c,
        torch_config=TorchConfig(timeout_s=int(RAY_TRAIN_HANG_TIMEOUT_S)) if sig == signal.SIGSTOP else None,
        scaling_config=ScalingConfig(num_workers=4, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="bench-recovery", storage_path=str(work / "storage"),
                             failure_config=FailureConfig(max_failures=1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    t_fit = time.time()
    t, errors = _in_thread(trainer.fit)
    _wait(lambda: sum(1 for r in jsonl(log) if r["rank"] == 0) >= k, t, errors)
    lines = jsonl(log)
    old_pids = {r["pid"] for r in lines}
    pid = next(r["pid"] for r in lines if r["rank"] == KILL_RANK)
    done = max(r["step"] for r in lines if r["rank"] == 0) + 1
    killed = time.time()
    os.kill(pid, sig)
    t.join(timeout=900)
    if t.is_alive() or errors:
        raise RuntimeError(f"Ray Train did not finish after the kill: {errors}")
    lines = jsonl(log)
    nxt = min((r for r in lines if r["time"] > killed and r["pid"] not in old_pids), key=lambda r: r["time"])
    first = min(r["time"] for r in lines)
    return {"kill_to_step_s": nxt["time"] - killed, "resumed_at_step": nxt["start"],
            "steps_done_at_kill": done, "lost_steps": max(done - nxt["start"], 0),
            "fit_to_first_step_s": first - t_fit}


# ---------------------------------------------------------------- the benchmark

def run(quick: bool = False) -> dict:
    p = QUICK if quick else FULL
    res: dict[str, list[dict]] = {"raytp_" + _key(*c): [] for c in LAYOUTS}
    res["ray_train"], res["raytp_hang"], res["ray_train_hang"], clients = [], [], [], []
    res["raytp_hang_spare"] = []
    with ray_session(8) as ray, tempfile.TemporaryDirectory(prefix="raytp-bench-rec-") as tmp:
        warm_up(p, 4, 1, Path(tmp) / f"recovery-warm-up-{os.getpid()}")
        for i in range(p["reps"]):
            for tp, dp, spares in LAYOUTS:
                key = _key(tp, dp, spares)
                r = raytp_once(p, tp, dp, spares, Path(tmp) / f"rec-{key}-{os.getpid()}-{i}")
                res["raytp_" + key].append(r)
                say(f"recovery: raytp {key} rep {i + 1}: {r['kill_to_step_s']:.2f}s ({r['source']}, "
                    f"{r['spares_used']} spare(s) used)")
            work = Path(tmp) / f"ray-train-{i}"
            work.mkdir()
            r = ray_train_once(p, work)
            res["ray_train"].append(r)
            say(f"recovery: Ray Train rep {i + 1}: {r['kill_to_step_s']:.2f}s")
            hung = raytp_once(p, 2, 2, 0, Path(tmp) / f"rec-hang-{os.getpid()}-{i}", signal.SIGSTOP)
            res["raytp_hang"].append(hung)
            say(f"recovery: raytp hang rep {i + 1}: {hung['kill_to_step_s']:.2f}s ({hung['cause']}, found "
                f"{hung['detect_s']:.2f}s after the last step)")
            hung = raytp_once(p, 2, 2, 1, Path(tmp) / f"rec-hang-spare-{os.getpid()}-{i}", signal.SIGSTOP)
            res["raytp_hang_spare"].append(hung)
            say(f"recovery: raytp hang with a warm spare rep {i + 1}: {hung['kill_to_step_s']:.2f}s (found "
                f"{hung['detect_s']:.2f}s after the last step, {hung['spares_used']} spare(s) used)")
            work = Path(tmp) / f"ray-train-hang-{i}"
            work.mkdir()
            r = ray_train_once(p, work, signal.SIGSTOP)
            res["ray_train_hang"].append(r)
            say(f"recovery: Ray Train hang rep {i + 1}: {r['kill_to_step_s']:.2f}s")
            c = client_killed_once({**p, "kill_step": 20, "client_after": 40}, Path(tmp) / f"client-{os.getpid()}-{i}",
                                   ray.get_runtime_context().gcs_address)
            clients.append(c)
            say(f"recovery: client killed rep {i + 1}: gap at the kill {c['gap_at_kill_s']:.3f}s, "
                f"{c['ratio']:.2f}x a normal step")
    m = p["model"]
    fig: dict = {"peer": PEER,
                 "model": f"GPT {m['n_layer']}L x {m['n_embd']} wide, {m['n_head']} heads, block {m['block_size']}, "
                          f"batch {p['batch_size']}, world size 4, SIGKILL of rank {KILL_RANK} after "
                          f"step {p['kill_step']}", "reps": p["reps"]}
    rt = med([r["kill_to_step_s"] for r in res["ray_train"]])
    fig["ray_train_kill_to_step_s"] = rt
    fig["ray_train_runs_s"] = [round(r["kill_to_step_s"], 2) for r in res["ray_train"]]
    fig["ray_train_lost_steps"] = [r["lost_steps"] for r in res["ray_train"]]
    fig["ray_train_fit_to_first_step_s"] = med([r["fit_to_first_step_s"] for r in res["ray_train"]])
    met = True
    for tp, dp, spares in LAYOUTS:
        key = _key(tp, dp, spares)
        rs = res["raytp_" + key]
        kts = med([r["kill_to_step_s"] for r in rs])
        fig[key] = {
            "raytp_kill_to_step_s": kts, "raytp_runs_s": [round(r["kill_to_step_s"], 2) for r in rs],
            "raytp_kill_to_next_metrics_line_s": med([r["kill_to_next_metrics_line_s"] for r in rs]),
            "raytp_recovered_event_seconds": med([r["event_seconds"] for r in rs]),
            "raytp_kill_to_failure_event_s": med([r["kill_to_failure_event_s"] for r in rs]),
            "raytp_failure_to_replacement_placed_s": med([r["failure_to_placed_s"] for r in rs]),
            "raytp_failure_to_replacement_up_s": med([r["failure_to_up_s"] for r in rs]),
            "raytp_replacement_up_to_placed_s": med([r["up_to_placed_s"] for r in rs]),
            "raytp_placed_to_step_s": med([r["placed_to_step_s"] for r in rs]),
            "source": sorted({r["source"] for r in rs}), "lost_steps": [r["lost_steps"] for r in rs],
            "spares_used": [r["spares_used"] for r in rs],
            "ratio_raytp_to_ray_train": round(kts / rt, 4)}
        met = met and kts / rt <= GOAL_RATIO and kts < (GOAL_SPARE_S if spares else GOAL_S)
    rh, rth = res["raytp_hang"], med([r["kill_to_step_s"] for r in res["ray_train_hang"]])
    hang_s = med([r["kill_to_step_s"] for r in rh])
    fig["hang_tp2_dp2"] = {
        "raytp_stop_to_step_s": hang_s, "raytp_runs_s": [round(r["kill_to_step_s"], 2) for r in rh],
        "raytp_recovered_event_seconds": med([r["event_seconds"] for r in rh]),
        "raytp_detect_s": med([r["detect_s"] for r in rh]), "cause": sorted({r["cause"] for r in rh}),
        "lost_steps": [r["lost_steps"] for r in rh], "source": sorted({r["source"] for r in rh}),
        "raytp_settings": HANG, "ray_train_stop_to_step_s": rth,
        "ray_train_runs_s": [round(r["kill_to_step_s"], 2) for r in res["ray_train_hang"]],
        "ray_train_torch_config_timeout_s": RAY_TRAIN_HANG_TIMEOUT_S,
        "ratio_raytp_to_ray_train": round(hang_s / rth, 4), "goal": f"< {GOAL_HANG_S:g} s from SIGSTOP to the next step"}
    hs = res["raytp_hang_spare"]
    fig["hang_tp2_dp2_spare1"] = {
        "raytp_stop_to_step_s": med([r["kill_to_step_s"] for r in hs]),
        "raytp_runs_s": [round(r["kill_to_step_s"], 2) for r in hs],
        "raytp_recovered_event_seconds": med([r["event_seconds"] for r in hs]),
        "raytp_detect_s": med([r["detect_s"] for r in hs]), "cause": sorted({r["cause"] for r in hs}),
        "lost_steps": [r["lost_steps"] for r in hs], "spares_used": [r["spares_used"] for r in hs],
        "ratio_raytp_to_ray_train": round(med([r["kill_to_step_s"] for r in hs]) / rth, 4)}
    met = met and hang_s < GOAL_HANG_S
    fig["raytp_first_step_s"] = med([r["first_step_s"] for v in res.values() for r in v if "first_step_s" in r])
    fig["goal"] = (f"raytp <= {GOAL_RATIO}x Ray Train and < {GOAL_S:g} s, < {GOAL_SPARE_S:g} s with a warm spare "
                   "(kill -> next completed step)")
    fig["client_killed"] = client_figures(clients)
    fig["goal_met"] = met and fig["client_killed"]["goal_met"]
    return fig
