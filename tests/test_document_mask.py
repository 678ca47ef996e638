"""data.document_mask: attention stops at end-of-document tokens. A document packed after another reads as it
would alone (Llama: rotary positions are relative, so its logits equal its own run's); GPT's outputs for one
document do not move when the one before it changes; and at TP=2 with sequence parallelism, a masked run
trains like one device."""
import numpy as np
import pytest
import torch
import torch.distributed as dist
from tp_training import HYPER, SEED, gpt_config, llama_config

from raytp.models.registry import build_model
from raytp.models.shard import build_shard, gather_full_state
from raytp.parallel.groups import ProcessGroups, build_groups
from raytp.parallel.layout import Layout
from raytp.parallel.spawn import run_ranks
from raytp.data.corpus import Corpus, batch
from raytp.train.step import make_optimizer, train_step

EOD = 0


def packed(first: list[int], second: list[int]) -> torch.Tensor:
    return torch.tensor([first + [EOD] + second])


def test_a_packed_llama_document_reads_as_it_would_alone():
    model = build_model(llama_config(), SEED).eval()
    a, b = [5, 9, 3, 77, 12], [40, 41, 42, 8, 99, 100, 3]
    alone = model(torch.tensor([b]))[0]
    model.document_eod = EOD
    masked = model(packed(a, b))[0, len(a) + 1:]
    assert torch.allclose(masked, alone, atol=1e-5), float((masked - alone).abs().max())
    model.document_eod = None
    unmasked = model(packed(a, b))[0, len(a) + 1:]
    assert (unmasked - alone).abs().max() > 1e-3  # without the mask, the first document is seen


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_gpt_document_does_not_see_the_one_before(dropout):
    model = build_model(gpt_config(dropout=dropout), SEED).train(dropout > 0)
    model.document_eod = EOD
    from raytp.models.base import set_dropout_key
    set_dropout_key(model, 3)  # the same masks in both calls (explicit attention, keyed dropout)
    b = [40, 41, 42, 8]
    one = model(packed([5, 9, 3], b))[0, 4:]
    two = model(packed([200, 1, 66], b))[0, 4:]
    assert torch.allclose(one, two, atol=1e-6)
    model.document_eod = None
    assert (model(packed([5, 9, 3], b))[0, 4:] - model(packed([200, 1, 66], b))[0, 4:]).abs().max() > 1e-3


def documents_corpus(vocab=256):
    rng = np.random.default_rng(0)
    ids = []
    for _ in range(600):  # documents of 2..12 tokens, each ended by EOD: several per 16-token window
        ids += rng.integers(1, vocab, rng.integers(2, 13)).tolist() + [EOD]
    ids = np.array(ids)
    return Corpus(ids, ids[:400], vocab, "documents", eod_id=EOD)


def train_masked(rank, world, init, sp, masked, steps=8):
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        groups = build_groups(Layout(world), rank)
        model = build_shard(llama_config(), SEED, groups.tp, sp)
    else:
        groups = ProcessGroups(Layout(1, dp=1), 0, None, None)
        model = build_model(llama_config(), SEED)
    model.document_eod = EOD if masked else None
    opt, data, losses = make_optimizer(model, HYPER), documents_corpus(), []
    for step in range(steps):
        x, y = batch(data, "train", SEED, step, 0, 1, 8, 16)
        losses.append(train_step(model, opt, [(x, y)], groups, step, HYPER).loss)
    return losses, (gather_full_state(model, groups.tp) if world > 1 else model.state_dict())


def test_masked_training_at_tp2_with_sequence_parallelism_equals_one_device():
    ref, ref_state = train_masked(0, 1, None, False, True)
    plain, _ = train_masked(0, 1, None, False, False)
    assert np.abs(np.array(plain) - ref).max() > 1e-4  # the mask changes the training
    losses, state = run_ranks(2, train_masked, True, True)[0]
    rel = np.abs(np.array(losses) - ref) / np.abs(ref)
    assert rel.max() < 1e-5, rel
    for k in ref_state:
        assert float((state[k] - ref_state[k]).abs().max()) < 1e-5, k


def test_a_later_pipeline_chunk_masks_from_the_tokens_and_recomputation_keeps_the_mask():
    """A stage past the first gets the residual stream and the tokens: run in two chunks as two stages run
    it, the masked model gives the whole model's logits; with activation checkpointing (each block recomputed
    in backward, the mask an argument it is called with) the gradients are the same bits."""
    model = build_model(llama_config(), SEED)
    model.document_eod = EOD
    idx = packed([5, 9, 3, 77, 12], [40, 41, 42, 8, 99, 100, 3])
    whole = model(idx)
    hidden = model(idx, layers=[0])
    assert torch.allclose(model(idx, hidden=hidden, layers=[1]), whole, atol=1e-6)
    targets = torch.roll(idx, -1, dims=1)
    grads = []
    for recompute in (False, True):
        model.zero_grad()
        model.activation_checkpointing = recompute
        model(idx, targets).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
