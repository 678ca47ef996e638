"""The layer split is the best one: checked against every split of small models, with the embedding and the
head priced from real models' parameter counts; hand-written splits are checked with readable errors."""
import itertools
from fractions import Fraction

import pytest

from raytp.parallel.pipeline.pp_split import SplitError, check_split, layer_costs, split_layers, stage_layers


def compositions(n, k):
    """Every way to write n as k positive parts, in order."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        yield [b - a for a, b in zip((0, *cuts), (*cuts, n))]


def costs(split, embed, head, layer):
    last = len(split) - 1
    return [n * layer + (embed if c == 0 else 0.0) + (head if c == last else 0.0) for c, n in enumerate(split)]


COSTS = [(0.0, 0.0, 1.0), (1.0, 1.0, 1.0), (0.5, 2.5, 1.0), (3.0, 0.25, 1.0), (0.1, 0.2, 0.3), (5.0, 5.0, 2.0)]


def test_uneven_counts_go_to_the_later_chunks():
    assert split_layers(5, 2, embed_cost=0, head_cost=0) == [2, 3]
    assert split_layers(5, 3, embed_cost=0, head_cost=0) == [1, 2, 2]
    assert split_layers(10, 4, embed_cost=0, head_cost=0) == [2, 2, 3, 3]


def test_even_split_without_embedding_or_head_cost():
    for pp, v in [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (4, 2), (3, 3)]:
        for per in (1, 2, 5):
            assert split_layers(per * pp * v, pp, v=v, embed_cost=0, head_cost=0) == [per] * (pp * v)


def test_the_head_cost_moves_a_layer_off_the_last_stage():
    assert split_layers(6, 2, embed_cost=0, head_cost=0.5) == [3, 3]   # 3 | 3.5 beats 4 | 2.5
    assert split_layers(6, 2, embed_cost=0, head_cost=1.5) == [4, 2]   # 4 | 3.5 beats 3 | 4.5
    assert split_layers(8, 4, embed_cost=0, head_cost=1.5) == [2, 2, 3, 1]   # largest 3, not 2 + 1.5
    assert split_layers(8, 4, embed_cost=1.5, head_cost=1.5) == [1, 3, 3, 1]


def test_max_chunk_cost_is_the_brute_force_optimum_and_ties_break_as_documented():
    for (embed, head, layer), pp, v in itertools.product(COSTS, range(1, 5), (1, 2)):
        for n in range(pp * v, 11):
            got = split_layers(n, pp, v=v, embed_cost=embed, head_cost=head, layer_cost=layer)
            assert len(got) == pp * v and sum(got) == n and min(got) >= 1
            every = list(compositions(n, pp * v))
            best = min(max(costs(s, embed, head, layer)) for s in every)
            assert max(costs(got, embed, head, layer)) == best, (n, pp, v, embed, head, layer, got)
            # The documented order in full: least largest cost, least sum of squares, later chunks heavier.
            want = min(every, key=lambda s: (max(costs(s, embed, head, layer)),
                                             sum(Fraction(c) ** 2 for c in costs(s, embed, head, layer)), s))
            assert got == want, (n, pp, v, embed, head, layer)


def test_layer_costs_count_the_parameters_of_real_models():
    # GPT-2 small: 124,439,808 parameters (Hugging Face), of which 786,432 position embeddings and 1,536
    # final norm; the blocks' biases and norms (13 * n_embd each) are left out of layer_cost.
    embed, head, layer = layer_costs(768, 50257, 3072)
    assert embed == head == 768 * 50257
    assert embed + 12 * layer == pytest.approx(124_439_808 - 786_432 - 1_536, rel=2e-3)
    # Llama-3-8B (untied, GQA 8 of 32 heads, SwiGLU): 8,030,261,248 parameters.
    embed, head, layer = layer_costs(4096, 128256, 14336, ffn_matmuls=3, kv_ratio=8 / 32)
    assert embed + head + 32 * layer == pytest.approx(8_030_261_248, rel=1e-4)


def test_gpt2_small_default_splits():
    embed, head, layer = layer_costs(768, 50257, 3072)
    split = lambda pp: split_layers(12, pp, embed_cost=embed, head_cost=head, layer_cost=layer)  # noqa: E731
    assert split(2) == [6, 6]
    assert split(4) == [1, 5, 5, 1]   # the vocabulary table weighs 5.45 blocks


def test_stage_layers_are_consecutive_and_cover_the_model():
    split = [2, 3, 1, 4]
    assert [stage_layers(split, c) for c in range(4)] == [range(0, 2), range(2, 5), range(5, 6), range(6, 10)]
    with pytest.raises(SplitError, match=r"chunk 4 is not one of the 4 chunks"):
        stage_layers(split, 4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(n_layer=3, pp=2, v=2), r"model.n_layer=3 is fewer than the 4 pipeline chunks \(parallel.pp=2 x "
                                 r"parallel.pp_virtual=2\)"),
    (dict(n_layer=4, pp=0), r"parallel.pp and parallel.pp_virtual must be >= 1, got pp=0"),
    (dict(n_layer=4, pp=2, layer_cost=0.0), r"layer_cost > 0.*got layer_cost=0.0"),
    (dict(n_layer=4, pp=2, head_cost=-1.0), r"head_cost >= 0.*head_cost=-1.0"),
])
def test_split_layers_errors(kwargs, message):
    kwargs = {"embed_cost": 0.0, "head_cost": 0.0, **kwargs}
    with pytest.raises(SplitError, match=message):
        split_layers(**kwargs)


@pytest.mark.parametrize("split, n_layer, pp, v, message", [
    ([2, 2], 5, 2, 1, r"^parallel.pp_layers \[2, 2\] sums to 4, but model.n_layer=5$"),
    ([2, 3], 5, 3, 1, r"^parallel.pp_layers \[2, 3\] has 2 entries, but the model has 3 pipeline chunks"),
    ([5, 0], 5, 2, 1, r"^parallel.pp_layers \[5, 0\]: chunk 1 has 0 layers"),
    ([2, 1.5, 1.5], 5, 3, 1, r"chunk 1 has 1.5 layers; each chunk needs a whole number >= 1$"),
    ([1, 1, 2], 4, 2, 2, r"has 3 entries, but the model has 4 pipeline chunks \(parallel.pp=2 x parallel.pp_virtual=2"),
])
def test_check_split_errors(split, n_layer, pp, v, message):
    with pytest.raises(SplitError, match=message):
        check_split(split, n_layer, pp, v)


def test_check_split_accepts_a_good_split():
    check_split([1, 3, 1], 5, 3)
    check_split([2, 1, 1, 1], 5, 2, 2)
