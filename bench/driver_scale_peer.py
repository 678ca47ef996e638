"""bench/driver_scale's peer: the driver's streaming and lost-rank check as they were before that benchmark."""
from __future__ import annotations


class OldStepStream:
    """raytp/runtime/cluster/streaming.py's StepStream before this benchmark (the peer): records read rank by
    rank (its calls follow none: call number 0 to the workers' call order)."""

    def __init__(self, workers, layout, start, count, snapshot_every, timeout):
        self.layout, self.start, self.count, self.snap, self.timeout = layout, start, count, snapshot_every, timeout
        self.partial = None
        self.streams = [w.run_steps.options(num_returns="streaming").remote(start, count, snapshot_every, 0)
                        for w in workers]

    def __iter__(self):
        import ray
        for step in range(self.start, self.start + self.count):
            recs = []
            for stream in self.streams:
                ready, _ = ray.wait([stream], timeout=self.timeout, fetch_local=False)
                if not ready:
                    raise TimeoutError("no progress")
                recs.append(ray.get(next(stream)))
                self.partial = recs[0]
            yield step, recs


def old_find_lost(workers, timeout: float) -> dict:
    """WorkerGroup.find_lost before this change: `ref not in ready` on a list, a get per rank."""
    import ray
    pings = [w.ping.remote() for w in workers]
    ready, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout)
    lost = {}
    for rank, ref in enumerate(pings):
        if ref not in ready:
            lost[rank] = "hung"
            continue
        ray.get(ref)
    return lost
