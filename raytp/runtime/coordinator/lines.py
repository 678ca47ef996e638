"""The Driver's output as numbered lines, for the clients of a run's coordinator to read from a cursor."""
from __future__ import annotations

import threading

KEPT_LINES = 20_000   # output lines kept for clients (driver.log has them all)


class Lines:
    """A text stream (the Driver's `out`) kept as numbered lines for clients to read from a cursor."""

    def __init__(self, keep: int = KEPT_LINES):
        self.keep, self.lines, self.first, self.partial = keep, [], 0, ""
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            *done, self.partial = (self.partial + text).split("\n")
            self.lines.extend(done)
            if len(self.lines) > self.keep:
                cut = len(self.lines) - self.keep
                del self.lines[:cut]
                self.first += cut
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    @property
    def end(self) -> int:
        return self.first + len(self.lines)

    def since(self, cursor: int) -> tuple[list[str], int]:
        """The lines from `cursor` on (those still kept), and the cursor after them."""
        with self.lock:
            start = max(cursor, self.first) - self.first
            return self.lines[start:], self.first + len(self.lines)
