"""Llama 3.1+'s rotary rescaling (rope_scaling, rope_type llama3) against transformers: the frequencies bit
for bit, a tiny Llama's logits at TP=2 past its original context, model.init_from and the job key, and an
export that transformers reads back with the same config; any other rope_type refused by name."""
import dataclasses
import json

import pytest
import torch
import yaml

from raytp.config import ConfigError, from_dict, load
from raytp.config.adapters import model_args
from raytp.files.interop import hf
from raytp.models.args import RopeScaling
from raytp.models.llama.model import inv_freq
from raytp.models.registry import build_model
from raytp.parallel import comm
from raytp.parallel.spawn import run_ranks
from raytp.runtime.origin import starting_state
from offline import hf_shard_at_tp

transformers = pytest.importorskip("transformers")
V, T, ORIGINAL = 256, 64, 32  # positions ORIGINAL..T-1 lie past the context the model was trained at
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": ORIGINAL}


def hf_config(**kw):
    return transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=T,
                                    rope_theta=500.0, rope_scaling=dict(LLAMA3), rms_norm_eps=1e-5, **kw)


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(hf_config()).eval()
    d = tmp_path_factory.mktemp("llama3")
    model.save_pretrained(d)
    return d, model


def tokens():
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))


def bands(scaled, plain, factor):
    """How many frequencies were kept, divided by factor, and interpolated between."""
    kept = int(torch.isclose(scaled, plain).sum())
    divided = int(torch.isclose(scaled, plain / factor).sum())
    return kept, divided, len(plain) - kept - divided


@pytest.mark.parametrize("head_dim, theta, scaling", [
    (8, 500.0, LLAMA3),  # the tiny model's: one frequency in each band
    (128, 500000.0, {**LLAMA3, "original_max_position_embeddings": 8192}),  # Llama 3.1 8B's
], ids=["tiny", "llama3.1-8b"])
def test_inv_freq_is_transformers_bit_for_bit(head_dim, theta, scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, rope_theta=theta,
                                      rope_scaling=dict(scaling), max_position_embeddings=4 * 8192)
    want, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = inv_freq(head_dim, theta, RopeScaling(**scaling))
    assert attention_factor == 1.0 and ours.dtype == want.dtype == torch.float32
    assert torch.equal(ours, want)
    kept, divided, between = bands(ours, inv_freq(head_dim, theta), scaling["factor"])
    assert kept and divided and between, "every branch of the rescaling should be exercised"


def ours_at_tp2(rank, world, init, model_dir):
    model, groups = hf_shard_at_tp(rank, world, init, model_dir)
    with torch.no_grad():
        return comm.gather_last(model(tokens()), groups.tp)[..., :V]


def test_tp2_logits_match_transformers_past_the_original_context(llama3_dir):
    d, model = llama3_dir
    with torch.no_grad():
        want = model(tokens()).logits
    logits = run_ranks(2, ours_at_tp2, d)[0]
    assert float((logits - want).abs().max()) < 1e-4
    unscaled = build_model(dataclasses.replace(hf.inspect(d), rope_scaling=None), seed=0).eval()
    hf.load_into(d, unscaled, 0, 1)
    with torch.no_grad():  # the comparison sees the rescaling: without it the far positions differ 10x more
        assert float((unscaled(tokens())[:, ORIGINAL:] - want[:, ORIGINAL:]).abs().max()) > 1e-3


def test_init_from_sets_rope_scaling_over_the_job_key(llama3_dir, tmp_path):
    d, _ = llama3_dir
    job = tmp_path / "job.yaml"
    conflicting = {**LLAMA3, "factor": 2.0}
    job.write_text(yaml.safe_dump({"model": {"init_from": str(d), "block_size": T, "rope_scaling": conflicting},
                                   "parallel": {"tp": 2}}))
    cfg, state = starting_state(load(job), None, tmp_path / "run", say=lambda m: None)
    assert cfg.model.rope_scaling == RopeScaling(**LLAMA3) and state is not None  # the directory's, as rope_theta
    assert model_args(cfg).rope_scaling == RopeScaling(**LLAMA3)


def test_hf_export_round_trips_rope_scaling(llama3_dir, tmp_path):
    """A checkpoint of the model (as the runtime writes it) exported with `raytp export --format hf`:
    transformers reads the same rope config and gives the same logits; raytp reads the same shape."""
    from helpers import raytp_cli
    from offline import Events, ShardsGroup
    from raytp.files import checkpoint
    from raytp.files.storage import Storage
    from raytp.runtime.state.checkpoints import Checkpoints

    class OneLlamaShard(ShardsGroup):  # a Llama's key/value projections split by its n_kv_head: name it
        def begin_save(self, url, directory):
            tensors = checkpoint.state_tensors(self.shards[0], model_args(self.cfg))
            return checkpoint.tensor_table(tensors, 1, V), [checkpoint.write_shard(Storage(url), directory, tensors, 0)]

    d, model = llama3_dir
    cfg = hf.inspect(d)
    ours = build_model(cfg, seed=0)
    hf.load_into(d, ours, 0, 1)
    group, ckpts = OneLlamaShard([{"model": dict(ours.state_dict())}], cfg), Checkpoints(str(tmp_path / "c"), 1, Events())
    ckpts.begin(group, 1)
    path = ckpts.finish(group)
    raytp_cli("export", str(path), "--format", "hf", "--out", str(tmp_path / "hf"))
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert back.config.rope_parameters == model.config.rope_parameters
    assert hf.inspect(tmp_path / "hf") == cfg
    with torch.no_grad():
        assert float((back(tokens()).logits - model(tokens()).logits).abs().max()) < 1e-5
    written = json.loads((tmp_path / "hf" / "config.json").read_text())  # older transformers read rope_scaling
    assert written["rope_scaling"] == {**LLAMA3, "original_max_position_embeddings": ORIGINAL}


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_init_from_refuses_another_rope_type_by_name(tmp_path, key):
    config = hf_config().to_dict()
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    config[key] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = from_dict({"model": {"init_from": str(tmp_path), "block_size": T}})
    with pytest.raises(ValueError, match=f"config.json: {key} .*rope_type 'yarn' is not supported; valid: llama3"):
        starting_state(cfg, None, tmp_path / "run", say=lambda m: None)


def test_job_key_round_trips_and_reaches_the_model():
    cfg = from_dict({"model": {"arch": "llama", "rope_scaling": {**LLAMA3, "factor": 8}}})
    assert cfg.model.rope_scaling == RopeScaling(**LLAMA3)
    assert from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg
    assert build_model(model_args(cfg), seed=0).cfg.rope_scaling == RopeScaling(**LLAMA3)
    flow = "{" + ", ".join(f"{k}: {v}" for k, v in LLAMA3.items()) + "}"
    assert from_dict({}, overrides=[f"model.rope_scaling={flow}"]).model.rope_scaling == RopeScaling(**LLAMA3)


@pytest.mark.parametrize("value, message", [
    ({"rope_type": "yarn", "factor": 4.0}, "rope_type 'yarn' is not supported; valid: llama3"),
    ({"rope_type": "llama3", "factor": 8.0}, "missing low_freq_factor, high_freq_factor, "
                                             "original_max_position_embeddings"),
    ({**LLAMA3, "factr": 2}, "unknown field 'factr'; valid: rope_type, factor"),
    ({**LLAMA3, "factor": 0.5}, "factor: 0.5 must be >= 1"),
    ({**LLAMA3, "high_freq_factor": 1.0}, "high_freq_factor: 1 must exceed low_freq_factor=1"),
    ({**LLAMA3, "original_max_position_embeddings": 8.5}, "original_max_position_embeddings: expected an integer"),
    ("llama3", "expected a mapping of rope_type, factor"),
], ids=["yarn", "missing", "unknown", "factor", "bands", "original", "not-mapping"])
def test_bad_job_key_is_refused_naming_it(value, message):
    with pytest.raises(ConfigError) as e:
        from_dict({"model": {"rope_scaling": value}}, source="jobs/x.yaml")
    (line,) = e.value.problems
    assert line.startswith(f"jobs/x.yaml: model.rope_scaling: {message}")
