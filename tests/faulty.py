"""Workers with injected faults, shipped to Ray by value (tests/ is not on the workers' path)."""
import os
import sys

import ray.cloudpickle

from raytp.runtime.worker import Worker


class DiesInSave(Worker):
    """Rank 1 exits as it begins its file of the checkpoint of step 8 (once per test, via a marker file)."""

    marker = ""

    def __init__(self, job, rank):
        super().__init__(job, rank)
        self.marker_path = type(self).marker

    def begin_save(self, url, directory):
        if self.rank == 1 and self.completed == 8 and not os.path.exists(self.marker_path):
            open(self.marker_path, "w").close()
            os._exit(1)
        return super().begin_save(url, directory)


class DiesInResizeSetup(Worker):
    """Rank 2, started by a TP resize (its setup gets the state to slice), exits there (once per test)."""

    marker = ""

    def __init__(self, job, rank):
        super().__init__(job, rank)
        self.marker_path = type(self).marker

    def setup(self, tp, dp, init_method, source=None):
        if source is not None and self.rank == 2 and not os.path.exists(self.marker_path):
            open(self.marker_path, "w").close()
            os._exit(1)
        return super().setup(tp, dp, init_method, source)


class Slow(Worker):
    """Takes at least 0.4 s per step, so that a short job outlives the start of a spare process."""

    def _step(self, step, before_update=None):
        import time
        t0 = time.perf_counter()
        rec = super()._step(step, before_update)
        time.sleep(max(0.0, 0.4 - (time.perf_counter() - t0)))
        return rec


class Buggy(Worker):
    """Its step raises at step 3, on every rank: an error of the job's code, not a lost worker."""

    def _step(self, step, before_update=None):
        if step == 3:
            raise ZeroDivisionError("a bug in the training code")
        return super()._step(step, before_update)


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
