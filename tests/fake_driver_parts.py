"""The driver's other parts for the fake cluster (tests/fakes.py): a control channel in-process and no off-node
snapshot copy."""
import itertools

from raytp.runtime.driver.control_actor import ControlChannel


class LocalControl(ControlChannel):
    """The control channel with the actor's part in-process: the test files requests as the CLI would."""

    def _start(self):
        self.requests, self.outcomes, self.status, self.ids = [], {}, {}, itertools.count(1)
        self.published = 0
        return None

    def file(self, kind, **args) -> int:
        rid = next(self.ids)
        self.requests.append({"id": rid, "kind": kind, **args})
        return rid

    def _send(self, status, ranks):
        self.published += 1
        self.status = {**status, "ranks": self.status.get("ranks", []) if ranks is None else ranks}

    def _take_requests(self):
        out, self.requests = self.requests, []
        return out

    def answer(self, request_id, outcome):
        if request_id is not None:
            self.outcomes[request_id] = outcome.to_dict()

    def close(self):
        pass


class NoCopy:
    """No off-node snapshot copy (a one-node fake cluster has nowhere to keep one)."""

    def __init__(self, run, log):
        self.node = None

    def update(self, group, snapshots, step):
        pass

    def held_step(self, layout):
        return None

    def release(self):
        pass
