"""The memory estimate knows pipeline stages (the largest stage's worker, activations of the micro-batches
1F1B keeps in flight on it, and the pp a refused job would fit at) and the distributed optimizer (AdamW
state / dp, and whether zero 1 would fit). Pure (meta-device models, no Ray)."""
import dataclasses
from pathlib import Path

from raytp.config import from_dict, load
from raytp.runtime.estimate import GiB, _stage_memory, estimate, pp_that_fits, zero_fits

JOB70B = Path(__file__).resolve().parent.parent / "jobs" / "llama3-70b-tp8-pp8.yaml"


def at_pp(cfg, pp):
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=pp))


def small(pp):
    return from_dict({"model": {"n_layer": 8, "n_embd": 256, "n_head": 8, "vocab_size": 1024},
                      "parallel": {"pp": pp}, "train": {"batch_size": 16, "micro_batch_size": 2},
                      "recovery": {"snapshot_every": 0}})


def test_a_stage_holds_its_share_of_the_state_and_the_estimate_is_the_largest_stage():
    whole = estimate(small(1)).weights
    stages = [_stage_memory(small(4), s) for s in range(4)]
    assert sum(w.weights for w in stages) > whole  # the tied embedding's copy on the last stage
    assert max(w.weights for w in stages) < 0.45 * whole
    assert estimate(small(4)) == max(stages, key=lambda w: w.on_device)


def test_1f1b_keeps_pp_minus_s_micro_batches_in_flight_on_stage_s():
    """Stages of equal layers (2 each): activations fall with the stage's in-flight count (4, 3, 2, 1),
    the last stage adding the logits."""
    acts = [_stage_memory(small(4), s).activations for s in range(4)]
    assert acts[0] > acts[1] > acts[2]
    assert _stage_memory(small(1), 0).activations < acts[0] * 2


def test_llama_70b_per_gpu_fits_80_gb_only_with_stages():
    cfg = load(JOB70B)
    assert estimate(cfg).on_device < 24 * GiB
    assert estimate(at_pp(cfg, 1)).on_device > 130 * GiB


def test_the_pp_that_fits_is_the_fewest_stages_that_fit():
    cfg = at_pp(load(JOB70B), 1)
    node = int(8 * 40 * GiB)  # host memory of a node for its TP group's 8 workers
    pp = pp_that_fits(cfg, node)
    assert pp is not None and pp > 1
    assert estimate(at_pp(cfg, pp)).on_host * 8 <= node < estimate(at_pp(cfg, pp - 1)).on_host * 8
    assert pp_that_fits(cfg, 1) is None  # nothing fits a node of one byte


def test_holds_tells_from_a_name_what_keep_stage_keeps():
    """The count above reads names (raytp.models.stage.holds); the stages themselves are built by deleting
    modules (keep_stage): both must agree, for either architecture, tied or not, on every stage."""
    import torch

    from raytp.models.args import ModelArgs
    from raytp.models.registry import build_model, model_class
    from raytp.models.stage import holds, keep_stage, stage_of
    for cfg in (ModelArgs(n_layer=5, n_head=4, n_embd=32, vocab_size=64),
                ModelArgs(arch="llama", n_layer=5, n_head=4, n_kv_head=2, n_embd=32, vocab_size=64),
                ModelArgs(arch="llama", n_layer=5, n_head=4, n_embd=32, vocab_size=64, tie_embeddings=True)):
        with torch.device("meta"):
            names = [n for n, _ in build_model(cfg).named_parameters()]
        for pp, v in ((2, 1), (3, 1), (2, 2)):
            for s in range(pp):
                stage = stage_of(cfg, pp, s, v)
                with torch.device("meta"):
                    kept = {n for n, _ in keep_stage(build_model(cfg), stage).named_parameters()}
                parts = model_class(cfg).stage_parts()
                assert kept == {n for n in names if holds(parts, stage, n)}, (cfg.arch, pp, v, s)


def with_parallel(cfg, **kw):
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **kw))


def test_zero1_keeps_one_dp_share_of_the_adamw_state_and_a_refusal_says_when_it_fits():
    cfg = with_parallel(small(1), dp=4, min_dp=None)
    z0, z1 = estimate(cfg), estimate(with_parallel(cfg, zero=1))
    # zero 0 holds each gradient and its bucket buffer while they are summed; zero 1 drops a gradient once it is
    # in its buffer, which it keeps to the weight gather (bench/moe_memory measures both)
    assert (z1.weights, z1.grads, z0.grads) == (z0.weights, z0.weights, 2 * z0.weights)
    assert abs(z1.optimizer - z0.optimizer / 4) <= 1  # 8 + 8/dp bytes a parameter instead of 16
    assert estimate(with_parallel(cfg, dp=1, zero=1)).optimizer == estimate(with_parallel(cfg, dp=1)).optimizer
    between = (z0.on_host + z1.on_host) // 2  # a node for one worker that only zero 1 fits
    assert zero_fits(cfg, between) and not zero_fits(cfg, z1.on_host - 1)
    assert not zero_fits(with_parallel(cfg, zero=1), 10**15)  # already sharded: nothing to suggest


def test_a_document_mask_counts_its_bias_per_layer():
    cfg = from_dict({"model": {"n_layer": 4, "block_size": 256}, "train": {"batch_size": 8},
                     "runtime": {"device": "cuda"}})
    masked = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, document_mask=True))
    extra = _stage_memory(masked, 0).activations - _stage_memory(cfg, 0).activations
    assert extra == 4 * 8 * 256 * 256 * 4  # layers x b x s x s x fp32
    # on CPU no fused kernel takes the mask: the scores are kept too (5 a s bytes a token in half precision)
    on_cpu = [dataclasses.replace(c, runtime=dataclasses.replace(c.runtime, device="cpu")) for c in (cfg, masked)]
    scores = 4 * 8 * 256 * 5 * cfg.model.n_head * 256 * 2  # layers x tokens x 5 a s x fp32's 2
    assert _stage_memory(on_cpu[1], 0).activations - _stage_memory(on_cpu[0], 0).activations == extra + scores
    ckpt = dataclasses.replace(masked, train=dataclasses.replace(masked.train, activation_checkpointing=True))
    plain_ckpt = dataclasses.replace(cfg, train=ckpt.train)  # (on cuda: the mask, no scores)
    assert _stage_memory(ckpt, 0).activations - _stage_memory(plain_ckpt, 0).activations == 8 * 256 * 256 * 4


def test_mixtral_8x7b_fits_80_gb_gpus_on_two_stages_not_one():
    """46.7B parameters (the meta model's count), TP=8: a stage's share of the experts is the state, and on
    one stage no 80 GB GPU holds it."""
    cfg = load(Path(__file__).resolve().parent.parent / "jobs" / "mixtral-8x7b-tp8-pp2.yaml")
    assert 40 * GiB < estimate(cfg).on_device < 80 * GiB
    assert estimate(at_pp(cfg, 1)).on_device > 80 * GiB
    both = sum(_stage_memory(cfg, s).weights for s in range(2))  # fp32 masters: 4 bytes a parameter, 1/8 each
    replicated = 65 * 4096 + 32 * 8 * 4096  # RMSNorm weights and routers: whole on every rank
    assert both == 4 * ((46_702_792_704 - replicated) // 8 + replicated)


def test_a_share_no_gpu_holds_is_refused_naming_the_fewest_gpus_that_fit():
    """Mixtral-8x7B at TP=8 on one stage needs ~89 GiB a GPU: refused on 80 GB GPUs, naming 16 GPUs (experts
    spread over 2 replicas); TP=2 x DP=8 x EP=8 (16 GPUs) fits as it is; without a real GPU nothing is read."""
    import pytest

    from raytp.runtime.errors import DoesNotFit
    from raytp.runtime.estimate import fewest_fitting, fits_device
    cfg = load(Path(__file__).resolve().parent.parent / "jobs" / "mixtral-8x7b-tp8-pp2.yaml")
    one = at_pp(cfg, 1)
    with pytest.raises(DoesNotFit, match=r"its GPU has 80.0 GiB; the fewest GPUs that fit: 16 at TP=8 x"):
        fits_device(one, {"device_bytes": 80 * GiB})
    fits_device(one, {"device_bytes": None})  # fake GPUs (a simulated cluster): nothing to compare
    fits_device(cfg, {"device_bytes": 80 * GiB})  # two stages fit
    ep8 = dataclasses.replace(one, parallel=dataclasses.replace(one.parallel, tp=2, dp=8, ep=8))
    assert 60 * GiB < estimate(ep8).on_device < 80 * GiB
    fits_device(ep8, {"device_bytes": 80 * GiB})
    assert fewest_fitting(ep8, 80 * GiB) == ep8.layout
    small = fewest_fitting(ep8, 40 * GiB)  # half the memory: more GPUs, each holding less
    assert small.world_size > 16 and estimate(at_layout(ep8, small)).on_device <= 40 * GiB


def test_a_sequence_no_gpu_holds_names_the_cp_that_would():
    """Llama-3-8B at TP=8 over 131,072-token sequences: the activations (divided by cp, the rest not) outgrow an
    80 GB GPU; the fewest GPUs that fit cut each sequence over more ranks. A CP rank keeps a cp-th of the
    activations (in fp32: no weights' copies) and, under zero 1, of the AdamW state."""
    import pytest

    from raytp.runtime.errors import DoesNotFit
    from raytp.runtime.estimate import fewest_fitting, fits_device
    cfg = load(Path(__file__).resolve().parent.parent / "jobs" / "llama3-8b-tp8.yaml")
    long = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, block_size=131_072))
    assert estimate(long).on_device > 80 * GiB
    fit = fewest_fitting(long, 80 * GiB)
    assert fit is not None and fit.cp > 1 and estimate(at_layout(long, fit)).on_device <= 80 * GiB
    with pytest.raises(DoesNotFit, match=f"the fewest GPUs that fit: {fit.world_size} at .*CP={fit.cp}"):
        fits_device(long, {"device_bytes": 80 * GiB})
    exact = dataclasses.replace(long, train=dataclasses.replace(long.train, precision="fp32"))  # no weight copies
    cut = at_layout(exact, exact.layout.changed(cp=4))
    assert _stage_memory(cut, 0).activations * 4 == _stage_memory(exact, 0).activations
    zero1 = at_layout(exact, exact.layout.changed(cp=4, zero=1))  # AdamW's rows cut over the four CP ranks
    assert _stage_memory(zero1, 0).optimizer * 4 == _stage_memory(cut, 0).optimizer


def at_layout(cfg, lay):
    from raytp.runtime.policy import resized_config
    return resized_config(cfg, lay)


def test_fused_attention_keeps_no_scores_and_bf16_keeps_the_weights_copies():
    """SDPA's fused kernels keep q, k, v and the output, not the (s x s) scores: a Llama layer's bytes a token
    do not grow with the context; GPT-2's explicit attention (dropout in training) keeps its scores. Under bf16
    the weights' bfloat16 copies are kept (2 bytes a parameter), one block's with activation checkpointing.
    (The counts were held against an H200: bench/gpu_check, docs/findings.md.)"""
    from raytp.config.adapters import model_args
    from raytp.runtime import activation_bytes

    def llama(s, **train):
        return from_dict({"model": {"arch": "llama", "n_layer": 4, "n_embd": 256, "n_head": 8, "n_kv_head": 2,
                                    "block_size": s}, "train": {"batch_size": 8, **train},
                          "runtime": {"device": "cuda"}})
    short, long = llama(512), llama(2048)
    assert activation_bytes.llama_layer(short, model_args(short), 0, 1) == \
        activation_bytes.llama_layer(long, model_args(long), 0, 1)
    gpt = [from_dict({"model": {"block_size": s, "dropout": 0.1}}) for s in (512, 2048)]
    assert activation_bytes.gpt2_layer(gpt[1], 1) - activation_bytes.gpt2_layer(gpt[0], 1) == \
        5 * gpt[0].model.n_head * (2048 - 512) * 2  # the scores' 5 a s, in float32
    tiny = [estimate(llama(16, micro_batch_size=1, precision=p)) for p in ("fp32", "bf16")]  # ~no activations
    params = tiny[0].weights // 4
    assert tiny[0].activations < params < 2 * params <= tiny[1].activations < 3 * params
    ckpt = estimate(llama(16, micro_batch_size=1, precision="bf16", activation_checkpointing=True))
    assert ckpt.activations < params  # one block's copies at a time


def test_zero1_cuts_the_experts_state_over_expert_dp():
    """Mixtral-8x7B at TP=2 x DP=8 x EP=4 (each expert split over TP, held by an expert-DP group of two): zero 1
    keeps 1/8 of the dense AdamW state and 1/2 of the experts' (8 bytes a parameter at zero 0)."""
    import math
    cfg = load(Path(__file__).resolve().parent.parent / "jobs" / "mixtral-8x7b-tp8-pp2.yaml")
    ep4 = with_parallel(at_pp(cfg, 1), tp=2, dp=8, ep=4, min_dp=None)
    assert ep4.layout.degree("edp") == 2 and with_parallel(ep4, zero=1).layout.sharded_experts
    m = ep4.model
    routed = m.n_layer * m.moe.n_experts * 3 * m.moe.moe_ffn * m.n_embd // (4 * 2)  # 1/ep of them, 1/tp of each
    local = estimate(ep4).optimizer // 8
    z1 = estimate(with_parallel(ep4, zero=1)).optimizer
    assert z1 == math.ceil(8 * (local - routed) / 8) + math.ceil(8 * routed / 2)
    ep8 = with_parallel(ep4, ep=8, zero=1)  # one rank per expert slice: nothing to cut it over
    assert not ep8.layout.sharded_experts and ep8.layout.degree("edp") == 1


def test_context_parallelism_divides_a_ranks_activations_not_its_state():
    """Each CP rank holds 1/cp of every sequence's tokens and the whole of its TP slice of the weights; its
    gradients are summed over the CP group, in bucket buffers as over DP."""
    import dataclasses
    base = from_dict({"model": {"n_layer": 4, "n_embd": 256, "n_head": 8, "block_size": 1024},
                      "train": {"batch_size": 8}, "runtime": {"device": "cuda"}, "recovery": {"snapshot_every": 0}})
    one = estimate(base)
    four = estimate(dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, cp=4)))
    dp4 = estimate(dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, dp=4)))
    assert (four.weights, four.optimizer) == (one.weights, one.optimizer) and four.grads == dp4.grads > one.grads
    assert four.activations < 0.3 * one.activations
