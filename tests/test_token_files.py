"""Token files: a Megatron-LM indexed dataset (written here from the format's documented header) and a nanoGPT
.bin of uint32 ids train with a vocabulary past 65,536; a .bin whose .idx says another id type than data.dtype
is refused by name; a broken index is refused naming the file."""
import dataclasses
import json
import struct

import numpy as np
import pytest

from helpers import job, run
from raytp.api.errors import BadJob
from raytp.api.job import check_data
from raytp.data.corpus import batch, load_corpus
from raytp.data.indexed import write_indexed

VOCAB = 70_016  # past uint16: Llama 3's 128k and GPT-NeoX's 50k+ specials need 32-bit ids


def documents(n=40, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB - 16, size=rng.integers(20, 120)).astype(np.int64) for _ in range(n)]


def test_a_megatron_index_is_read_as_its_header_says(tmp_path):
    docs = documents()
    write_indexed(tmp_path / "corpus", docs, np.int32)
    head = (tmp_path / "corpus.idx").read_bytes()[:34]  # Megatron's MMapIndexedDataset header, spelled out
    assert head == b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + bytes([4]) + struct.pack("<QQ", len(docs), len(docs) + 1)
    corpus = load_corpus(str(tmp_path / "corpus.bin"), val_fraction=0.1)
    both = np.concatenate(corpus.train[0].pieces + corpus.val[0].pieces)  # documents held out from all over
    assert both.dtype == np.int32 and np.array_equal(np.sort(both), np.sort(np.concatenate(docs)))
    assert corpus.vocab_size == int(np.concatenate(docs).max()) + 1 > 65_536
    assert "Megatron-LM indexed dataset" in corpus.description
    x, y = batch(corpus, "train", 1, 0, 0, 1, 4, 16)
    assert x.dtype == y.dtype and x.max() >= 65_536 and np.array_equal(x[:, 1:], y[:, :-1])


def test_a_uint32_bin_with_data_dtype_and_a_mismatched_index_refused(tmp_path):
    ids = np.concatenate(documents(seed=1))
    ids.astype(np.uint32).tofile(tmp_path / "ids.bin")
    corpus = load_corpus(str(tmp_path / "ids.bin"), 0.1, dtype="uint32")
    assert np.array_equal(np.concatenate(corpus.train[0].pieces + corpus.val[0].pieces), ids)  # its tail held out
    assert corpus.vocab_size > 65_536
    write_indexed(tmp_path / "mega", documents(seed=2), np.int32)
    with pytest.raises(ValueError, match=r"data.dtype: uint16, but .*mega.bin has a Megatron-LM index .* int32"):
        load_corpus(str(tmp_path / "mega.bin"), 0.1, dtype="uint16")
    (tmp_path / "bad.bin").write_bytes(b"\0" * 64)
    (tmp_path / "bad.idx").write_bytes(b"NOTANIDX" + b"\0" * 40)
    with pytest.raises(ValueError, match=r"bad.idx: not a Megatron-LM index"):
        load_corpus(str(tmp_path / "bad.bin"), 0.1)
    (tmp_path / "odd.bin").write_bytes(b"\0" * 6)
    with pytest.raises(ValueError, match=r"odd.bin is 6 bytes, not a whole number of uint32 ids"):
        load_corpus(str(tmp_path / "odd.bin"), 0.1, dtype="uint32")


@pytest.mark.slow  # over 10 s: the full suite's, not the quick tier's
def test_a_megatron_dataset_past_uint16_trains_and_a_smaller_vocabulary_is_refused(ray_local, tmp_path):
    write_indexed(tmp_path / "corpus", documents(n=200, seed=3), np.int32)
    cfg = job(1, 1, steps=3, model={"vocab_size": VOCAB})
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source=str(tmp_path / "corpus.bin")))
    check_data(cfg)
    small = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=50_304))
    with pytest.raises(BadJob, match=r"model.vocab_size: 50304 is smaller than data.source's vocabulary"):
        check_data(small)
    run(cfg, tmp_path / "run", "mega")
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [0, 1, 2] and all(np.isfinite(m["loss"]) for m in metrics)
    assert abs(metrics[0]["loss"] - np.log(VOCAB)) < 1.0  # a fresh model over the whole 70k vocabulary


def test_a_megatron_index_of_several_sequences_a_document_holds_out_whole_documents(tmp_path):
    """Megatron's index may cut a document into several sequences (its document boundaries name sequence
    indices): documents, not sequences, are held out."""
    seqs = [np.full(n, i, dtype=np.int32) for i, n in enumerate([3, 4, 5, 2, 6, 7, 1, 8, 9, 5], start=1)]
    write_indexed(tmp_path / "seq", seqs, np.int32)
    idx = bytearray((tmp_path / "seq.idx").read_bytes())
    docs = np.array([0, 2, 5, 6, 10], dtype=np.int64)  # 4 documents of 2, 3, 1 and 4 sequences
    n_seq = len(seqs)
    head = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, n_seq, len(docs))
    body = bytes(idx[34:34 + n_seq * 12])
    (tmp_path / "seq.idx").write_bytes(head + body + docs.tobytes())
    corpus = load_corpus(str(tmp_path / "seq.bin"), 0.25)  # one document of four
    val = set(np.concatenate(corpus.val[0].pieces).tolist())
    assert val in ({1, 2}, {3, 4, 5}, {6}, {7, 8, 9, 10}), val  # a whole document: all of its sequences
    (tmp_path / "seq.idx").write_bytes(head + body + np.array([0, 2, 5, 6, 11], dtype=np.int64).tobytes())
    with pytest.raises(ValueError, match=r"seq.idx: its document boundaries do not run from sequence 0 to 10"):
        load_corpus(str(tmp_path / "seq.bin"), 0.25)
