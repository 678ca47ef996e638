"""A replica's bundles when they are not simply one placement group of its own. Pure (no Ray calls).

A replica's placement is a plain placement group (bundle i holds TP rank i), or
a ``Slots``: runs of bundles (group, first bundle, count) in rank order. A TP
grow that keeps a replica's processes adds an extension group (Ray cannot grow
a placement group); a resize inside the job's own bundles (no room to reserve
ahead) carves the new replicas out of the old groups. Everything that needs a
rank's bundle takes either form.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slots:
    parts: tuple[tuple[object, int, int], ...]  # (placement group, first bundle, bundles), in rank order

    def __len__(self) -> int:
        return sum(n for _, _, n in self.parts)


def _parts(replica) -> tuple:
    return replica.parts if isinstance(replica, Slots) else ((replica, 0, replica.bundle_count),)


def groups_of(replica) -> list:
    """The placement groups of one replica (once each)."""
    return list(dict.fromkeys(pg for pg, _, _ in _parts(replica)))


def size_of(replica) -> int:
    """How many bundles (ranks) one replica's placement holds."""
    return sum(n for _, _, n in _parts(replica))


def bundle_of(replica, tp_rank: int) -> tuple[object, int]:
    """(group, bundle index) of TP rank `tp_rank` in one replica's placement."""
    i = tp_rank
    for pg, start, n in _parts(replica):
        if i < n:
            return pg, start + i
        i -= n
    raise IndexError(f"TP rank {tp_rank} outside a replica of {size_of(replica)} bundles")


def extended(replica, ext, n: int) -> Slots:
    """The replica's placement with `n` more bundles from the extension group `ext`."""
    return Slots(_parts(replica) + ((ext, 0, n),))


def replaced(replica, start: int, n: int, new):
    """The replica's placement with its bundles `start` .. `start+n`-1 taken from group `new` (its bundles
    0 .. n-1) instead: one stage moved to a group of its own."""
    if start == 0 and n == size_of(replica):
        return new
    flat = [(pg, b) for pg, first, k in _parts(replica) for b in range(first, first + k)]
    flat[start:start + n] = [(new, i) for i in range(n)]
    parts: list = []
    for pg, b in flat:
        if parts and parts[-1][0] == pg and parts[-1][1] + parts[-1][2] == b:
            parts[-1] = (pg, parts[-1][1], parts[-1][2] + 1)
        else:
            parts.append((pg, b, 1))
    return Slots(tuple(parts))


def trimmed(replica, n: int):
    """(the replica's placement cut to its first `n` bundles, the groups no longer used). A group partly
    used stays whole (Ray cannot shrink one): its bundles past `n` stay reserved, idle."""
    kept, used = [], 0
    for pg, start, k in _parts(replica):
        if used < n:
            kept.append((pg, start, min(k, n - used)))
        used += k
    in_use = {pg for pg, _, _ in kept}
    spare = [pg for pg in groups_of(replica) if pg not in in_use]
    if len(kept) == 1 and kept[0][1] == 0 and not isinstance(replica, Slots):
        return replica, spare
    return Slots(tuple(kept)), spare


def carve(replicas: dict, tp: int, dp: int) -> dict | None:
    """Replicas of `tp` bundles carved out of the bundles the old replicas hold (each new replica inside
    one old replica's bundles, so inside one node): {dp_rank: Slots}, or None if `dp` do not fit."""
    out = {}
    for q in sorted(replicas):
        parts = _parts(replicas[q])
        flat = [(pg, start + k) for pg, start, n in parts for k in range(n)]
        for at in range(0, len(flat) - tp + 1, tp):
            if len(out) == dp:
                return out
            run = flat[at:at + tp]
            out[len(out)] = Slots(tuple((pg, b, 1) for pg, b in run))
    return out if len(out) == dp else None


def unused_groups(removed, kept) -> list:
    """Groups of the removed replicas' placements that no kept replica uses (safe to release)."""
    in_use = {pg for r in kept for pg in groups_of(r)}
    return [pg for r in removed for pg in groups_of(r) if pg not in in_use]
