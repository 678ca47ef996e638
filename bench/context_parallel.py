"""context_parallel: a sequence cp times longer in the same memory per rank, and what the ring's attention costs.

1. Memory. A small Llama (2 layers, 256 wide, 8 heads over 2 KV heads) takes one forward and backward pass of
   one sequence: at cp 1 of T tokens on one rank, at CP=4 of 4T tokens over four ranks (each rank its 2 x 4
   chunks' share, ring attention), in-process over gloo. Figure: each rank's peak RSS growth over the pass
   (the process's high-water mark after it less its RSS before it), CP=4's largest against cp 1's.
2. Attention time. Ring attention over 4 ranks on a 4T-token sequence's q, k, v (forward and backward), against
   the peer torch's ``context_parallel`` needs (CUDA's SDPA kernels; not here) replaced by single-rank SDPA over
   the whole 4T tokens, as the issue allows: the same shapes, medians of a few rounds, as a ratio. On a CPU
   machine with fewer cores than ranks the four ranks share the cores, so the ratio is an upper bound of the
   ring's cost.
"""
from __future__ import annotations

import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from raytp.models.args import ModelArgs
from raytp.parallel.spawn import run_ranks

MODEL = dict(arch="llama", n_layer=2, n_head=8, n_kv_head=2, n_embd=256, intermediate_size=512, vocab_size=512)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _memory_rank(rank, world, init, tokens):
    from raytp.models.documents import context_share
    from raytp.models.registry import build_model
    from raytp.parallel.context import context_attention
    from raytp.parallel.groups import ProcessGroups, build_groups
    from raytp.parallel.layout import Layout
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    cfg = ModelArgs(**MODEL, block_size=tokens)
    groups = build_groups(Layout(1, cp=world), rank) if world > 1 else ProcessGroups(Layout(1), 0, None, None)
    model = build_model(cfg, 1)
    context_attention.bind(model, groups, "ring")
    x = torch.randint(cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    x, y, _, _, pos = context_share(x, x, None, world, rank) if world > 1 else (x, x, None, None, None)
    before = _rss_mb()
    model(x, y, positions=pos).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return peak - before


def _attention_rank(rank, world, init, tokens, rounds):
    from raytp.parallel.context import sequence as context
    from raytp.parallel.context.ring_attention import ring_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, tokens, 32, generator=g) for h in (8, 2, 2))
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        q, k, v = (context.shard(t, world, rank, dim=2) for t in (q, k, v))
    times = []
    for _ in range(rounds):
        mine = [t.clone().requires_grad_() for t in (q, k, v)]
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        if world > 1:
            y = ring_attention(*mine, None)
        else:
            ke, ve = (t.repeat_interleave(4, dim=1) for t in mine[1:])
            y = F.scaled_dot_product_attention(mine[0], ke, ve, is_causal=True)
        y.sum().backward()
        if world > 1:
            dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(quick: bool = False) -> dict:
    tokens, cp, rounds = (256, 4, 3) if quick else (2048, 4, 5)
    one = run_ranks(1, _memory_rank, tokens)[0]
    four = max(run_ranks(cp, _memory_rank, tokens * cp))
    ring = max(run_ranks(cp, _attention_rank, tokens * cp, rounds))
    whole = run_ranks(1, _attention_rank, tokens * cp, rounds)[0]
    return {"peer": "cp 1 on one rank (memory); single-rank SDPA over the whole sequence (attention time: torch's "
                    "context_parallel needs CUDA's SDPA kernels)",
            "model": MODEL, "tokens_cp1": tokens, "cp": cp, "tokens_cp": tokens * cp,
            "peak_rss_growth_mb_cp1": round(one, 1), "peak_rss_growth_mb_cp_max_rank": round(four, 1),
            "memory_ratio": round(four / one, 3),
            "attention_s_ring": round(ring, 4), "attention_s_one_rank_whole": round(whole, 4),
            "attention_time_ratio": round(ring / whole, 3),
            "threads_per_rank": 1, "cpus": len(__import__("os").sched_getaffinity(0))}


if __name__ == "__main__":
    import json
    import sys
    print(json.dumps(run(quick="--quick" in sys.argv), indent=1))
