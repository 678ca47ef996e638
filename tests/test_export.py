"""Export to one file and to a GPT-2 directory (fp32, and bf16 in shards); start from a GPT-2 directory;
sample."""
import pytest
import torch

from raytp.models.files import load_model
from raytp.models.gpt2.model import GPT
from raytp.runtime.origin import starting_state
from helpers import FIXED, close, drive, full_state, job, raytp_cli

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained_tp2(ray_local, tmp_path_factory):
    """A TP=2 run with a checkpoint, and the sharded model's logits on FIXED."""
    run_dir = tmp_path_factory.mktemp("tp2")
    d, _, logits = drive(job(2, 1, steps=10, checkpoint={"every": 10}), run_dir, "tp2")
    close(d)
    return run_dir, logits


def test_exported_file_loads_on_one_device_with_the_same_logits(trained_tp2, tmp_path):
    run_dir, sharded_logits = trained_tp2
    raytp_cli("export", str(run_dir), "--out", str(tmp_path / "model.pt"))
    model = load_model(tmp_path / "model.pt")
    assert model.lm_head.weight is model.wte.weight
    with torch.no_grad():
        logits = model(FIXED)
    assert float((logits - sharded_logits).abs().max()) < 1e-5


def test_hf_export_loads_in_transformers_with_same_logits_and_greedy_text(trained_tp2, tmp_path):
    run_dir, sharded_logits = trained_tp2
    raytp_cli("export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "hf"))
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert float((hf(FIXED).logits - sharded_logits).abs().max()) < 1e-5
        ours = GPT.from_state_dict(hf_cfg(tmp_path / "hf"), full_state(run_dir)["model"]).eval()
        prompt = FIXED[:1, :8]
        theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(prompt, 12, temperature=0.0), theirs)


def test_gpt2_bf16_sharded_export_holds_the_fp32_export_rounded(trained_tp2, tmp_path):
    """Conv1D weights (stored transposed, written 64 rows at a time) rounded chunk by chunk, across shards."""
    run_dir, _ = trained_tp2
    raytp_cli("export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "fp32"))
    raytp_cli("export", str(run_dir), "--format", "hf", "--dtype", "bf16", "--max-shard-size", "40KB",
              "--out", str(tmp_path / "bf16"))
    assert len(list((tmp_path / "bf16").glob("model-*-of-*.safetensors"))) > 2
    fp32 = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "fp32", torch_dtype=torch.float32)
    bf16 = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "bf16", torch_dtype=torch.bfloat16)
    want, got = fp32.state_dict(), bf16.state_dict()
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)


def hf_cfg(path):
    import json
    from raytp.models.gpt2.hf import config_from_hf
    return config_from_hf(json.loads((path / "config.json").read_text()))


@pytest.mark.slow  # over 10 s: the full suite's, not the quick tier's
def test_gpt2_directory_imported_at_tp2_gives_transformers_logits(ray_local, tmp_path):
    hf_config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=32, vocab_size=256,
                                        bos_token_id=255, eos_token_id=255,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(3)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    hf.save_pretrained(tmp_path / "gpt2")
    # The job's own shape keys are wrong on purpose: the directory's config.json wins.
    cfg = job(2, 1, steps=4, model={"init_from": str(tmp_path / "gpt2"), "n_layer": 1, "n_embd": 32})
    cfg, init_state = starting_state(cfg, None, tmp_path / "run", say=lambda m: None)
    assert (cfg.model.n_layer, cfg.model.n_embd) == (2, 64)
    d, logits, _ = drive(cfg, tmp_path / "run", "hf-import", until=0, init_state=init_state)
    close(d)
    with torch.no_grad():
        assert float((hf(FIXED).logits - logits).abs().max()) < 1e-5


@pytest.mark.slow  # three CLI processes
def test_sample_greedy_is_deterministic_and_decodes_bytes(trained_tp2, tmp_path):
    run_dir, _ = trained_tp2
    raytp_cli("export", str(run_dir), "--out", str(tmp_path / "m.pt"))
    a = raytp_cli("sample", str(tmp_path / "m.pt"), "--prompt", "def ", "--tokens", "20", "--temperature", "0").stdout
    b = raytp_cli("sample", str(tmp_path / "m.pt"), "--prompt", "def ", "--tokens", "20", "--temperature", "0").stdout
    assert a == b and a.startswith("def ")
    model = load_model(tmp_path / "m.pt")
    expect = model.generate(torch.tensor([list(b"def ")]), 20, temperature=0.0)[0].tolist()
    assert a.rstrip("\n") == bytes(expect).decode("utf-8", errors="replace")
