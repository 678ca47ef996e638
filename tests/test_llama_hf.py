"""raytp's Llama against transformers' LlamaForCausalLM: a tiny random model built by transformers in
the test (8 query heads, 2 KV heads, untied head), saved as sharded safetensors with an index, loaded
slice by slice at TP=2 and TP=4 (shared KV heads): logits and one step's gradients equal transformers'
within 1e-4; greedy generation is identical; through the runtime, an export round-trips to transformers."""
import dataclasses
import json

import pytest
import torch

from hf_compare import V, assert_equal_within, assert_same_greedy_generation, ours_at_tp, theirs
from raytp.files.interop import hf
from raytp.models.registry import build_model
from raytp.parallel.spawn import run_ranks

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                                      rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # transformers initialises RMSNorm weights at 1: move them so they are tested
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("llama")
    model.save_pretrained(d, max_shard_size="100KB")
    return d, model


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_sharded_load_gives_transformers_logits_and_gradients(llama_dir, tp):
    d, model = llama_dir
    assert (d / "model.safetensors.index.json").exists(), "the test model should be saved sharded"
    assert_equal_within(run_ranks(tp, ours_at_tp, d)[0], theirs(model))


def test_greedy_generation_is_identical(llama_dir):
    d, model = llama_dir
    assert_same_greedy_generation(d, model)


def test_unsupported_llama_configs_are_refused_by_name(tmp_path):
    base = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                    num_attention_heads=8, num_key_value_heads=2).to_dict()
    base.update(attention_bias=True, hidden_act="gelu", rope_scaling={"rope_type": "linear", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(base))
    with pytest.raises(ValueError) as e:
        hf.inspect(tmp_path)
    msg = str(e.value)
    assert "hidden_act 'gelu'" in msg and "attention_bias is true" in msg
    assert "rope_scaling" in msg and "rope_type 'linear' is not supported; valid: llama3" in msg


@pytest.mark.slow
def test_import_train_export_round_trips_to_transformers(ray_local, llama_dir, tmp_path):
    """model.init_from a Llama directory at TP=4 (shared KV heads) with SP, train, checkpoint; export
    --format hf; transformers loads it and gives the runtime's logits."""
    from helpers import FIXED, close, drive, job, raytp_cli

    from raytp.runtime.origin import starting_state
    d, _ = llama_dir
    cfg = job(4, 1, steps=3, checkpoint={"every": 3}, model={"init_from": str(d), "block_size": 32})
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, sequence_parallel=True))
    cfg, init_state = starting_state(cfg, None, tmp_path / "run", say=lambda m: None)
    assert (cfg.model.arch, cfg.model.n_kv_head, cfg.model.block_size) == ("llama", 2, 32)
    drv, start_logits, end_logits = drive(cfg, tmp_path / "run", "llama-hf", init_state=init_state)
    close(drv)
    with torch.no_grad():
        assert float((llama_dir[1](FIXED).logits - start_logits).abs().max()) < 1e-4
    raytp_cli("export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf"))
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert float((back(FIXED).logits - end_logits).abs().max()) < 1e-4


def test_a_bf16_directory_loads_into_float32_masters(llama_dir, tmp_path):
    """Checkpoints on the Hub are mostly bf16: read as stored, upcast into the fp32 shard."""
    _, model = llama_dir
    bf16 = transformers.LlamaForCausalLM(model.config).to(torch.bfloat16)
    bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    bf16.save_pretrained(tmp_path / "bf16")
    from safetensors import safe_open
    with safe_open(str(next((tmp_path / "bf16").glob("*.safetensors"))), "pt") as f:
        assert f.get_slice("model.norm.weight").get_dtype() == "BF16"  # stored as bf16 indeed
    cfg = hf.inspect(tmp_path / "bf16")
    ours = build_model(cfg, seed=0)
    hf.load_into(tmp_path / "bf16", ours, 0, 1)
    for name, p in ours.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p, bf16.state_dict()[hf.to_hf(name, cfg)[0]].float()), name


def test_job_checks_run_on_the_shape_of_the_model_init_from_names(tmp_path):
    """A Llama of 6 query heads (2 KV heads) at parallel.tp=6: the job's default n_head=4 must not refuse it;
    the directory's shape is checked once read, and a TP degree it does not allow is refused by it."""
    from raytp.config import ConfigError, load
    from raytp.runtime.origin import starting_state
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64)
    d = tmp_path / "llama6"
    transformers.LlamaForCausalLM(config).save_pretrained(d)
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {{init_from: {d}, block_size: 32}}\nparallel: {{tp: 6}}\n")
    cfg, state = starting_state(load(job), None, tmp_path / "run", say=lambda m: None)
    assert (cfg.model.n_head, cfg.model.n_kv_head, cfg.parallel.tp) == (6, 2, 6) and state is not None
    bad = load(job, overrides=["parallel.tp=4"])  # passes the job file checks; the model's 6 heads refuse it
    with pytest.raises(ConfigError, match="parallel.tp: 4 does not divide model.n_head=6"):
        starting_state(bad, None, tmp_path / "run", say=lambda m: None)
