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


def _join_aborted_then_joined_again(rank, world_size, init_method, marks):
    """Round 1: ranks 0 and 1 meet at a store rank 0 listens on, as workers do (each through a client of its own),
    for a world of 3 that rank 2 never joins, and abort that join from another thread, again until it ended (as
    the driver's abort of a join does); round 2: all three meet at a store rank 0 listens on
    and train an all-reduce: a process whose join was aborted joins again."""
    import torch.distributed as dist
    from raytp.parallel import group_sockets
    from raytp.parallel.groups import connect_store, listening_store
    store1, store2 = f"{marks}.store1", f"{marks}.store2"
    if rank != 2:
        if rank == 0:  # the store of round 1, listening before anyone meets (Worker.rendezvous_address)
            s1 = listening_store("127.0.0.1", TIMEOUT_S)
            with open(store1 + ".tmp", "w") as f:
                f.write(f"tcp://127.0.0.1:{s1.port}")
            os.rename(store1 + ".tmp", store1)
        while not os.path.exists(store1):
            time.sleep(0.05)
        before, joining, aborted, done = group_sockets.open_sockets(), threading.Lock(), [], threading.Event()

        def abort():  # as WorkerGroup._abort_join -> Worker.abort_collectives: again until the join has ended
            time.sleep(0.5)
            while not done.is_set():
                with joining:
                    if before is not None:
                        aborted.append(True)
                        group_sockets.shut_opened_since(before)
                time.sleep(0.2)
        threading.Thread(target=abort, daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(Exception):
            at = open(store1).read()
            client = connect_store(at, TIMEOUT_S, lambda: bool(aborted), host=rank == 0)
            init_process_groups(Layout(tp=1, dp=world_size), rank, at, "cpu", TIMEOUT_S, store=client)
        with joining:
            before = None  # over: a later abort shuts nothing
        done.set()
        waited = time.monotonic() - t0
        open(f"{marks}.{rank}", "w").close()
        if rank == 0:
            s = listening_store("127.0.0.1", TIMEOUT_S)
            with open(store2 + ".tmp", "w") as f:
                f.write(f"tcp://127.0.0.1:{s.port}")
            os.rename(store2 + ".tmp", store2)
    else:
        waited = 0.0
    deadline = time.monotonic() + TIMEOUT_S
    while not (os.path.exists(store2) and all(os.path.exists(f"{marks}.{r}") for r in (0, 1))):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    groups = init_process_groups(Layout(tp=1, dp=world_size), rank, open(store2).read(), "cpu", TIMEOUT_S)
    x = torch.ones(4) * (rank + 1)
    dist.all_reduce(x, group=groups.dp)
    destroy_process_groups()
    return {"waited": waited, "sum": float(x[0])}


def test_an_aborted_join_leaves_the_process_able_to_join_again(tmp_path):
    out = run_ranks(3, _join_aborted_then_joined_again, str(tmp_path / "left"))
    assert [r["sum"] for r in out] == [6.0, 6.0, 6.0]
    assert all(r["waited"] < TIMEOUT_S / 2 for r in out[:2]), out


def test_a_join_whose_rendezvous_host_died_ends_when_aborted_and_one_whose_host_lives_connects():
    """connect_store: a rendezvous host gone (its port refuses: a replacement lost as the ranks meet) is tried
    until the join is aborted, then fails at once, not after its timeout (torch's own client retries the whole
    timeout, with no socket to shut); a live host's store connects and then waits the full timeout."""
    from raytp.parallel.groups import connect_store, free_port, listening_store
    gone = f"tcp://127.0.0.1:{free_port()}"
    aborted = []
    threading.Timer(0.5, lambda: aborted.append(True)).start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="aborted"):
        connect_store(gone, TIMEOUT_S, lambda: bool(aborted), try_s=0.5)
    assert 0.5 <= time.monotonic() - t0 < TIMEOUT_S / 4
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):  # never aborted: its own timeout ends it
        connect_store(gone, 1.0, lambda: False, try_s=0.5)
    assert time.monotonic() - t0 >= 1.0
    host = listening_store("127.0.0.1", TIMEOUT_S)
    client = connect_store(f"tcp://127.0.0.1:{host.port}", TIMEOUT_S, lambda: False)
    client.set("k", b"v")
    assert host.get("k") == b"v" and client.timeout.total_seconds() == TIMEOUT_S
