"""The run's record: metrics.jsonl, events.jsonl, and Ray metrics for the dashboard.

Every line is flushed as written, so `tail -f` and a crashed run both see
everything up to the last step. Ray metrics carry the prefix ``raytp_`` and a
``run`` tag (the README's "Ray metrics"); counters are exported at 0 from the
run's start.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from raytp.runtime.driver.watches import ImbalanceWatch, Stragglers


GAUGES = {
    "loss": "training loss of the last step",
    "val_loss": "validation loss of the last evaluation",
    "tokens_per_second": "tokens per second of the last step",
    "step_seconds": "wall time of the last optimizer step",
    "comm_seconds": "time inside collectives in the last step (rank 0)",
    "comm_hidden_seconds": "time rank 0's TP entry collectives ran behind compute in the last step (tp_overlap)",
    "step": "last completed optimizer step",
    "world_size": "ranks in the current layout",
    "tflops": "model TFLOP/s per device of the last step",
    "mfu": "model FLOPs utilisation of the last step (where the device's peak is known)",
    "peak_memory_bytes": "highest peak memory of a worker in the last step (GPU reserved, or CPU resident)",
    "data_seconds": "time the slowest reporting rank took to build its batch in the last step",
    "expert_imbalance": "the worst expert layer's max/mean tokens per expert in the last step (MoE models only)",
}
EXPERT_ONLY = ("expert_imbalance",)  # exported by runs of models with expert layers only
RANK_GAUGES = {
    "rank_compute_seconds": "a rank's compute time in the last step up to its update (less its time in collectives)",
}
COUNTERS = {
    "steps": "optimizer steps completed",
    "failures": "worker failures seen",
    "recoveries": "recoveries completed",
    "resizes": "resizes completed",
}


def exported_names() -> list[str]:
    """Every metric raytp exports, as named in Ray. (Ray's Prometheus endpoint prefixes them: `ray_raytp_loss`.)"""
    return [f"raytp_{k}" for k in (*GAUGES, *RANK_GAUGES)] + [f"raytp_{k}_total" for k in COUNTERS]


class RayMetrics:
    """Gauges and counters exported through Ray's metrics agent (dashboard, Prometheus)."""

    def __init__(self, run: str):
        from ray.util.metrics import Counter, Gauge
        tags = ("run",)
        self.tags = {"run": run}
        self.gauges = {k: Gauge(f"raytp_{k}", description=d, tag_keys=tags) for k, d in GAUGES.items()}
        self.counters = {k: Counter(f"raytp_{k}_total", description=d, tag_keys=tags) for k, d in COUNTERS.items()}
        self.rank_gauges = {k: Gauge(f"raytp_{k}", description=d, tag_keys=("run", "rank"))
                            for k, d in RANK_GAUGES.items()}
        # Every counter exists from the start, at 0: a series never recorded is never exported, and a
        # dashboard panel of failures would say "No data" instead of 0. Counter.inc refuses 0, so the point
        # is recorded the way inc records it.
        for counter in self.counters.values():
            counter._record(0.0, tags=self.tags)

    def set(self, name: str, value: float) -> None:
        self.gauges[name].set(float(value), tags=self.tags)

    def set_ranks(self, name: str, values: list[float]) -> None:
        """A gauge per rank (tagged `rank`)."""
        for rank, value in enumerate(values):
            self.rank_gauges[name].set(float(value), tags={**self.tags, "rank": str(rank)})

    def inc(self, name: str, value: float = 1.0) -> None:
        self.counters[name].inc(value, tags=self.tags)


class RunLog:
    """Appends to <run_dir>/metrics.jsonl and events.jsonl; mirrors figures to Ray metrics."""

    def __init__(self, run_dir: Path, run: str, ray_metrics: bool = True, straggler_ratio: float = 1.2,
                 trackers=None, mirror=None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(self.dir / "metrics.jsonl", "a", buffering=1)
        self._events = open(self.dir / "events.jsonl", "a", buffering=1)
        self.ray = RayMetrics(run) if ray_metrics else None
        self.next_step = 0  # steps below this have their metrics.jsonl line (a resumed run starts later)
        self.stragglers = Stragglers(straggler_ratio)
        self.imbalance = ImbalanceWatch()
        self.trackers = trackers  # raytp.runtime.driver.tracking.Trackers: the same records, sent on
        self.mirror = mirror  # raytp.runtime.driver.mirror.Mirror: the files, copied to shared storage

    def tee(self, out):
        """`out` (the driver's output stream), its whole lines also appended to the run dir's driver.log."""
        self._tee = Tee(out, self.dir / "driver.log")
        return self._tee

    @classmethod
    def for_job(cls, cfg, run_dir: Path, run: str, ray_metrics: bool = True, step: int = 0) -> "RunLog":
        """The run log of a job: its straggler ratio, the trackers and the storage mirror it names (`step`:
        where the run starts)."""
        from raytp.runtime.driver.mirror import Mirror
        from raytp.runtime.driver.tracking import Trackers
        log = cls(run_dir, run, ray_metrics, cfg.runtime.straggler_ratio, Trackers(cfg, run_dir, run, step))
        log.mirror = Mirror(cfg.runtime.storage, run, run_dir) if cfg.runtime.storage else None
        return log

    def metric(self, rec: dict, rank_compute_s: list[float] | None = None) -> None:
        """One metrics.jsonl line per step: steps replayed after a rollback are not written again. A rank that
        stays the slowest is told as a `straggler` event; `rank_compute_s`: every rank's compute time, for the
        per-rank gauges."""
        if rec["step"] < self.next_step:
            return
        self.next_step = rec["step"] + 1
        self._metrics.write(json.dumps(rec) + "\n")
        if self.trackers is not None:
            self.trackers.metric(rec)
        named = self.stragglers.observe(rec["step"], rec.get("straggler"))
        if named is not None:
            self.event("straggler", **named)
        skewed = self.imbalance.observe(rec)
        if skewed is not None:
            self.event("expert_imbalance", **skewed)
        if self.ray and rank_compute_s:
            self.ray.set_ranks("rank_compute_seconds", rank_compute_s)
        if self.ray:
            for key, gauge in (("loss", "loss"), ("tokens_per_s", "tokens_per_second"),
                               ("step_time_s", "step_seconds"), ("comm_s", "comm_seconds"),
                               ("comm_hidden_s", "comm_hidden_seconds"), ("step", "step"),
                               ("val_loss", "val_loss"), ("tflops", "tflops"),
                               ("mfu", "mfu"), ("peak_mem_bytes", "peak_memory_bytes"), ("data_s", "data_seconds"),
                               ("expert_imbalance", "expert_imbalance")):
                if rec.get(key) is not None:
                    self.ray.set(gauge, rec[key])
            if rec.get("tp") and rec.get("dp"):
                self.ray.set("world_size", rec["tp"] * rec.get("pp", 1) * rec["dp"])
            self.ray.inc("steps")

    def event(self, kind: str, **fields) -> dict:
        rec = {"time": time.time(), "kind": kind, **fields}
        self._events.write(json.dumps(rec) + "\n")
        if self.trackers is not None:
            self.trackers.event(rec)
        if self.ray and kind in ("failure", "recovered", "resized"):
            self.ray.inc({"failure": "failures", "recovered": "recoveries", "resized": "resizes"}[kind])
        return rec

    def close(self) -> None:
        self._metrics.close()
        self._events.close()
        if getattr(self, "_tee", None) is not None:
            self._tee.file.close()
        if self.trackers is not None:
            self.trackers.close()
        if self.mirror is not None:
            self.mirror.close()


class Tee:
    """A text stream that also appends what is written to a file, but a progress bar's redraws (lines with a
    carriage return): the driver's output kept in its run directory (driver.log)."""

    def __init__(self, stream, path: Path):
        self.stream, self.file = stream, open(path, "a", buffering=1)

    def write(self, text: str) -> int:
        if "\r" not in text and not self.file.closed:  # what is said after the run log closed goes out only
            self.file.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()
        if not self.file.closed:
            self.file.flush()

    def isatty(self) -> bool:
        return hasattr(self.stream, "isatty") and self.stream.isatty()

    def __getattr__(self, name):  # encoding, fileno, ...: the stream's
        return getattr(self.stream, name)
