"""Which training window each sample of a step reads: pure functions of (seed, sample index), no state.

A source of L tokens holds ``(L - 1) // block`` windows: window j is tokens ``[j*block, j*block + block + 1)``
(inputs and their next-token targets; consecutive windows share one token, as in Megatron-LM's GPTDataset).
The global batch of step s is samples ``s*B .. s*B + B-1``; DP rank r takes its contiguous rows, so the batch
of a step does not depend on the DP degree, a resize or a recovery.

- **Epochs** (`windows`): sample i of a source with n windows is in epoch ``i // n`` and reads window
  ``perm_e(i mod n)``, where ``perm_e`` is a seeded permutation of [0, n) drawn anew each epoch. Every window is
  read exactly once per epoch. The permutation is computed, not stored (a 4-round Feistel network over the next
  power of four, cycle-walked into [0, n)): O(1) memory whatever the corpus size, O(1) time per sample.
- **Blends** (`blend`): sample i of a blend of sources with weights w goes to one source, and is that source's
  sample number c. Two sources split by ``C_A(K) = floor(w_A K + 1/2)``, the samples of A among the first K:
  after any K samples A has its share within half a sample, so each step of B samples holds
  ``floor(w_A B)`` or ``ceil(w_A B)`` of A's. More sources split as a tree of such halves (weights balanced at
  each node), within about one sample per level.
"""
from __future__ import annotations

import numpy as np

from raytp.seeds import derive_seed

ROUNDS = 4
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def window_count(tokens: int, block: int) -> int:
    """Windows of `block` inputs (+1 target) in `tokens` tokens."""
    return max((tokens - 1) // block, 0)


def _mix(x: np.ndarray, key: int) -> np.ndarray:
    """A 64-bit hash of x (uint64) under `key` (splitmix64's finaliser); wraps modulo 2**64 by design."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(key & 0xFFFFFFFFFFFFFFFF)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def permute(i: np.ndarray, n: int, key: int) -> np.ndarray:
    """The images of i (ints in [0, n)) under a pseudo-random permutation of [0, n) chosen by `key`."""
    i = np.asarray(i, dtype=np.uint64)
    if n <= 1:
        return i.astype(np.int64)
    half = max((int(n - 1).bit_length() + 1) // 2, 1)  # a Feistel network over [0, 4**half) >= n
    mask = np.uint64((1 << half) - 1)
    keys = [derive_seed(key, r) for r in range(ROUNDS)]

    def once(x):
        left, right = x >> np.uint64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right, k) & mask)
        return (left << np.uint64(half)) | right

    y = once(i)
    out = y >= np.uint64(n)
    while out.any():  # cycle-walk: a bijection of the larger domain, walked until it lands in [0, n)
        y[out] = once(y[out])
        out = y >= np.uint64(n)
    return y.astype(np.int64)


def windows(samples: np.ndarray, n_windows: int, seed: int, source: int = 0) -> np.ndarray:
    """The window each sample (indices into a source's stream of samples) reads: a fresh seeded permutation of
    the source's `n_windows` windows per epoch."""
    if n_windows <= 0:
        raise ValueError("a source with no whole window")
    samples = np.asarray(samples, dtype=np.int64)
    epoch, at = np.divmod(samples, n_windows)
    out = np.empty_like(samples)
    for e in np.unique(epoch):  # a batch spans at most two epochs
        sel = epoch == e
        out[sel] = permute(at[sel], n_windows, derive_seed(seed, source, int(e)))
    return out


def _halves(weights: list[float], ids: list[int]):
    """A tree of the sources, each node split into two groups of about equal weight: (ids,) at a leaf, else
    (share of the left group, left subtree, right subtree)."""
    if len(ids) == 1:
        return (ids[0],)
    total, run, cut = sum(weights), 0.0, 1
    best = None
    for j in range(1, len(ids)):
        run += weights[j - 1]
        gap = abs(run - total / 2)
        if best is None or gap < best:
            best, cut = gap, j
    left = sum(weights[:cut])
    return (left / total, _halves(weights[:cut], ids[:cut]), _halves(weights[cut:], ids[cut:]))


def blend(samples: np.ndarray, weights: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """(source, index within the source's samples) of each global sample index, for sources of `weights`
    (positive; normalised here)."""
    if not weights or min(weights) <= 0:
        raise ValueError(f"blend weights must be positive, got {weights}")
    samples = np.asarray(samples, dtype=np.int64)
    source = np.zeros_like(samples)
    index = samples.copy()
    _split(_halves(list(weights), list(range(len(weights)))), np.arange(len(samples)), index, source)
    return source, index


def _split(node, rows: np.ndarray, index: np.ndarray, source: np.ndarray) -> None:
    if len(node) == 1:
        source[rows] = node[0]
        return
    share, left, right = node
    k = index[rows]
    taken = np.floor(share * k + 0.5).astype(np.int64)          # left's samples among the first k
    to_left = np.floor(share * (k + 1) + 0.5).astype(np.int64) > taken
    index[rows] = np.where(to_left, taken, k - taken)
    _split(left, rows[to_left], index, source)
    _split(right, rows[~to_left], index, source)


def step_samples(step: int, batch_size: int, dp_rank: int = 0, dp: int = 1) -> np.ndarray:
    """The global sample indices DP rank `dp_rank` of `dp` reads at `step` (its contiguous rows)."""
    per = batch_size // dp
    start = step * batch_size + dp_rank * per
    return np.arange(start, start + per, dtype=np.int64)
