"""Which transformer blocks each pipeline chunk holds: consecutive layers, balanced by cost. Pure.

The model's ``n_layer`` blocks are cut into ``pp * v`` consecutive chunks (chunk c on stage c % pp, see
raytp.parallel.pipeline.pp_schedule). Chunk 0 also holds the embedding and the last chunk the output layer and
its vocabulary-parallel loss, so, as torchtitan's ``generate_llm_fqn_per_model_part`` (input_weight,
output_weight) and Megatron's ``account_for_embedding/loss_in_pipeline_split`` do, those chunks get
fewer blocks. ``split_layers`` finds the exact best split; ``layer_costs`` prices the three parts of a
model; ``check_split`` checks a hand-written ``parallel.pp_layers``.
"""
from __future__ import annotations

from fractions import Fraction


class SplitError(ValueError):
    """A layer split that cannot be made or is wrong; the message says which key and what would be valid."""


def _chunk_costs(split: list[int], embed_cost: float, head_cost: float, layer_cost: float) -> list[float]:
    """Each chunk's cost: its blocks, plus the embedding on chunk 0 and the head on the last."""
    last = len(split) - 1
    return [n * layer_cost + (embed_cost if c == 0 else 0.0) + (head_cost if c == last else 0.0)
            for c, n in enumerate(split)]


def _even(n: int, k: int) -> list[int]:
    """n layers on k chunks as evenly as possible, the extra ones on the later chunks."""
    base, extra = divmod(n, k)
    return [base] * (k - extra) + [base + 1] * extra


def _candidates(n_layer: int, k: int):
    """Every split (k >= 2) whose middle chunks 1..k-2 are even: they cost the same per layer, so for given
    end chunks the even middle has the least largest cost and sum of squares, and the best split is here."""
    if k == 2:
        yield from ([first, n_layer - first] for first in range(1, n_layer))
        return
    for first in range(1, n_layer - k + 2):
        for last in range(1, n_layer - first - k + 3):
            yield [first, *_even(n_layer - first - last, k - 2), last]


def split_layers(n_layer: int, pp: int, *, embed_cost: float, head_cost: float, layer_cost: float = 1.0,
                 v: int = 1) -> list[int]:
    """Layers per chunk (``pp * v`` of them, chunk order), each >= 1, minimising the largest chunk's cost.

    A chunk's cost is ``layers * layer_cost``, plus ``embed_cost`` on chunk 0 and ``head_cost`` on the
    last. Among the splits with the least largest cost it takes the one with the least sum of squared
    costs (the rest as even as it can be), then the one with more layers on later chunks (the earlier
    stages hold more micro-batches of activations in 1F1B: p - s on stage s). Exact (no rounding in the
    comparisons); O(n_layer^2) candidates. With no embedding or head cost and n_layer % (pp*v) == 0 it is
    the even split.
    """
    k = pp * v
    if pp < 1 or v < 1:
        raise SplitError(f"parallel.pp and parallel.pp_virtual must be >= 1, got pp={pp}, pp_virtual={v}")
    if n_layer < k:
        raise SplitError(f"model.n_layer={n_layer} is fewer than the {k} pipeline chunks (parallel.pp={pp} x "
                         f"parallel.pp_virtual={v}): each chunk needs at least one layer")
    if not layer_cost > 0 or embed_cost < 0 or head_cost < 0:
        raise SplitError(f"costs must be layer_cost > 0, embed_cost >= 0, head_cost >= 0; got "
                         f"layer_cost={layer_cost}, embed_cost={embed_cost}, head_cost={head_cost}")
    if k == 1:
        return [n_layer]
    splits = list(_candidates(n_layer, k))
    top = [max(_chunk_costs(s, embed_cost, head_cost, layer_cost)) for s in splits]
    least = min(top)
    return min((s for s, t in zip(splits, top) if t == least),
               key=lambda s: (sum(Fraction(c) ** 2 for c in _chunk_costs(s, embed_cost, head_cost, layer_cost)),
                              s))


def layer_costs(n_embd: int, vocab_size: int, ffn_hidden: int, *, ffn_matmuls: int = 2,
                kv_ratio: float = 1.0) -> tuple[float, float, float]:
    """(embed_cost, head_cost, layer_cost) for ``split_layers``, in parameters, which for a matmul is also
    its multiply-accumulates per token (half its forward FLOPs per token), so one unit prices both a
    part's compute and its training state (16 bytes a parameter).

    - layer: attention q and o (n_embd^2 each), k and v (kv_ratio * n_embd^2 each; kv_ratio = n_kv_head /
      n_head, 1 without grouped-query attention), and an MLP of ``ffn_matmuls`` n_embd x ffn_hidden
      matmuls (2 for GPT-2's, 3 for Llama's SwiGLU). Norms, biases and the attention scores (which grow
      with the sequence) are left out: a few per cent at most for the models raytp trains.
    - head: the n_embd x vocab_size output matmul (and its loss, linear in vocab_size too).
    - embedding: a lookup costs no matmul, but its vocab_size x n_embd table is as many parameters as the
      head's, with the same training state and optimizer update; counting them weighs it like Megatron
      and torchtitan's "about one layer" for big models (1.2 layers for Llama-3-70B) and more for small
      vocabulary-heavy ones (5.5 for GPT-2 small), whose first stage also holds the most activations.
      Tied or not the same: with pp > 1 the first and last stages each hold a copy of a tied table.
    """
    if min(n_embd, vocab_size, ffn_hidden, ffn_matmuls) < 1 or not 0 < kv_ratio <= 1:
        raise SplitError(f"layer_costs needs positive sizes and 0 < kv_ratio <= 1, got n_embd={n_embd}, "
                         f"vocab_size={vocab_size}, ffn_hidden={ffn_hidden}, ffn_matmuls={ffn_matmuls}, "
                         f"kv_ratio={kv_ratio}")
    layer = (2 + 2 * kv_ratio) * n_embd ** 2 + ffn_matmuls * n_embd * ffn_hidden
    table = float(n_embd * vocab_size)
    return table, table, float(layer)


def stage_layers(split: list[int], chunk: int) -> range:
    """The global indices of the layers chunk `chunk` holds under `split` (consecutive)."""
    if not 0 <= chunk < len(split):
        raise SplitError(f"chunk {chunk} is not one of the {len(split)} chunks of the split {split}")
    start = sum(split[:chunk])
    return range(start, start + split[chunk])


def check_split(split: list[int], n_layer: int, pp: int, v: int = 1) -> None:
    """Raise SplitError unless `split` (a hand-written ``parallel.pp_layers``) gives each of the pp*v
    chunks at least one layer and all model.n_layer layers in all."""
    if len(split) != pp * v:
        raise SplitError(f"parallel.pp_layers {split} has {len(split)} entries, but the model has {pp * v} "
                         f"pipeline chunks (parallel.pp={pp} x parallel.pp_virtual={v}): give one count each")
    bad = [(c, n) for c, n in enumerate(split) if not isinstance(n, int) or isinstance(n, bool) or n < 1]
    if bad:
        c, n = bad[0]
        raise SplitError(f"parallel.pp_layers {split}: chunk {c} has {n!r} layers; each chunk needs a whole "
                         f"number >= 1")
    if sum(split) != n_layer:
        raise SplitError(f"parallel.pp_layers {split} sums to {sum(split)}, but model.n_layer={n_layer}")
