"""A corpus for `raytp prepare`'s tests (tests/test_prepare.py, tests/test_s3.py): JSON lines (plain and
gzipped) and Parquet made from stdlib text, a BPE tokenizer trained on it, and the prepared dataset read back
as Megatron-LM's reader sees it."""
import gzip
import json
import sysconfig
from pathlib import Path

import numpy as np

from raytp.data import manifest as manifest_mod
from raytp.data.indexed import read_index

EOD = "<|endoftext|>"
SHARD_TOKENS = 2000  # small: several shards, a JSON-lines file cut into byte ranges, Parquet by row groups


def _documents() -> list[str]:
    """Stdlib source cut at blank lines into documents (and one that is not ASCII)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for name in ("abc.py", "bisect.py", "colorsys.py", "heapq.py", "keyword.py", "textwrap.py"):
        docs += [d for d in stdlib.joinpath(name).read_text().split("\n\n") if d.strip()]
    return docs + ["naïve café — 日本語のテキスト ✓"]


def make_corpus(root: Path):
    """(directory of a.jsonl, b.jsonl.gz, c.parquet; their documents in order; tokenizer.json; Tokenizer)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    docs = _documents()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=400, special_tokens=[EOD],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer.json"))
    data = root / "data"
    data.mkdir()
    third = len(docs) // 3
    a, b, c = docs[:third], docs[third:2 * third], docs[2 * third:]
    (data / "a.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(a)))
    with gzip.open(data / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in b)
    pq.write_table(pa.table({"text": c}), data / "c.parquet", row_group_size=20)
    return data, a + b + c, root / "tokenizer.json", tok


def read_back(where: Path, m: manifest_mod.Manifest) -> list[list[int]]:
    """Every document of a prepared dataset, as Megatron-LM's reader sees it: the .idx and the .bin."""
    docs = []
    for s in m.shards:
        index = read_index(where / f"{s.prefix}.idx")
        ids = np.memmap(where / f"{s.prefix}.bin", dtype=index.dtype, mode="r")
        assert np.dtype(index.dtype).name == m.dtype and len(index.sizes) == s.documents == len(index.documents) - 1
        step = np.dtype(index.dtype).itemsize
        docs += [ids[p // step:p // step + n].tolist() for n, p in zip(index.sizes, index.pointers)]
    return docs


def expected(tok, docs):
    eod = tok.token_to_id(EOD)
    return [e.ids + [eod] for e in tok.encode_batch(docs, add_special_tokens=False)]
