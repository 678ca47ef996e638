"""python -m bench [NAME ...] [--quick] [--out FILE] [--list]

Runs the named benchmarks (all registered ones by default), prints one table
and merges their figures into FILE (default bench/results.json): an object
keyed by benchmark name; other benchmarks' entries are kept. The file is
rewritten after each benchmark, atomically (a temporary file, then rename).
"""
from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import sys
import time
from pathlib import Path

from bench import BENCHMARKS

DEFAULT_OUT = Path(__file__).resolve().parent / "results.json"


def flatten(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    rows = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and not all(isinstance(x, (int, float)) for x in v.values()):
            rows += flatten(v, key + ".")
        else:
            rows.append((key, v))
    return rows


def fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={fmt(x)}" for k, x in v.items()) or "-"
    if isinstance(v, list):
        return "[" + ", ".join(fmt(x) for x in v) + "]"
    return str(v)


def table(results: dict[str, dict]) -> str:
    rows = [(name, key, fmt(v)) for name, figs in results.items() for key, v in flatten(figs)]
    w0 = max([len("benchmark")] + [len(r[0]) for r in rows])
    w1 = max([len("figure")] + [len(r[1]) for r in rows])
    lines = [f"{'benchmark':<{w0}}  {'figure':<{w1}}  value", f"{'-' * w0}  {'-' * w1}  {'-' * 5}"]
    last = None
    for name, key, value in rows:
        lines.append(f"{name if name != last else '':<{w0}}  {key:<{w1}}  {value}")
        last = name
    return "\n".join(lines)


def write_merged(path: Path, new: dict[str, dict]) -> None:
    """Merge `new` into the JSON object at `path`, keeping other benchmarks' entries; atomically
    (tmp + rename), under a lock on the folder so that concurrent runs do not drop each other's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            current = json.loads(path.read_text())
            if not isinstance(current, dict):
                current = {}
        except (FileNotFoundError, json.JSONDecodeError):
            current = {}
        current.update(new)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(current, indent=2) + "\n")
        os.replace(tmp, path)
    finally:
        os.close(lock)  # releases the lock


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[1])
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run (default: all of {', '.join(BENCHMARKS)})")
    ap.add_argument("--quick", action="store_true", help="a tiny size (seconds, for smoke tests)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results file (default {DEFAULT_OUT})")
    ap.add_argument("--list", action="store_true", help="list the registered benchmarks and exit")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(BENCHMARKS))
        return 0
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(unknown)}; registered: {', '.join(BENCHMARKS)}")

    results, failed = {}, []
    for name in args.names or list(BENCHMARKS):
        print(f"running {name}{' (quick)' if args.quick else ''} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            figs = BENCHMARKS[name](quick=args.quick)
        except Exception as e:  # noqa: BLE001 - one failing benchmark must not lose the others' figures
            print(f"{name} FAILED: {type(e).__name__}: {e}", file=sys.stderr)
            failed.append(name)
            continue
        if "peer" not in figs:
            print(f"{name} FAILED: its figures lack the required key 'peer'", file=sys.stderr)
            failed.append(name)
            continue
        figs["wall_s"] = round(time.perf_counter() - t0, 1)
        figs["quick"] = args.quick
        figs["measured_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        results[name] = figs
        write_merged(args.out, {name: figs})  # after each: an interrupted run keeps what it measured
        print(f"{name} done in {figs['wall_s']} s; wrote {args.out}", file=sys.stderr, flush=True)
    if results:
        print(table(results))
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
