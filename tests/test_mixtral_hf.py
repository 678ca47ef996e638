"""raytp's MoE Llama against transformers' MixtralForCausalLM: a tiny random Mixtral (4 experts, top 2;
8 query heads, 2 KV heads) built by transformers here and saved as sharded safetensors (per-expert names,
as transformers writes them), loaded slice by slice at TP=2, and at TP=2 x EP=2 (each TP rank two
whole experts): logits and one step's gradients (router and
every expert) equal transformers' within 1e-4; greedy generation is identical; through the runtime, a run
from the directory trains at TP=2 x DP=2 with SP and its export loads back into transformers with the run's
logits. A job whose model.moe disagrees with the directory is refused by key."""
import dataclasses
import json

import pytest
import torch

from hf_compare import V, assert_equal_within, assert_same_greedy_generation, ours_at_tp, theirs
from raytp.files.interop import hf
from raytp.parallel.spawn import run_ranks

transformers = pytest.importorskip("transformers")
E, FFN = 4, 32


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    config = transformers.MixtralConfig(vocab_size=V, hidden_size=64, intermediate_size=FFN, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                                        num_local_experts=E, num_experts_per_tok=2, rope_theta=500.0,
                                        rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(7)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1 and a router with preferences, so both are tested
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.mul_(20)
    d = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(d, max_shard_size="100KB")
    return d, model


def test_sharded_load_gives_transformers_logits_and_gradients(mixtral_dir):
    d, model = mixtral_dir
    assert (d / "model.safetensors.index.json").exists(), "the test model should be saved sharded"
    cfg = hf.inspect(d)
    assert (cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.moe_ffn) == (E, 2, FFN)
    want = theirs(model, E, FFN)
    assert_equal_within(run_ranks(2, ours_at_tp, d)[0], want)
    assert_equal_within(run_ranks(2, ours_at_tp, d, 2, 1)[0], want)  # TP=2 x EP=2: two whole experts per rank


def test_greedy_generation_is_identical(mixtral_dir):
    d, model = mixtral_dir
    assert_same_greedy_generation(d, model)


def test_router_noise_and_a_job_disagreeing_with_the_directory_are_refused_by_key(mixtral_dir, tmp_path):
    from helpers import job

    from raytp.runtime.origin import starting_state
    d, model = mixtral_dir
    noisy = model.config.to_dict()
    noisy["router_jitter_noise"] = 0.1
    (tmp_path / "config.json").write_text(json.dumps(noisy))
    with pytest.raises(ValueError, match="router_jitter_noise=0.1; raytp's router adds no noise"):
        hf.inspect(tmp_path)
    cfg = job(2, 1, model={"init_from": str(d), "block_size": 32, "arch": "llama",
                           "moe": {"n_experts": 8, "top_k": 2, "moe_ffn": FFN, "aux_coeff": 0.01}})
    with pytest.raises(ValueError, match=r"model\.moe\.n_experts: 8, but the model in .* has 4"):
        starting_state(cfg, None, tmp_path / "run", say=lambda m: None)
    cfg = job(2, 1, model={"init_from": str(d), "block_size": 32, "arch": "llama",
                           "moe": {"n_experts": E, "top_k": 2, "moe_ffn": FFN, "aux_coeff": 0.01}})
    cfg, _ = starting_state(cfg, None, tmp_path / "run", say=lambda m: None)
    assert cfg.model.moe.aux_coeff == 0.01 and cfg.model.moe.n_experts == E  # the job's knob, the model's shape


@pytest.mark.slow
def test_import_train_export_round_trips_to_transformers(ray_local, mixtral_dir, tmp_path):
    """model.init_from the Mixtral at TP=2 x DP=2 with SP and the balance loss on, train, checkpoint; export
    --format hf; transformers loads it and gives the runtime's logits."""
    from helpers import FIXED, close, drive, job, raytp_cli

    from raytp.runtime.origin import starting_state
    d, model = mixtral_dir
    cfg = job(2, 2, steps=3, checkpoint={"every": 3}, model={
        "init_from": str(d), "block_size": 32, "arch": "llama",
        "moe": {"n_experts": E, "top_k": 2, "moe_ffn": FFN, "aux_coeff": 0.01}})
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, sequence_parallel=True))
    cfg, init_state = starting_state(cfg, None, tmp_path / "run", say=lambda m: None)
    drv, start_logits, end_logits = drive(cfg, tmp_path / "run", "mixtral-hf", init_state=init_state)
    close(drv)
    with torch.no_grad():
        assert float((model(FIXED).logits - start_logits).abs().max()) < 1e-4
    assert float((end_logits - start_logits).abs().max()) > 1e-3, "training changed nothing"
    raytp_cli("export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == E
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert float((back(FIXED).logits - end_logits).abs().max()) < 1e-4
