"""raytp.parallel.pipeline.p2p as the pipeline uses it: every stage expects exactly the messages the others send it,
in the order it takes them, and on gloo a receive is posted while the one before it is being taken (so the
sender's isend goes through at once instead of waiting for the receiver to get there)."""
import datetime

import pytest
import torch
import torch.distributed as dist

from raytp.parallel.groups import build_groups
from raytp.parallel.layout import Layout
from raytp.parallel.pipeline.p2p import Expected, StageLink, tag_of
from raytp.parallel.pipeline.pp_schedule import schedule
from raytp.parallel.spawn import run_ranks
from raytp.train.stage_runner import expected_messages


def sent(table, p, n_chunks):
    """(from stage, to stage, tag) of every message the table's actions send: a forward's output to the
    next chunk's stage (not from the last chunk), a backward's input gradient back (not from chunk 0)."""
    out = []
    for s, row in enumerate(table):
        for a in row:
            if a.kind == "F" and a.chunk < n_chunks - 1:
                out.append((s, (a.chunk + 1) % p, tag_of("F", a.mb, a.chunk, n_chunks)))
            elif a.kind == "B" and a.chunk > 0:
                out.append((s, (a.chunk - 1) % p, tag_of("B", a.mb, a.chunk, n_chunks)))
    return out


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("groups_of_p", [1, 3])
def test_each_stage_expects_what_the_others_send_it_in_the_order_it_takes_them(name, v, p, groups_of_p):
    m = groups_of_p * p  # interleaved needs m % p == 0
    table, n_chunks = schedule(name, p, m, v), p * v
    shapes = [(mb + 1, 3, 4) for mb in range(m)]  # a different shape per micro-batch
    expected = {s: expected_messages(table[s], shapes, p, n_chunks) for s in range(p)}
    got = sorted((e.stage, s, e.tag) for s in range(p) for e in expected[s])
    assert got == sorted(sent(table, p, n_chunks))  # each sent message expected once, by its receiver
    for s in range(p):
        for e in expected[s]:
            assert e.shape == shapes[e.tag // 2 // n_chunks]  # the micro-batch's shape
        # the order the stage's row takes them: each action's input, as the row reaches it
        wanted = [tag_of("F", a.mb, a.chunk - 1, n_chunks) if a.kind == "F" else
                  tag_of("B", a.mb, a.chunk + 1, n_chunks)
                  for a in table[s] if (a.kind == "F" and a.chunk > 0) or (a.kind == "B" and a.chunk < n_chunks - 1)]
        assert [e.tag for e in expected[s]] == wanted


A, B, C, D = (Expected(0, t, (2, 3)) for t in (10, 11, 12, 13))


def exchange(rank, world, init):
    """Rank 0 sends with blocking sends (gloo's complete once the receiver has posted the receive);
    rank 1 takes them through a StageLink."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    groups = build_groups(Layout(1, pp=2), rank, timeout_s=20)
    msg = {e.tag: torch.full(e.shape, float(e.tag)) for e in (A, B, C, D)}
    if rank == 0:
        dist.send(msg[10], 1, tag=10)
        dist.send(msg[11], 1, tag=11)  # returns only if rank 1 posted B's receive while it took A
        dist.barrier()
        dist.send(msg[12], 1, tag=12)
        dist.send(msg[13], 1, tag=13)
        return None
    link = StageLink(groups, False, [A, B], torch.float32, torch.device("cpu"))
    a = link.recv(10)
    dist.barrier()  # rank 0 gets here only once B's send has gone through
    b = link.recv(11)
    link.finish()
    out = {"a": a.tolist() == msg[10].tolist(), "b": b.tolist() == msg[11].tolist()}
    link = StageLink(groups, False, [C, D], torch.float32, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="message 13 received where the schedule expected message 12"):
        link.recv(13)
    link.recv(12)
    with pytest.raises(RuntimeError, match="1 expected messages were never taken"):
        link.finish()
    out["d"] = link.recv(13).tolist() == msg[13].tolist()
    link.finish()
    return out


def test_on_gloo_the_next_receive_is_posted_while_one_is_taken():
    """Were B's receive posted only when rank 1 asks for B (after the barrier), rank 0's send of B and
    rank 1's barrier would wait for each other until the 20 s timeout."""
    assert run_ranks(2, exchange, timeout_s=60)[1] == {"a": True, "b": True, "d": True}
