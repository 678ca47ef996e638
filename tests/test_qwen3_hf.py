"""raytp's Llama with per-head q/k norms and its own head width against transformers' Qwen3-MoE and Qwen3: tiny
random models built by transformers here (head_dim 16 where hidden_size / heads is 8; Qwen3-MoE with its
first layer dense), saved, loaded slice by slice at TP=2 (Qwen3-MoE also at TP=2 x EP=2, whole experts per TP rank; and TP=4 past the 2 KV heads, each KV head's k
norm then on two ranks): logits and one step's gradients (q/k norms, router, experts) equal transformers'
within 1e-4; greedy generation is identical; config.json read back from raytp's own writing is the model's."""
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
def qwen3_moe_dir(tmp_path_factory):
    cfg = transformers.Qwen3MoeConfig(vocab_size=V, hidden_size=64, num_hidden_layers=3, num_attention_heads=8,
                                      num_key_value_heads=2, head_dim=16, intermediate_size=48,
                                      moe_intermediate_size=FFN, num_experts=E, num_experts_per_tok=2,
                                      norm_topk_prob=True, mlp_only_layers=[0], max_position_embeddings=64,
                                      rope_theta=500.0, tie_word_embeddings=False)
    torch.manual_seed(9)
    return perturbed_and_saved(transformers.Qwen3MoeForCausalLM(cfg).eval(), tmp_path_factory.mktemp("qwen3moe"))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    cfg = transformers.Qwen3Config(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=2, head_dim=16, intermediate_size=48,
                                   max_position_embeddings=64, rope_theta=500.0, tie_word_embeddings=False)
    torch.manual_seed(9)
    return perturbed_and_saved(transformers.Qwen3ForCausalLM(cfg).eval(), tmp_path_factory.mktemp("qwen3"))


@pytest.mark.parametrize("which, tp", [("moe", 2), ("dense", 2), pytest.param("dense", 4, marks=pytest.mark.slow)])
def test_sharded_load_gives_transformers_logits_and_gradients(qwen3_moe_dir, qwen3_dir, which, tp):
    d, model = qwen3_moe_dir if which == "moe" else qwen3_dir
    cfg = hf.inspect(d)
    assert cfg.qk_norm and cfg.head_dim == 16 and cfg.n_embd // cfg.n_head == 8
    if which == "moe":
        assert (cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.moe_ffn, cfg.moe.first_dense) == (E, 2, FFN, 1)
    want = theirs(model, E, FFN)
    assert_equal_within(run_ranks(tp, ours_at_tp, d)[0], want)
    if which == "moe":  # TP=2 x EP=2: each TP rank two whole experts
        assert_equal_within(run_ranks(tp, ours_at_tp, d, 2, 1)[0], want)


def test_greedy_generation_is_identical_and_the_config_round_trips(qwen3_moe_dir, tmp_path):
    d, model = qwen3_moe_dir
    cfg = assert_same_greedy_generation(d, model)
    written = hf.config_json(cfg, torch.float32, {})
    assert written["model_type"] == "qwen3_moe" and written["mlp_only_layers"] == [0]
    assert hf.config_of(json.loads(json.dumps(written))) == cfg
    back = transformers.Qwen3MoeConfig(**{k: v for k, v in written.items() if k not in ("architectures",)})
    assert (back.num_experts, back.head_dim, back.moe_intermediate_size) == (E, 16, FFN)
