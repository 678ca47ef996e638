"""What the tests of untrusted input share (tests/test_untrusted_*.py, tests/test_checkpoint_fuzz.py): the files
a block of code opened, sentinels that must stay as they were, and small run dirs with checkpoints, without Ray."""
import contextlib
import json
import os
import sys
from pathlib import Path

from click.testing import CliRunner

from offline import save_shards, small_state

_opened: list | None = None


def _audit(event, args):
    if _opened is not None and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.path.realpath(os.fsdecode(args[0])))


@contextlib.contextmanager
def files_opened():
    """The real paths of every file opened in this process inside the block (Python's "open" audit event:
    open(), io.open, os.open)."""
    global _opened
    if not getattr(sys, "_raytp_audit", False):
        sys.addaudithook(_audit)
        sys._raytp_audit = True
    seen, _opened = [], []
    try:
        yield seen
    finally:
        seen.extend(_opened)
        _opened = None


def opened_under(seen: list[str], root) -> list[str]:
    """The paths of `seen` inside `root`."""
    root = os.path.realpath(root)
    return [p for p in seen if p == root or p.startswith(root + os.sep)]


class Sentinel:
    """A file that must be neither read nor changed: its text, and its mtime in nanoseconds."""

    def __init__(self, path: Path, text: str = "sentinel: never read, never changed\n"):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(text)
        self.text, self.mtime = text, self.path.stat().st_mtime_ns

    def untouched(self) -> bool:
        return self.path.read_text() == self.text and self.path.stat().st_mtime_ns == self.mtime


def tree(root) -> dict[str, tuple[bytes, int]]:
    """Every file under `root`: its bytes and mtime (a whole tree's state, to compare after a refusal)."""
    root = Path(root)
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def checkpointed_run(root, step: int = 10, tp: int = 2, run_id: str = "test-run", config: dict | None = None):
    """A run dir `root` holding a checkpoint of the small state at TP `tp` (and a config.yaml of `config`);
    (model cfg, full state, the checkpoint's path)."""
    import yaml
    cfg, full, shards = small_state(tp=tp)
    root = Path(root)
    path = save_shards(root / "checkpoints", step, shards, cfg, run_id=run_id)
    if config is not None:
        (root / "config.yaml").write_text(yaml.safe_dump(config))
    return cfg, full, Path(path)


def small_job(path, **sections) -> Path:
    """A job file of the small state's model (tests/helpers.py small_state), one step, builtin data."""
    import yaml
    d = {"model": {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8, "vocab_size": 256},
         "train": {"steps": 1, "batch_size": 2, "warmup_steps": 0}}
    for sec, keys in sections.items():
        d.setdefault(sec, {}).update(keys)
    Path(path).write_text(yaml.safe_dump(d))
    return Path(path)


def cli(*args):
    """`raytp ARGS` in this process: (exit status, output)."""
    from raytp.cli import main
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output


def one_error(output: str) -> bool:
    """The output ends with one `error:` line and holds no traceback."""
    lines = [ln for ln in output.splitlines() if ln.strip()]
    return bool(lines) and lines[-1].startswith("error: ") and sum(ln.startswith("error:") for ln in lines) == 1 \
        and "Traceback" not in output


def edit_manifest(ckpt: Path, change) -> dict:
    """Apply `change(manifest)` to a checkpoint's manifest.json in place; the manifest as it was."""
    f = Path(ckpt) / "manifest.json"
    old = json.loads(f.read_text())
    m = json.loads(f.read_text())
    change(m)
    f.write_text(json.dumps(m))
    return old


def rewrite_header(ckpt: Path, name: str, change) -> None:
    """Apply `change(header)` to the JSON header (``__metadata__`` included) of checkpoint file `name`, its data
    kept, and give the manifest its new size: a tampering that every size check passes."""
    import struct
    f = Path(ckpt) / name
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    change(head)
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    edit_manifest(ckpt, lambda m: m["files"].__setitem__(name, f.stat().st_size))
