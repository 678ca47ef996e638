"""Getting a rank out of a collective blocked on a peer that will never answer: the abort gloo lacks.

A peer that dies closes its sockets, and a rank blocked on it fails at once ("Connection closed by peer"). A
peer whose host froze, or left the network, or whose process outlived its node's Ray (a node removed while its
processes ran on) closes nothing: the ranks blocked on it wait ``runtime.collective_timeout_s`` (120 s by
default). ``ProcessGroup.abort`` does not unblock a gloo collective (it returns and the collective waits on,
torch 2.13); a shutdown of the socket the collective reads does, at once (docs/findings.md).

So a rank's group sockets are the stream sockets its process opened while its groups were built
(``opened_during``: gloo connects every pair of a group then), and ``shut`` shuts them for reading and writing.
It closes nothing: gloo's threads hold the descriptors, and the groups' destruction closes them. Listening
sockets are left alone (gloo ends the process when its listener fails), and a descriptor is shut only while it
still holds the socket recorded (by inode, checked on a duplicate of it: a closed and reused number is another
socket). NCCL has an abort of its own (``ProcessGroup.abort``).
"""
from __future__ import annotations

import contextlib
import os
import socket

FD_DIR = "/proc/self/fd"


def open_sockets() -> dict[int, int]:
    """{descriptor: socket inode} of this process's open sockets (Linux: /proc/self/fd)."""
    out = {}
    for name in os.listdir(FD_DIR):
        with contextlib.suppress(OSError):  # closed since the listing
            target = os.readlink(f"{FD_DIR}/{name}")
            if target.startswith("socket:["):
                out[int(name)] = int(target[len("socket:["):-1])
    return out


@contextlib.contextmanager
def opened_during(into: dict):
    """Fill `into` with the sockets ({descriptor: inode}) opened while the block ran and open at its end."""
    before = open_sockets() if os.path.isdir(FD_DIR) else None
    yield
    if before is not None:
        into.update({fd: ino for fd, ino in open_sockets().items() if before.get(fd) != ino})


def shut_opened_since(before: dict[int, int]) -> int:
    """Shut the connected stream sockets opened since `before` (open_sockets() then): a join under way
    (its rendezvous store's connections, the pairs its groups have connected so far) fails at once."""
    return shut({fd: ino for fd, ino in open_sockets().items() if before.get(fd) != ino})


def shut(sockets: dict[int, int]) -> int:
    """Shut down each connected stream socket of `sockets` ({descriptor: inode}) still open as recorded: a
    collective blocked on one fails at once. Returns how many were shut."""
    n = 0
    for fd, ino in sockets.items():
        try:
            dup = os.dup(fd)
        except OSError:
            continue  # closed already
        try:
            if os.fstat(dup).st_ino != ino:
                continue  # the number holds another file now
            s = socket.socket(fileno=os.dup(dup))
            with s:  # closes a duplicate only
                if s.type == socket.SOCK_STREAM and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    s.shutdown(socket.SHUT_RDWR)
                    n += 1
        except OSError:
            pass  # not connected (any more)
        finally:
            os.close(dup)
    return n
