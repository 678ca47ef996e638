"""ProcessGroups.abort: a collective blocked on a peer that lives on with its sockets open (a frozen host, a
process outliving its node's Ray) fails at once, not after runtime.collective_timeout_s; sockets this process
had before its groups were built are left alone; the process lives on (gloo's listener untouched)."""
import os
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from raytp.parallel.groups import destroy_process_groups, init_process_groups
from raytp.parallel.layout import Layout
from raytp.parallel.spawn import run_ranks

TIMEOUT_S = 120.0  # the groups' collective timeout: far past what the test waits for


def _blocked_then_aborted(rank, world_size, init_method, marks):
    """Ranks 0 and 1 enter an all-reduce that rank 2 never joins, and abort it from another thread; rank 2 stays
    alive, sockets open, until both have left it (their marks), so only the abort can have got them out."""
    own = socket.socketpair()  # a connection this process had before its groups: never shut
    groups = init_process_groups(Layout(tp=1, dp=world_size), rank, init_method, "cpu", TIMEOUT_S)
    x = torch.ones(64)
    dist.all_reduce(x, group=groups.dp)  # the groups work
    if rank == 2:
        deadline = time.monotonic() + TIMEOUT_S
        while not all(os.path.exists(f"{marks}.{r}") for r in (0, 1)):
            assert time.monotonic() < deadline, "the others never left the collective"
            time.sleep(0.05)
        return {"rank": 2}
    shut = []
    threading.Thread(target=lambda: (time.sleep(0.3), shut.append(groups.abort())), daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        dist.all_reduce(x, group=groups.dp)
    waited = time.monotonic() - t0
    open(f"{marks}.{rank}", "w").close()
    own[0].sendall(b"still")
    kept = own[1].recv(5)
    destroy_process_groups()
    return {"rank": rank, "waited": waited, "shut": shut, "kept": kept}


def test_an_abort_gets_ranks_out_of_a_collective_a_live_peer_never_joins(tmp_path):
    out = run_ranks(3, _blocked_then_aborted, str(tmp_path / "left"))
    for r in out[:2]:
        assert r["waited"] < TIMEOUT_S / 2, r  # left long before the collective's timeout (rank 2 still alive)
        assert r["shut"] and r["shut"][0] >= 2, r  # its pairs to the two peers, at least
        assert r["kept"] == b"still"
