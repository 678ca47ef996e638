"""A BPE tokenizer trained here with `tokenizers` on stdlib text: the corpus is prepared once (raytp prepare's
in-process path) into a dataset beside the data, each file a document ended by the end-of-document id; a
Llama run on it trains, and `raytp sample` of its export encodes
the prompt and decodes text with the same tokenizer."""
import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from raytp.data.corpus import load_corpus

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
              trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"]))
    tok.save(str(root / "tokenizer.json"))
    return data, root / "tokenizer.json", tok


def test_text_is_prepared_once_into_a_dataset_beside_it(text_and_tokenizer):
    data, tok_file, tok = text_and_tokenizer
    corpus = load_corpus(str(data), 0.1, str(tok_file))
    eod = tok.token_to_id("<|endoftext|>")
    assert corpus.vocab_size == tok.get_vocab_size() <= VOCAB and corpus.eod_id == eod
    (made,) = [p for p in (data / ".raytp").iterdir() if p.is_dir()]
    assert (made / "manifest.json").exists()
    ids = np.concatenate(corpus.train[0].pieces + corpus.val[0].pieces)  # 7 files: the last one held out
    files = sorted(data.glob("*.py"))
    expected = np.concatenate([tok.encode(f.read_text(), add_special_tokens=False).ids + [eod] for f in files])
    assert np.array_equal(ids, expected)  # each file a document, in order, ended by the end-of-document id
    assert np.array_equal(np.concatenate(corpus.val[0].pieces), expected[-len(tok.encode(files[-1].read_text()).ids) - 1:])
    assert len(ids) < 0.7 * sum(p.stat().st_size for p in files)  # BPE: fewer tokens than bytes
    mtime = (made / "manifest.json").stat().st_mtime_ns
    load_corpus(str(data), 0.1, str(tok_file))  # made: read, not written again
    assert (made / "manifest.json").stat().st_mtime_ns == mtime
    (data / "keyword.py").write_text((data / "keyword.py").read_text() + "\n# changed\n")
    load_corpus(str(data), 0.1, str(tok_file))
    assert len([p for p in (data / ".raytp").iterdir() if p.is_dir()]) == 2  # the source changed: prepared again


def test_a_tokenizer_without_an_end_of_document_token_is_refused(text_and_tokenizer, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    data, _, _ = text_and_tokenizer
    bare = Tokenizer(models.BPE())
    bare.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bare.train([str(data / "abc.py")], trainers.BpeTrainer(vocab_size=300))
    bare.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="end-of-document"):
        load_corpus(str(data), 0.1, str(tmp_path / "tokenizer.json"))


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
    raytp_cli("export", str(run_dir), "--tokenizer", str(tok_file), "--out", str(tmp_path / "m.safetensors"))
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
