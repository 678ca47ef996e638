"""What the steps' records say over many steps: a rank that holds the others back, an expert layer out of
balance. Pure.

**Stragglers.** Every rank times its step's compute (the step's wall time less the time inside collectives, where a rank
waits for the slowest of its peers), and the ranks all-gather those times each step (raytp.runtime.worker).
``slowest`` names the step's slowest rank and how much slower it is than the median rank (Megatron's
straggler detector reports the same: the min and max ranks of compute time). ``Stragglers`` follows the
steps and tells once when the same rank has been the slowest by more than ``ratio`` x the median for
``STRAGGLER_STEPS`` steps in a row (an event); it tells again only after another rank took its place.

**Expert imbalance.** A step's record gives, per MoE layer, max/mean tokens per expert (raytp.train.expert_load).
``ImbalanceWatch`` follows the steps and tells once (an ``expert_imbalance`` event) when a layer has been above ``THRESHOLD`` for
``IMBALANCE_STEPS`` steps in a row: its experts are collapsing onto a few (a router that needs the balance loss, a bias
update or a higher coefficient). It tells again about that layer only after it came back under.
"""
from __future__ import annotations

import statistics

STRAGGLER_STEPS = 5  # steps in a row the same rank must be the slowest (by more than the ratio) to be named


def slowest(compute_s: list[float]) -> dict | None:
    """{"rank", "compute_s", "median_s", "ratio"} of the slowest rank of a step; None for a single rank."""
    if len(compute_s) < 2:
        return None
    rank = max(range(len(compute_s)), key=lambda r: compute_s[r])
    median = statistics.median(compute_s)
    return {"rank": rank, "compute_s": compute_s[rank], "median_s": median,
            "ratio": compute_s[rank] / median if median > 0 else float("inf")}


class Stragglers:
    """The run of steps in which one rank has been the slowest by more than `ratio` x the median."""

    def __init__(self, ratio: float):
        self.ratio = ratio
        self.rank: int | None = None  # the rank of the current run of slow steps
        self.steps = 0
        self.named = False  # that run has been told

    def observe(self, step: int, s: dict | None) -> dict | None:
        """The step's ``slowest``: the fields of a `straggler` event when a rank has just stayed the slowest by
        more than the ratio for STRAGGLER_STEPS steps, else None."""
        if s is None or s["ratio"] <= self.ratio:
            self.rank, self.steps, self.named = None, 0, False
            return None
        if s["rank"] != self.rank:
            self.rank, self.steps, self.named = s["rank"], 0, False
        self.steps += 1
        if self.steps < STRAGGLER_STEPS or self.named:
            return None
        self.named = True
        return {"rank": s["rank"], "step": step, "steps": self.steps, "ratio": s["ratio"],
                "compute_s": s["compute_s"], "median_s": s["median_s"]}


THRESHOLD = 2.0  # max/mean tokens per expert: the busiest expert gets twice its share
IMBALANCE_STEPS = 20  # steps in a row above it


class ImbalanceWatch:
    def __init__(self, threshold: float = THRESHOLD, steps: int = IMBALANCE_STEPS):
        self.threshold, self.steps = threshold, steps
        self.since: dict[str, int] = {}  # layer -> first step of its run above the threshold
        self.told: set[str] = set()

    def observe(self, rec: dict) -> dict | None:
        """The event's fields when a layer has just stayed above the threshold long enough, else None."""
        layers = rec.get("experts") or {}
        for layer, figures in layers.items():
            if figures["imbalance"] > self.threshold:
                self.since.setdefault(layer, rec["step"])
            else:
                self.since.pop(layer, None)
                self.told.discard(layer)
        due = sorted((layer for layer, first in self.since.items()
                      if rec["step"] - first + 1 >= self.steps and layer not in self.told), key=int)
        if not due:
            return None
        self.told.update(due)
        return {"layers": [int(layer) for layer in due], "imbalance": [layers[layer]["imbalance"] for layer in due],
                "since_step": [self.since[layer] for layer in due], "threshold": self.threshold, "steps": self.steps}
