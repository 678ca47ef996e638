"""Faults in random order, from a seed: kills and stops (hangs) of random ranks at random moments, some of them
while the recovery of the one before runs, some on the rank just replaced. A plan is a pure function of its
seed (print it, rerun it); its faults are sent from outside, as reality sends them, by ``run_with``."""
from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import time
from dataclasses import dataclass

from helpers import assert_bitwise_equal, events, final_state, losses, ray_actors, run

SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


@dataclass(frozen=True)
class Fault:
    after: int      # sent once this many steps' records are in metrics.jsonl
    delay: float    # seconds after that: inside a step, between steps, or inside a recovery
    rank: int
    kind: str       # "kill" (SIGKILL) or "stop" (SIGSTOP: a hang)
    pid: int = 0    # the process it reached, once sent


def plan(seed, world: int, steps: int, kills: int, stops: int = 0) -> list[Fault]:
    """`kills` + `stops` faults over steps 1 .. steps-3 of a job of `world` ranks. About one in three follows
    the fault before it at once (0.3-1.5 s later: inside its recovery) and is a kill, one time in two on the same
    rank (its replacement dies again); the others fall at a random step, 0-0.3 s after its record."""
    rng = random.Random(f"faults-{seed}")
    kinds = ["kill"] * kills + ["stop"] * stops
    rng.shuffle(kinds)
    out: list[Fault] = []
    for kind in kinds:
        if out and kind == "kill" and rng.random() < 1 / 3:  # (a stop while a replacement starts: not yet)
            before = out[-1]
            rank = before.rank if rng.random() < 0.5 else rng.randrange(world)
            out.append(Fault(before.after, before.delay + rng.uniform(0.3, 1.5), rank, kind))
        else:
            out.append(Fault(rng.randrange(1, steps - 2), rng.uniform(0.0, 0.3), rng.randrange(world), kind))
    return sorted(out, key=lambda f: (f.after, f.delay))


def sender(fault: Fault, sent: list, t_first: list):
    """The action (raytp's run name -> None) that sends `fault` to the process now holding its rank (a
    replacement may still be starting: it waits for it, up to 60 s); appends the fault to `sent` once sent."""
    def action(run_name: str) -> None:
        if not t_first:
            t_first.append(time.monotonic())
        time.sleep(max(0.0, fault.delay - (time.monotonic() - t_first[-1])))
        name = f"raytp.{run_name}.rank{fault.rank}"
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            pid = ray_actors(name).get(name, {}).get("pid")
            if pid:
                try:
                    os.kill(pid, SIGNALS[fault.kind])
                    sent.append(dataclasses.replace(fault, pid=pid))
                    return
                except ProcessLookupError:  # gone between the look-up and the signal: look again
                    pass
            time.sleep(0.05)
    return action


def run_with(cfg, run_dir, name: str, faults: list[Fault], worker_cls=None) -> list[Fault]:
    """Run `cfg` to its end, sending `faults`; the faults that reached a process. Faults of one step are
    timed from the first of them (t_first), so that a fault inside a recovery lands inside it."""
    sent: list[Fault] = []
    actions = []
    for i, f in enumerate(faults):
        t_first: list = []
        if i and faults[i - 1].after == f.after:
            t_first = actions[-1][2]  # the same clock as the fault before it
        actions.append((f.after, sender(f, sent, t_first), t_first))
    kw = {"worker_cls": worker_cls} if worker_cls is not None else {}
    run(cfg, run_dir, name, faults=[(after, act) for after, act, _ in actions], **kw)
    return sent


def assert_exact(run_dir, reference_dir, steps: int, sent: list[Fault]) -> None:
    """Every step's record once, every loss and the final weights as the unbroken run's, bit for bit, a
    failure event for each rank a fault reached, and none found hung that was not stopped."""
    got = [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")]
    assert got == list(range(steps)), f"steps recorded: {got}"
    ours, theirs = losses(run_dir), losses(reference_dir)
    first = next((s for s, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    assert first is None, f"the loss leaves the unbroken run's at step {first}: {ours[first]} vs {theirs[first]}"
    assert_bitwise_equal(final_state(run_dir, steps), final_state(reference_dir, steps))
    failed = {e["rank"] for e in events(run_dir, "failure")}
    placed = [[(r["rank"], r["pid"]) for r in e["ranks"]] for e in events(run_dir, "placed")]
    assert {f.rank for f in sent} <= failed, (sent, events(run_dir, "failure"), placed)
    # no rank found hung that was not stopped (the heartbeat's false alarm, on a machine merely slow)
    stopped = [f for f in sent if f.kind == "stop"]
    hung = [e for e in events(run_dir, "failure") if e["cause"] == "hung"]
    assert len(hung) <= len(stopped) and {e["rank"] for e in hung} <= {f.rank for f in stopped}, (sent, hung)
