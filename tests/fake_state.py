"""The fake workers' state (tests/fakes.py): one float64 number x that each step s moves by ``delta(s)``, kept
under a real parameter name; and object references and ids as the fake cluster hands them out."""
import itertools

import torch

_ids = itertools.count()
NAME = "ln_f.weight"  # the fake state's one tensor, under a real parameter name (checkpoints read it)


def delta(step: int) -> float:
    return 1.0 / (step + 3)


def expected_x(steps: int) -> float:
    x = 0.0
    for s in range(steps):
        x += delta(s)
    return x


def state_of(x: float) -> dict:
    return {"model": {NAME: torch.tensor([x], dtype=torch.float64)}, "optim": {}}


class _Id:
    def __init__(self):
        self.n = next(_ids)

    def hex(self) -> str:
        return f"{self.n:08x}"


class Ref:
    """An object reference: resolved at once, or once the cluster's clock reaches `at`."""

    def __init__(self, value=None, cluster=None, at=0):
        self.value, self.cluster, self.at = value, cluster, at

    def done(self) -> bool:
        return self.cluster is None or self.cluster.clock >= self.at
