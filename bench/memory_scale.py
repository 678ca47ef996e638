"""memory_scale: peak resident memory of the driver and of every worker, at two model sizes, phase by phase.

What a user does (``raytp train``, a checkpoint, ``--resume`` at another TP,
``raytp scale``, ``raytp export``), under raytp's Driver on an embedded Ray, at
a small and a large model; each size in a process of its own (a fresh driver,
a fresh Ray). Per phase, every process's peak RSS (``VmHWM``; reset at the
phase's start through ``/proc/PID/clear_refs``, so it is that phase's peak) is
read; the figure is its *growth* from the small model to the large one, held
against what the model's growth asks:

- state = weights + gradients + AdamW's two moments (16 bytes a parameter);
  a worker's share = state / tp;
- goals: the driver grows <= 0.05x the state's growth; each worker <= 1.3x its
  share's growth (the larger share of the two layouts for a resize); the
  export <= 2x the largest tensor.

Phases: init (TP=4: placement, seeded shards), train (steps and a checkpoint
written by the workers), resume (a new run at TP=2 from that checkpoint: each
worker reads its own slices), resize (that run, live, TP=2 -> 4), export (the
checkpoint to one model file, in a process of its own). Snapshots are off
(``recovery.snapshot_every: 0``); their cost is the phase ``train_snapshots``
(the same steps with a snapshot after each): two host buffers of a shard's
weights and AdamW state per rank of replica 0, by design (raytp.runtime.worker.snapshot_buffers).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER = "the model's own growth: state (weights, grads, AdamW moments) and its share per worker (state / tp)"
SIZES = {  # name -> model keys
    "FULL": {"small": {"n_layer": 8, "n_head": 12, "n_embd": 96}, "large": {"n_layer": 8, "n_head": 12, "n_embd": 768}},
    "QUICK": {"small": {"n_layer": 2, "n_head": 4, "n_embd": 32}, "large": {"n_layer": 2, "n_head": 4, "n_embd": 128}},
}
GOALS = {"driver_over_state": 0.05, "worker_over_share": 1.3, "export_over_largest_tensor": 2.0}
MB = 1 << 20


def _kb(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak(pids) -> None:
    for pid in pids:
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS now
        except OSError:
            pass


def peaks(pids) -> list[int]:
    """VmHWM of each process, bytes."""
    return [_kb(pid, "VmHWM") * 1024 for pid in pids]


def one_size(model: dict, out: str) -> None:
    """Run the phases for one model size in this process (the driver) and write the figures to `out`."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import io

    import ray

    from raytp.config import from_dict
    from raytp.runtime.driver.driver import Driver
    from raytp.runtime.origin import from_checkpoint
    base = {"model": {**model, "block_size": 64, "vocab_size": 256},
            "train": {"steps": 6, "batch_size": 2, "warmup_steps": 1, "eval_interval": 0, "steps_per_call": 2},
            "recovery": {"snapshot_every": 0}, "runtime": {"placement_timeout_s": 120}}
    figs: dict = {}
    me = os.getpid()
    ray.init(address="local", num_cpus=8, include_dashboard=False, namespace="raytp", log_to_driver=False)
    tmp = Path(tempfile.mkdtemp(prefix="raytp-mem-"))
    try:
        def job(tp, **over):
            d = json.loads(json.dumps(base))
            d["parallel"] = {"tp": tp, "dp": 1}
            for k, v in over.items():
                d.setdefault(k, {}).update(v)
            return from_dict(d)

        def pids(d):
            return [p["pid"] for p in d.group.placement]

        d = Driver(job(4, checkpoint={"every": 6}), tmp / "a", "mem-a", out=io.StringIO(), ray_metrics=False)
        reset_peak([me])
        d.start()
        figs["init"] = {"driver": peaks([me])[0], "workers": peaks(pids(d))}
        reset_peak([me] + pids(d))
        d.train_loop()  # 6 steps, the checkpoint of step 6 written by the workers
        figs["train"] = {"driver": peaks([me])[0], "workers": peaks(pids(d))}
        d.release()
        d.log.close()

        d = Driver(job(4, recovery={"snapshot_every": 1}), tmp / "s", "mem-s", out=io.StringIO(), ray_metrics=False)
        d.start()
        reset_peak([me] + pids(d))
        d.train_loop()
        figs["train_snapshots"] = {"driver": peaks([me])[0], "workers": peaks(pids(d))}
        d.release()
        d.log.close()

        init = from_checkpoint(tmp / "a" / "checkpoints")
        d = Driver(job(2, train={"steps": 8}), tmp / "b", "mem-b", out=io.StringIO(), ray_metrics=False,
                   init_state=init)
        reset_peak([me])
        d.start()
        d.train_loop(until=7)
        figs["resume"] = {"driver": peaks([me])[0], "workers": peaks(pids(d))}
        kept = pids(d)
        reset_peak([me] + kept)
        outcome = d.resize(tp=4, dp=1)
        assert outcome.ok, outcome
        d.train_loop()
        figs["resize"] = {"driver": peaks([me])[0], "workers": peaks(pids(d)), "bytes_moved": outcome.bytes}
        d.release()
        d.log.close()

        code = ("import sys, json\nfrom raytp.cli import main\n"
                "try:\n    main(sys.argv[1:], standalone_mode=False)\nfinally:\n"
                "    print(json.dumps({'hwm': [int(l.split()[1]) * 1024 for l in open('/proc/self/status') "
                "if l.startswith('VmHWM')][0]}))\n")
        for fmt in ("raytp", "hf"):
            p = subprocess.run([sys.executable, "-c", code, "export", str(tmp / "a"), "--format", fmt, "--out",
                                str(tmp / f"export-{fmt}")], capture_output=True, text=True, timeout=600, cwd=ROOT)
            assert p.returncode == 0, p.stderr[-2000:]
            figs[f"export_{fmt}"] = {"process": json.loads(p.stdout.strip().splitlines()[-1])["hwm"]}
    finally:
        ray.shutdown()
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    Path(out).write_text(json.dumps(figs))


def model_numbers(model: dict) -> dict:
    """State bytes (16 a parameter) and the largest tensor's bytes, from a meta-device model."""
    import torch

    from raytp.models.args import ModelArgs
    from raytp.models.gpt2.model import GPT
    with torch.device("meta"):
        m = GPT(ModelArgs(**model, block_size=64, vocab_size=256))
    params = m.num_params()
    return {"params": params, "state_bytes": 16 * params,
            "largest_tensor_bytes": max(p.numel() for p in m.parameters()) * 4}


def run(quick: bool = False) -> dict:
    sizes = SIZES["QUICK" if quick else "FULL"]
    got = {}
    for name, model in sizes.items():
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        p = subprocess.run([sys.executable, "-m", "bench.memory_scale", json.dumps(model), out], cwd=ROOT,
                           capture_output=True, text=True, timeout=3000)
        if p.returncode != 0:
            raise RuntimeError(f"memory_scale {name} failed:\n{p.stderr[-3000:]}")
        got[name] = json.loads(Path(out).read_text())
        os.unlink(out)
    small, large = (model_numbers(sizes[k]) for k in ("small", "large"))
    state_growth = large["state_bytes"] - small["state_bytes"]
    fig: dict = {"peer": PEER, "goals": GOALS, "snapshots": "off, but in phase train_snapshots",
                 "models": {k: {**sizes[k], **model_numbers(sizes[k])} for k in sizes},
                 "state_growth_mb": round(state_growth / MB, 1)}
    tps = {"init": 4, "train": 4, "train_snapshots": 4, "resume": 2, "resize": 2}  # resize: the larger share
    for phase, tp in tps.items():
        a, b = got["small"][phase], got["large"][phase]
        share = state_growth / tp
        driver = (b["driver"] - a["driver"]) / state_growth
        workers = [(y - x) / share for x, y in zip(sorted(a["workers"]), sorted(b["workers"]))]
        fig[phase] = {"driver_growth_mb": round((b["driver"] - a["driver"]) / MB, 1),
                      "driver_over_state": round(driver, 3),
                      "worker_growth_mb": [round((y - x) / MB, 1) for x, y in zip(sorted(a["workers"]),
                                                                                 sorted(b["workers"]))],
                      "worst_worker_over_share": round(max(workers), 3),
                      "goals_met": driver <= GOALS["driver_over_state"] and max(workers) <= GOALS["worker_over_share"]}
        if phase == "resize":
            fig[phase]["bytes_moved_large"] = b["bytes_moved"]
    for fmt in ("raytp", "hf"):
        grow = got["large"][f"export_{fmt}"]["process"] - got["small"][f"export_{fmt}"]["process"]
        tensor = large["largest_tensor_bytes"] - small["largest_tensor_bytes"]
        fig[f"export_{fmt}"] = {"growth_mb": round(grow / MB, 1), "largest_tensor_growth_mb": round(tensor / MB, 1),
                                "over_largest_tensor": round(grow / tensor, 2),
                                "goal_met": grow <= GOALS["export_over_largest_tensor"] * tensor}
    return fig


if __name__ == "__main__":
    one_size(json.loads(sys.argv[1]), sys.argv[2])
