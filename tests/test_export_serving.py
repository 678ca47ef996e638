"""`raytp export --format hf` of a Llama that serves: a tiny raytp Llama trained here on text encoded by a
BPE tokenizer trained here, checkpointed as the runtime does, exported. A fresh Python with raytp blocked
loads it with AutoTokenizer and AutoModelForCausalLM in bf16 and greedy-generates what `raytp sample`
prints; sharded files load the same; bf16 files hold bf16; the tokenizer's side files and special ids are
made, or copied from the model.init_from directory; a failed export leaves nothing that looks whole."""
import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from click.testing import CliRunner

from raytp.cli import main
from raytp.files import checkpoint
from raytp.files.interop import hf, hf_tokenizer
from raytp.files.storage import Storage
from raytp.models.args import ModelArgs
from raytp.models.files import load_model
from raytp.models.registry import build_model
from raytp.runtime.state.checkpoints import Checkpoints
from offline import Events, ShardsGroup

transformers = pytest.importorskip("transformers")
VOCAB, T, EOT = 320, 32, "<|endoftext|>"
PROMPT = "def "


def shipped(run_dir):
    """The tokenizer the run dir's config.yaml names, named on the command line (a run dir's paths are not
    followed: only what the command names is shipped)."""
    return ["--tokenizer", str(run_dir.parent / "tok")]


def cli(*args):
    """`raytp ARGS` in this process; the result, which must have succeeded."""
    r = CliRunner().invoke(main, list(args))
    assert r.exit_code == 0, r.output
    return r


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run dir: config.yaml naming the BPE tokenizer, and a checkpoint of a tiny Llama trained on it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    root = tmp_path_factory.mktemp("serving")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [str(stdlib / n) for n in ("bisect.py", "colorsys.py", "heapq.py")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(texts, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOT],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    ids = torch.tensor(tok.encode(Path(texts[0]).read_text()).ids)
    cfg = ModelArgs(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=T, vocab_size=VOCAB)
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g, threads = torch.Generator().manual_seed(0), torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend on a shared machine
    try:
        for _ in range(150):  # memorise bisect.py: confident greedy choices, which bf16 does not flip
            at = torch.randint(len(ids) - T - 1, (16,), generator=g)
            x = torch.stack([ids[i:i + T] for i in at])
            y = torch.stack([ids[i + 1:i + T + 1] for i in at])
            loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    assert loss.item() < 1.0, loss.item()
    run = root / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": str(root / "tok")}}))
    save_checkpoint(run / "checkpoints", model)
    return run


class OneLlamaShard(ShardsGroup):
    """A Llama's key/value projections split by its n_kv_head: the tensors need its shape."""

    def begin_save(self, url, directory):
        cfg = ModelArgs(**{k: v for k, v in self.cfg.model.__dict__.items() if k in ModelArgs.__dataclass_fields__})
        tensors = checkpoint.state_tensors(self.shards[0], cfg)
        return checkpoint.tensor_table(tensors, 1, cfg.vocab_size), [checkpoint.write_shard(Storage(url), directory, tensors, 0)]


def save_checkpoint(root, model):
    group, ckpts = OneLlamaShard([{"model": dict(model.state_dict())}], model.cfg), Checkpoints(str(root), 1, Events())
    ckpts.begin(group, 150)
    return ckpts.finish(group)


WITHOUT_RAYTP = """
import json, sys
sys.modules["raytp"] = None  # any import of raytp fails
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.bfloat16).eval()
ids = tok(sys.argv[2], return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=int(sys.argv[3]), do_sample=False)[0]
print(json.dumps({"ids": out.tolist(), "text": tok.decode(out), "dtype": str(model.dtype),
                  "eos": tok.eos_token, "eos_id": model.generation_config.eos_token_id}))
"""


@pytest.mark.slow  # over 10 s (generation in two processes); the quick tier keeps the other exports
def test_bf16_export_generates_what_raytp_sample_prints_with_no_raytp(run_dir, tmp_path):
    cli("export", str(run_dir), *shipped(run_dir), "--out", str(tmp_path / "m.safetensors"))
    sampled = cli("sample", str(tmp_path / "m.safetensors"), "--prompt", PROMPT, "--tokens", "24",
                  "--temperature", "0").stdout.rstrip("\n")
    cli("export", str(run_dir), *shipped(run_dir), "--format", "hf", "--dtype", "bf16", "--out", str(tmp_path / "hf"))
    p = subprocess.run([sys.executable, "-c", WITHOUT_RAYTP, str(tmp_path / "hf"), PROMPT, "24"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    theirs = json.loads(p.stdout.splitlines()[-1])
    assert theirs["dtype"] == "torch.bfloat16"
    assert theirs["text"] == sampled and sampled.startswith(PROMPT) and len(sampled) > len(PROMPT) + 24
    ours = load_model(tmp_path / "m.safetensors")  # what `raytp sample` ran: the tokens, not just the text
    prompt = torch.tensor([theirs["ids"][:-24]])
    assert ours.generate(prompt, 24, temperature=0.0)[0].tolist() == theirs["ids"]
    eot = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())["added_tokens"][0]["id"]
    assert theirs["eos"] == EOT and theirs["eos_id"] == eot  # made from the tokenizer's special token


def test_files_are_what_serving_reads(run_dir, tmp_path):
    cli("export", str(run_dir), *shipped(run_dir), "--format", "hf", "--out", str(tmp_path / "hf"))
    out = tmp_path / "hf"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((out / "config.json").read_text())
    eot = transformers.AutoTokenizer.from_pretrained(out).convert_tokens_to_ids(EOT)
    assert (config["bos_token_id"], config["eos_token_id"], config["torch_dtype"]) == (eot, eot, "float32")
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": eot, "eos_token_id": eot}
    assert json.loads((out / "special_tokens_map.json").read_text()) == {"bos_token": EOT, "eos_token": EOT}
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == T
    assert "auto_map" not in config  # no remote code: transformers' own LlamaForCausalLM


def test_sharded_bf16_export_loads_the_same_weights(run_dir, tmp_path):
    cli("export", str(run_dir), *shipped(run_dir), "--format", "hf", "--out", str(tmp_path / "one"))
    cli("export", str(run_dir), *shipped(run_dir), "--format", "hf", "--dtype", "bf16", "--max-shard-size", "60KB",
        "--out", str(tmp_path / "sharded"))
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files == sorted(p.name for p in (tmp_path / "sharded").glob("model-*.safetensors"))
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    from safetensors import safe_open
    total = 0
    for f in files:
        with safe_open(str(tmp_path / "sharded" / f), "pt") as st:
            sizes = [st.get_slice(k).get_dtype() == "BF16" and st.get_tensor(k).nbytes for k in st.keys()]
        assert all(sizes) and (sum(sizes) <= 60_000 or len(sizes) == 1), (f, sizes)  # bf16, within the limit
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    one = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "one", torch_dtype=torch.float32)
    sharded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", torch_dtype=torch.bfloat16)
    want = {k: v.to(torch.bfloat16) for k, v in one.state_dict().items()}
    got = sharded.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_tokenizer_files_and_ids_are_copied_from_the_init_from_directory(run_dir, tmp_path):
    """A run started from a Hugging Face directory (its tokenizer too): its side files and generation
    config are shipped as they are, its config.json's ids are the model's."""
    init = tmp_path / "init"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(run_dir.parent / "tok" / "tokenizer.json"),
                                                eos_token=EOT, pad_token=EOT)
    fast.save_pretrained(init)
    (init / "config.json").write_text(json.dumps({"bos_token_id": None, "eos_token_id": [0, 7]}))
    (init / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 7], "temperature": 0.6}))
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": str(init)},
                                                     "model": {"init_from": str(init)}}))
    cli("export", str(run), "--tokenizer", str(init), "--init-from", str(init), "--format", "hf", "--out",
        str(tmp_path / "hf"))
    out = tmp_path / "hf"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (init / name).read_bytes(), name
    config = json.loads((out / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"]) == ([0, 7], 0)  # the model's own; pad: the tokenizer's
    assert config["bos_token_id"] is None  # neither the model nor the tokenizer names one
    made = json.loads((out / "special_tokens_map.json").read_text())
    assert made == {"eos_token": EOT, "pad_token": EOT}  # from the copied tokenizer_config.json


def test_a_failed_export_leaves_the_previous_one_whole_and_nothing_else(run_dir, tmp_path):
    out = tmp_path / "hf"
    cli("export", str(run_dir), *shipped(run_dir), "--format", "hf", "--out", str(out))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint.find(str(run_dir)).where, broken)
    shard = broken / "tp000.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:9] = b"["  # the header no longer parses: the export fails at its first read, once it has begun
    shard.write_bytes(bytes(data))
    r = CliRunner().invoke(main, ["export", str(broken), "--format", "hf", "--dtype", "bf16", "--out", str(out)])
    assert r.exit_code == 1 and "tp000.safetensors: cannot be read" in r.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "hf"]  # no partial directory left
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    r = CliRunner().invoke(main, ["export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "mine")])
    assert r.exit_code == 2 and "holds files an export does not write (notes.txt)" in r.output
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("args, says", [
    (["--dtype", "bf16"], "only with --format hf"),
    (["--format", "hf", "--max-shard-size", "5 bytes"], "not a size"),
])
def test_bad_arguments_exit_2_and_write_nothing(run_dir, tmp_path, args, says):
    r = CliRunner().invoke(main, ["export", str(run_dir), "--out", str(tmp_path / "x"), *args])
    assert r.exit_code == 2 and says in r.output
    assert list(tmp_path.iterdir()) == []


def test_shards_are_planned_in_order_within_the_limit():
    assert hf.plan_shards([4, 4, 4, 9, 1], 8) == [[0, 1], [2], [3], [4]]  # 9 > 8: a file of its own
    assert hf.plan_shards([1, 2, 3], 100) == [[0, 1, 2]]
    assert hf.shard_names(1) == ["model.safetensors"]
    assert hf.shard_names(3)[1] == "model-00002-of-00003.safetensors"
    assert [hf.parse_size(s) for s in ("5GB", "500MB", "1GiB", "100kb", 1234)] == [5 * 10**9, 5 * 10**8, 2**30,
                                                                                   10**5, 1234]


def test_special_tokens_are_found_by_their_common_names():
    def tok(*names, special=True):
        return {"added_tokens": [{"id": i, "content": n, "special": special} for i, n in enumerate(names)]}
    guess = hf_tokenizer.guess_special_tokens
    assert guess(tok("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")) == {
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    assert guess(tok("<unk>", "<s>", "</s>")) == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    assert guess(tok(EOT)) == {"bos_token": EOT, "eos_token": EOT}  # GPT-2's
    assert guess(tok("<s>", special=False)) == {}
    declared = hf_tokenizer.declared_special_tokens({"tokenizer_config.json": {"eos_token": {"content": "</s>"}},
                                                     "special_tokens_map.json": {"eos_token": "<x>", "bos_token": "<s>"}})
    assert declared == {"eos_token": "</s>", "bos_token": "<s>"}  # tokenizer_config.json's first
