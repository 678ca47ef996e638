"""raytp's Llama with q/k/v biases against transformers' Qwen2-MoE and Qwen2: tiny random models built by
transformers here (Qwen2-MoE with its first layer dense, one gated shared expert per expert layer, top 2 of 4
not renormalised), saved, loaded slice by slice at TP=2 (and TP=4 past the 2 KV heads: each KV head's bias
then copied on two ranks, its gradient summed over them), and Qwen2-MoE at TP=2 x EP=2: logits and one
step's gradients (biases, router, shared expert and its gate, experts) equal transformers' within 1e-4;
greedy generation is identical; config.json read back from raytp's own writing is the model's."""
import json

import pytest
import torch

from hf_compare import (V, assert_equal_within, assert_same_greedy_generation, ours_at_tp,
                        perturbed_and_saved, theirs)
from raytp.files.interop import hf
from raytp.parallel.spawn import run_ranks

transformers = pytest.importorskip("transformers")
E, FFN = 4, 16


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory):
    cfg = transformers.Qwen2MoeConfig(vocab_size=V, hidden_size=64, num_hidden_layers=3, num_attention_heads=8,
                                      num_key_value_heads=2, intermediate_size=48, moe_intermediate_size=FFN,
                                      shared_expert_intermediate_size=24, num_experts=E, num_experts_per_tok=2,
                                      norm_topk_prob=False, mlp_only_layers=[0], max_position_embeddings=64,
                                      rope_theta=500.0, tie_word_embeddings=False)
    torch.manual_seed(9)
    return perturbed_and_saved(transformers.Qwen2MoeForCausalLM(cfg).eval(), tmp_path_factory.mktemp("qwen2moe"))


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                                   rope_theta=500.0, tie_word_embeddings=False)
    torch.manual_seed(9)
    return perturbed_and_saved(transformers.Qwen2ForCausalLM(cfg).eval(), tmp_path_factory.mktemp("qwen2"))


@pytest.mark.parametrize("which, tp", [("moe", 2), ("dense", 2), pytest.param("dense", 4, marks=pytest.mark.slow)])
def test_sharded_load_gives_transformers_logits_and_gradients(qwen2_moe_dir, qwen2_dir, which, tp):
    d, model = qwen2_moe_dir if which == "moe" else qwen2_dir
    cfg = hf.inspect(d)
    assert cfg.qkv_bias and not cfg.qk_norm
    want = theirs(model, E, FFN)
    assert any(k.endswith("k_proj.bias") for k in want[1])
    if which == "moe":
        m = cfg.moe
        assert (m.n_experts, m.top_k, m.moe_ffn, m.first_dense, m.norm_topk) == (E, 2, FFN, 1, False)
        assert (m.n_shared, m.shared_ffn, m.shared_gate) == (1, 24, True)
    assert_equal_within(run_ranks(tp, ours_at_tp, d)[0], want)
    if which == "moe":  # TP=2 x EP=2: each TP rank two whole experts
        assert_equal_within(run_ranks(tp, ours_at_tp, d, 2, 1)[0], want)


def test_greedy_generation_is_identical_and_the_config_round_trips(qwen2_moe_dir):
    d, model = qwen2_moe_dir
    cfg = assert_same_greedy_generation(d, model)
    written = hf.config_json(cfg, torch.float32, {})
    assert written["model_type"] == "qwen2_moe" and written["mlp_only_layers"] == [0] and written["qkv_bias"]
    assert hf.config_of(json.loads(json.dumps(written))) == cfg
    back = transformers.Qwen2MoeConfig(**{k: v for k, v in written.items() if k not in ("architectures",)})
    assert (back.num_experts, back.shared_expert_intermediate_size, back.moe_intermediate_size) == (E, 24, FFN)
