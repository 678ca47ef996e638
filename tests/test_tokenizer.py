"""A BPE tokenizer trained here with `tokenizers` on stdlib text: the corpus is encoded once into a
cached token file beside the data; a Llama run on it trains, and `raytp sample` of its export encodes
the prompt and decodes text with the same tokenizer."""
import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from raytp.train.data import load_corpus

VOCAB = 400


@pytest.fixture(scope="module")
def text_and_tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    root = tmp_path_factory.mktemp("bpe")
    data = root / "data"
    data.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("abc.py", "bisect.py", "colorsys.py", "heapq.py", "keyword.py", "string.py", "textwrap.py"):
        shutil.copyfile(stdlib / name, data / name)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(p) for p in sorted(data.iterdir())],
              trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer.json"))
    return data, root / "tokenizer.json", tok


def test_text_is_encoded_once_into_a_cached_token_file(text_and_tokenizer):
    data, tok_file, tok = text_and_tokenizer
    corpus = load_corpus(str(data), 0.1, str(tok_file))
    assert corpus.vocab_size == tok.get_vocab_size() <= VOCAB
    cached = sorted((data / ".raytp").iterdir())
    assert len(cached) == 1 and cached[0].suffix == ".uint16"
    ids = np.concatenate(corpus.train[0].pieces + corpus.val[0].pieces)
    first = (data / "abc.py").read_text()
    assert tok.decode(ids[:len(tok.encode(first).ids)].tolist()) == first  # documents in file order
    assert len(ids) < 0.7 * sum(p.stat().st_size for p in data.glob("*.py"))  # BPE: fewer tokens than bytes
    mtime = cached[0].stat().st_mtime_ns
    load_corpus(str(data), 0.1, str(tok_file))  # cached: read, not written again
    assert sorted((data / ".raytp").iterdir()) == cached and cached[0].stat().st_mtime_ns == mtime
    (data / "keyword.py").write_text((data / "keyword.py").read_text() + "\n# changed\n")
    load_corpus(str(data), 0.1, str(tok_file))
    assert len(list((data / ".raytp").iterdir())) == 2  # the source changed: encoded again


def test_a_missing_tokenizer_is_one_clear_error(text_and_tokenizer, tmp_path):
    data, _, _ = text_and_tokenizer
    with pytest.raises(ValueError, match="data.tokenizer: .*no such tokenizer.json"):
        load_corpus(str(data), 0.1, str(tmp_path))


@pytest.mark.slow
def test_llama_trains_on_bpe_tokens_and_samples_text(ray_local, text_and_tokenizer, tmp_path):
    from helpers import close, drive, job, raytp_cli
    data, tok_file, tok = text_and_tokenizer
    cfg = job(2, 1, steps=30, checkpoint={"every": 30},
              model={"arch": "llama", "n_head": 4, "n_kv_head": 2, "vocab_size": VOCAB})
    cfg = _with_data(cfg, data, tok_file)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    import yaml
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    d, _, _ = drive(cfg, run_dir, "bpe")
    close(d)
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, str([round(x, 3) for x in losses])  # one step is noisy
    raytp_cli("export", str(run_dir), "--out", str(tmp_path / "m.safetensors"))  # tokenizer from config.yaml
    out = subprocess.run([sys.executable, "-m", "raytp.cli", "sample", str(tmp_path / "m.safetensors"),
                          "--prompt", "def ", "--tokens", "30", "--temperature", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout.rstrip("\n")
    assert text.startswith("def ") and len(text) > len("def ") + 10
    assert tok.decode(tok.encode(text).ids) == text  # it is text of this tokenizer


def _with_data(cfg, data, tok_file):
    import dataclasses
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source=str(data), tokenizer=str(tok_file)),
                               train=dataclasses.replace(cfg.train, lr=1e-2, eval_interval=0))
