"""Which expert layer stays out of balance. Pure.

A step's record gives, per MoE layer, max/mean tokens per expert (raytp.train.expert_load). ``ImbalanceWatch``
follows the steps and tells once (an ``expert_imbalance`` event) when a layer has been above ``THRESHOLD`` for
``STEPS`` steps in a row: its experts are collapsing onto a few (a router that needs the balance loss, a bias
update or a higher coefficient). It tells again about that layer only after it came back under.
"""
from __future__ import annotations

THRESHOLD = 2.0  # max/mean tokens per expert: the busiest expert gets twice its share
STEPS = 20       # steps in a row above it


class ImbalanceWatch:
    def __init__(self, threshold: float = THRESHOLD, steps: int = STEPS):
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
