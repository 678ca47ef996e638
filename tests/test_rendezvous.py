"""A rendezvous whose store listens before anyone connects (raytp.parallel.groups.listening_store): the
process that will be rank 0 holds it, so a rank that arrives first is served at once, and rank 0's own
init_process_group takes over the held server on that port instead of binding a second one; the same where each
rank meets through a store client of its own (raytp.parallel.groups.connect_store, as a Ray worker does)."""
import time
from pathlib import Path

import pytest

import torch
import torch.distributed as dist

from raytp.parallel.groups import connect_store, init_process_groups, listening_store
from raytp.parallel.layout import Layout
from raytp.parallel.spawn import run_ranks


def join_on_a_held_store(rank: int, world_size: int, _init_method: str, port_file: str, clients: bool) -> float:
    """Rank 0 holds a listening store and publishes its port; rank 1 joins as soon as it reads it, rank 0
    only once rank 1 is connected to the store (it has added its key); both then all-reduce rank + 1."""
    path = Path(port_file)
    if rank == 0:
        store = listening_store("127.0.0.1", timeout_s=60)
        path.write_text(str(store.port))
        while store.num_keys() == 0:  # rank 1 is in, waiting for rank 0 (run_ranks' timeout bounds this)
            time.sleep(0.01)
    else:
        while not path.exists() or not path.read_text():
            time.sleep(0.01)
    at = f"tcp://127.0.0.1:{path.read_text()}"
    client = connect_store(at, 60, lambda: False, host=rank == 0) if clients else None
    groups = init_process_groups(Layout(world_size), rank, at, timeout_s=60, store=client)
    if rank == 0:
        del store  # the world holds the server now
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=groups.tp)
    return float(t)


@pytest.mark.parametrize("clients", [False, True], ids=["init_method", "connect_store"])
def test_rank_0_joins_on_the_store_it_holds_and_a_rank_there_first_gets_in(tmp_path, clients):
    assert run_ranks(2, join_on_a_held_store, str(tmp_path / "port"), clients, timeout_s=120) == [3.0, 3.0]
