"""A prepared dataset's manifest: what `raytp prepare` wrote, read by training.

A prepared dataset is a directory (local, shared or an object-store URL) of shards in Megatron-LM's indexed
format (``shard-00000.bin`` + ``shard-00000.idx``, one sequence per document, each document's ids followed
by the tokenizer's end-of-document id) and ``manifest.json``, written last: a directory without a manifest
is not a dataset (a killed prepare never looks finished). The shards' order is the dataset's order.

    {"format": "raytp-prepared", "version": 1,
     "tokenizer": {"sha256": ..., "vocab_size": N, "eod_id": K, "eod_token": "<|endoftext|>"},
     "dtype": "uint16" | "int32",
     "shards": [{"prefix": "shard-00000", "documents": n, "tokens": t}, ...],
     "documents": total, "tokens": total, "sources": [...]}

Ids are uint16 below a vocabulary of 65,536, else int32: Megatron's index has no uint32 code, and int32
holds every vocabulary there is.

A dataset of conversations (raytp.data.prepare.chat) adds, beside each shard, ``shard-00000.mask`` (one
uint8 per token: 1 where the token is trained on, an assistant turn's content and its end of turn), each
conversation one document with no end-of-document id added, each shard its ``"trained"`` tokens, and

     "conversations": {"rows": r, "trained_tokens": t, "bad": {"no_assistant_turn": n, ...},
                       "chat_template": {"sha256": ..., "source": ...}}

(rows: the conversations read, the bad ones included; bad: those not trained on, by reason).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from raytp import trust

FORMAT = "raytp-prepared"
VERSION = 1
NAME = "manifest.json"
DTYPES = ("uint16", "int32")


@dataclass(frozen=True)
class Shard:
    prefix: str     # the shard's .bin/.idx without the suffix, relative to the dataset
    documents: int
    tokens: int
    trained: int | None = None  # conversations: tokens trained on (its .mask's ones)


@dataclass(frozen=True)
class Manifest:
    tokenizer: dict          # sha256, vocab_size, eod_id, eod_token
    dtype: str
    shards: tuple[Shard, ...]
    sources: tuple[str, ...] = field(default=())
    conversations: dict | None = None  # rows, trained_tokens, bad (by reason), chat_template

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.shards)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer["vocab_size"])

    @property
    def eod_id(self) -> int:
        return int(self.tokenizer["eod_id"])

    def to_json(self) -> str:
        d = {"format": FORMAT, "version": VERSION, "tokenizer": self.tokenizer, "dtype": self.dtype,
             "shards": [{k: v for k, v in asdict(s).items() if v is not None} for s in self.shards],
             "documents": self.documents, "tokens": self.tokens, "sources": list(self.sources)}
        if self.conversations is not None:
            d["conversations"] = self.conversations
        return json.dumps(d, indent=1)


def dtype_for(vocab_size: int) -> str:
    """The id type of a vocabulary's shards."""
    return "uint16" if vocab_size <= 1 << 16 else "int32"


def parse(text: str, where: str) -> Manifest:
    """A manifest from its JSON; ValueError naming `where` and what is wrong."""
    try:
        d = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(f"{where}: not a raytp prepared dataset's manifest (no \"format\": \"{FORMAT}\")")
    if d.get("version") != VERSION:
        raise ValueError(f"{where}: manifest version {d.get('version')}; this raytp reads version {VERSION}")
    try:
        shards = tuple(Shard(str(s["prefix"]), int(s["documents"]), int(s["tokens"]),
                             None if s.get("trained") is None else int(s["trained"])) for s in d["shards"])
        tok = dict(d["tokenizer"])
        for key in ("vocab_size", "eod_id"):
            int(tok[key])
        conv = d.get("conversations")
        if conv is not None and (not isinstance(conv, dict) or any(s.trained is None for s in shards)):
            raise ValueError("conversations without each shard's trained tokens")
        m = Manifest(tok, str(d["dtype"]), shards, tuple(d.get("sources", ())), conv)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from None
    if m.dtype not in DTYPES:
        raise ValueError(f"{where}: dtype {m.dtype!r}, expected one of {', '.join(DTYPES)}")
    if not shards:
        raise ValueError(f"{where}: the dataset has no shards (an empty source?)")
    for s in shards:  # a name of the dataset's files, never a path out of it (read here and by fetch)
        trust.relative(s.prefix, f"{where}: shards: prefix")
        if s.documents < 0 or s.tokens < 0:
            raise ValueError(f"{where}: shards: {s.prefix}: negative counts")
    return m
