"""The run directory's records mirrored to shared storage as they are written (``runtime.storage``).

A run's directory lives on the machine of its driver (the head, for a submitted run). With
``runtime.storage`` (a shared path or an object-store URL) its small files, ``config.yaml``,
``metrics.jsonl``, ``events.jsonl`` and ``driver.log`` (the driver's output), are copied to ``<storage>/<run>/`` while the run goes on: a thread
copies whatever changed at most every ``EVERY_S`` seconds, and ``close`` copies the last of it. Each copy
writes a whole file (raytp.files.storage writes whole objects), so a reader never sees half a line.
``raytp status RUN --storage URL`` and ``raytp logs RUN --storage URL`` read a run from there when no cluster
holds it any more (``read_run``, ``read_log``).
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

from raytp.files.storage import Storage

FILES = ("config.yaml", "metrics.jsonl", "events.jsonl", "driver.log")
EVERY_S = 5.0


class Mirror:
    """Copies `run_dir`'s FILES to `<url>/<run>/` in the background; ``close`` copies the last of them."""

    def __init__(self, url: str, run: str, run_dir: Path):
        self.storage, self.run, self.dir = Storage(url.rstrip("/") + "/" + run), run, Path(run_dir)
        self.sizes: dict[str, int] = {}
        self.stop, self.error = threading.Event(), None
        self.thread = threading.Thread(target=self._loop, name=f"raytp-mirror-{run}", daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        for name in FILES:
            f = self.dir / name
            if f.exists() and f.stat().st_size != self.sizes.get(name):
                data = f.read_bytes()
                self.storage.write_bytes(name, data)
                self.sizes[name] = len(data)

    def _loop(self) -> None:
        while not self.stop.wait(EVERY_S):
            try:
                self._copy()
            except Exception as e:  # noqa: BLE001 - storage trouble must not stop training; the next try may work
                self.error = f"{type(e).__name__}: {e}"

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self._copy()


def read_run(url: str, run: str) -> tuple[list[dict], list[dict]]:
    """(metrics.jsonl's records, events.jsonl's) of run `run` mirrored under `url`; FileNotFoundError if none."""
    storage = Storage(url.rstrip("/") + "/" + run)
    if not storage.exists("events.jsonl"):
        raise FileNotFoundError(f"no run {run!r} under {url} (no {storage.path('events.jsonl')})")

    def lines(name):
        return [json.loads(ln) for ln in storage.read_bytes(name).decode().splitlines() if ln.strip()] \
            if storage.exists(name) else []
    return lines("metrics.jsonl"), lines("events.jsonl")


def read_log(url: str, run: str) -> str:
    """The driver's output of run `run` mirrored under `url`; FileNotFoundError if none."""
    storage = Storage(url.rstrip("/") + "/" + run)
    if not storage.exists("driver.log"):
        raise FileNotFoundError(f"no run {run!r} under {url} (no {storage.path('driver.log')})")
    return storage.read_bytes("driver.log").decode()


def describe_stored(url: str, run: str) -> list[str]:
    """The lines `raytp status RUN --storage URL` prints: the run's end (or last event), step, loss."""
    metrics, events = read_run(url, run)
    started = next((e for e in events if e["kind"] == "started"), {})
    ends = [e for e in events if e["kind"] in ("finished", "failed", "stopped")]
    state = ends[-1]["kind"].upper() if ends else "NO END RECORDED (running, or its driver was lost)"
    last = metrics[-1] if metrics else {}
    steps = started.get("steps", "?")
    val = next((m["val_loss"] for m in reversed(metrics) if m.get("val_loss") is not None), None)
    line = (f"{run}: {state}  step {last.get('step', -1) + 1}/{steps}  TP={last.get('tp', '?')} x "
            f"PP={last.get('pp', '?')} x DP={last.get('dp', '?')}  loss "
            + (f"{last['loss']:.4f}" if "loss" in last else "-") + ("  val " + f"{val:.4f}" if val is not None else ""))
    return [line, f"  from {url.rstrip('/')}/{run} ({len(metrics)} steps, {len(events)} events recorded)"]
