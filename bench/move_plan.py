"""move_plan: how long the state mover's planner (raytp.moves.planner.plan_moves) takes at scale.

A plan is made on the driver while training waits (a DP change, a recovery, a TP or stage change), so its
time is part of the pause. An 8B Llama (Llama-3-8B's shape: 32 layers x 4096 wide, 32 heads, 8 KV heads, FFN
14336, vocabulary 128256; 291 tensors, 1,164 keys a rank with AdamW) at TP=8 x PP=4, planned from its
placement table (built once, as the runtime caches it):

- DP 2 -> 4 (128 ranks) and DP 16 -> 32 (1,024 ranks): the new replicas' every byte from the old ones;
- the same DP 16 -> 32 under zero 1 (every rank's AdamW rows re-cut);
- a recovery at DP=32 (1,024 ranks): one rank lost, its bytes from its replicas;
- TP 8 -> 4 at DP=16 (512 -> 256 ranks): every rank's slices re-cut.

The peer: the planner of the tree before (run this file with PYTHONPATH at the other tree, alternately:
docs/findings.md); there is no live resharding planner elsewhere to run beside it (DCP plans a checkpoint's
load per rank, from files).
"""
from __future__ import annotations

import time

from raytp.models.args import ModelArgs
from raytp.moves.planner import World, moved_bytes, plan_moves
from raytp.moves.table import model_table
from raytp.parallel.layout import Layout

LLAMA_8B = ModelArgs(arch="llama", n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336,
                     vocab_size=128256, block_size=8192)
SMALL = ModelArgs(arch="llama", n_layer=4, n_head=8, n_kv_head=4, n_embd=256, intermediate_size=512,
                  vocab_size=1024, block_size=256)


def cases(quick: bool) -> dict:
    tp, pp = (2, 2) if quick else (8, 4)
    big = 4 if quick else 16
    return {
        "dp_2_to_4": (Layout(tp, pp=pp, dp=2), Layout(tp, pp=pp, dp=4), "grow"),
        f"dp_{big}_to_{2 * big}": (Layout(tp, pp=pp, dp=big), Layout(tp, pp=pp, dp=2 * big), "grow"),
        f"dp_{big}_to_{2 * big}_zero1": (Layout(tp, pp=pp, dp=big, zero=1), Layout(tp, pp=pp, dp=2 * big, zero=1),
                                         "grow"),
        f"recovery_dp_{2 * big}": (Layout(tp, pp=pp, dp=2 * big), Layout(tp, pp=pp, dp=2 * big), "lost"),
        f"tp_{tp}_to_{tp // 2}_dp_{big}": (Layout(tp, pp=pp, dp=big), Layout(tp // 2, pp=pp, dp=big), "kept"),
    }


def world_for(old: Layout, new: Layout, how: str) -> World:
    everyone = frozenset(range(old.world_size))
    if how == "grow":  # the old ranks keep their processes; the added replicas' are new
        return World(everyone, {r: r for r in range(old.world_size)})
    if how == "lost":  # rank 1 lost; every other rank serves
        return World(everyone - {1}, {r: r for r in range(new.world_size)})
    return World(everyone, {r: r for r in range(min(old.world_size, new.world_size))})


def run(quick: bool = False) -> dict:
    args = SMALL if quick else LLAMA_8B
    t0 = time.perf_counter()
    table = model_table(args, 1, None)
    fig: dict = {"peer": "this planner at the tree before, alternately (docs/findings.md)",
                 "model": "a small Llama" if quick else "Llama-3-8B's shape", "table_s": time.perf_counter() - t0}
    for name, (old, new, how) in cases(quick).items():
        t0 = time.perf_counter()
        moves = plan_moves(table, old, new, world_for(old, new, how))
        fig[name] = {"ranks": new.world_size, "plan_s": round(time.perf_counter() - t0, 3), "moves": len(moves),
                     "moved_gb": round(moved_bytes(moves) / 1e9, 2)}
    return fig


if __name__ == "__main__":
    import json
    import sys
    print(json.dumps(run(quick="--quick" in sys.argv), indent=1))
