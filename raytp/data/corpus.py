"""The corpus a job trains on, and each step's batch: a pure function of (seed, step, DP rank).

The corpus is one source (``data.source``) or a blend (``data.mix: {SOURCE: weight}``), each opened as token
streams (raytp.data.token_sources), with validation held out of each source by whole documents, or taken from
``data.val_source``. The batch of step s is the global samples ``s*B .. s*B+B-1`` (raytp.data.sampling): a
blend sends each sample to one source in the weights' proportions, exact within one sample per step; each
source reads its windows in a fresh seeded permutation per epoch, so every window is read once per epoch. DP
rank d takes its contiguous rows, so every layout sees the same data and any step can be replayed exactly
(recovery, resizing).

A corpus of conversations (prepared datasets of them: raytp.data.conversation_split) reads packed rows
instead of windows (raytp.data.packing: whole conversations per row, packed once per block size and seed),
in the same seeded permutation per epoch; its batches are (x, y, documents), y -1 where not trained on.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from raytp.data import packing
from raytp.data.sampling import blend, step_samples, window_count, windows
from raytp.data.token_sources import open_source
from raytp.data.stream import Stream
from raytp.seeds import derive_seed

SPLITS = {"train": 0, "val": 1}


@dataclass
class Corpus:
    train: list  # a Stream per source (a bare array or Stream is taken as one source; None: only peeked at)
    val: list    # a Stream per source, or the one of data.val_source (None: only peeked at, or nothing held out)
    vocab_size: int
    description: str
    weights: tuple = field(default=())  # data.mix's, one per training source
    eod_id: int | None = None
    names: tuple = field(default=())    # the training sources' names, as the job gives them
    documents: dict = field(default_factory=dict)  # conversations: split -> [(doc ends, mask Stream)] per source
    packing: bool = True                # conversations packed first-fit (data.packing), else one per row
    too_long: str = "truncate"          # data.too_long
    counts: dict | None = None          # conversations: the manifests' counts (rows, trained, bad)

    def __post_init__(self):
        self.train, self.val = _streams(self.train), _streams(self.val)
        if len(self.train) > 1 and len(self.weights) != len(self.train):
            raise ValueError("a blend of sources needs one weight per source")
        self._plans: dict = {}

    @property
    def conversations(self) -> bool:
        return self.counts is not None

    def packed(self, split: str, source: int, block_size: int, seed: int) -> packing.Packing:
        """The packing of a conversations split's source into rows (made once per block size and seed)."""
        key = (split, source, block_size, seed)
        if key not in self._plans:
            ends = self.documents[split][source][0]
            self._plans[key] = packing.plan(ends, block_size, derive_seed(seed, SPLITS[split]), self.packing,
                                            self.too_long)
        return self._plans[key]

    def windows(self, split: str, block_size: int, seed: int | None = None) -> list[int]:
        """Windows of `block_size` in each source of a split: an epoch of the split (conversations: its
        packed rows, of `seed`, else of the last seed its batches were made with)."""
        streams = self.train if split == "train" else self.val
        if self.conversations:
            seed = seed if seed is not None else next((k[3] for k in reversed(self._plans)), 0)
            return [self.packed(split, d, block_size, seed).rows for d in range(len(streams))]
        return [window_count(len(s), block_size) for s in streams]


def _streams(x) -> list:
    items = x if isinstance(x, list) else [x]
    return [s if s is None or isinstance(s, Stream) else Stream([np.asarray(s)]) for s in items]


def load_corpus(source: str, val_fraction: float = 0.1, tokenizer: str | None = None, progress: bool = False,
                dtype: str | None = None, mix: dict | None = None, val_source: str | None = None,
                peek: bool = False) -> Corpus:
    """The corpus of a job's data section (`mix`, SOURCE -> weight, replaces `source`); `peek`: sources at a
    URL are described from their manifests, not fetched (the driver's check). ValueError naming the problem."""
    names = list(mix) if mix else [source]
    hold = None if val_source else val_fraction
    opened = []
    for name in names:
        try:
            opened.append(open_source(name, hold, tokenizer, dtype, progress, peek))
        except ValueError as e:
            raise ValueError(_named(_key(mix, name), e)) from None
    if val_source:
        try:
            v = open_source(val_source, None, tokenizer, dtype, progress, peek)
        except ValueError as e:
            raise ValueError(_named("data.val_source", e)) from None
        val, vals = [v.train], [v]
    else:
        val, vals = [s.val for s in opened], []
    _one_tokenizer(names + ([val_source] if val_source else []), opened + vals)
    documents, counts = _documents(names, opened, vals)
    vocab, eods = max(s.vocab_size for s in opened + vals), {s.eod_id for s in opened + vals}
    what = "; ".join(f"{mix[n]:g} x {s.description}" if mix else s.description for n, s in zip(names, opened))
    if val_source:
        what += f"; validation: {vals[0].description}"
    weights = tuple(float(mix[n]) for n in names) if mix else ()
    return Corpus([s.train for s in opened], val, vocab, what, weights, eods.pop() if len(eods) == 1 else None,
                  tuple(names), documents, counts=counts)


def _documents(names: list[str], opened: list, vals: list) -> tuple[dict, dict | None]:
    """Conversations' boundaries and masks by split, and their manifests' counts summed; ({}, None) for text.
    Conversations and text are not blended (ValueError naming them)."""
    conv = [s.conversations is not None for s in opened + vals]
    if not any(conv):
        return {}, None
    if not all(conv):
        raise ValueError(f"data: {', '.join(names)}: conversations and text in one job; train on one or the other")
    counts = {"rows": 0, "trained_tokens": 0, "bad": {}}
    for s in opened:
        c = s.conversations
        counts["rows"] += c["rows"]
        counts["trained_tokens"] += c["trained_tokens"]
        for k, n in c["bad"].items():
            counts["bad"][k] = counts["bad"].get(k, 0) + n
    if any(s.documents is None for s in opened + vals):  # peeked at (a dataset at a URL): counts only
        return {"train": [], "val": []}, counts
    train = [(s.documents.train_ends, s.documents.train_mask) for s in opened]
    if vals:
        val = [(vals[0].documents.train_ends, vals[0].documents.train_mask)]
    else:
        val = [(s.documents.val_ends, s.documents.val_mask) for s in opened] if opened[0].val is not None else []
    return {"train": train, "val": val}, counts


def _one_tokenizer(names: list[str], sources: list) -> None:
    """Sources read together must speak one vocabulary: prepared datasets made with different tokenizers, or
    ending documents with different ids, are refused, naming them."""
    for attr, what in (("tokenizer", "tokenizers"), ("eod_id", "end-of-document ids")):
        seen = {n: getattr(s, attr) for n, s in zip(names, sources) if getattr(s, attr) is not None}
        if len(set(seen.values())) > 1:
            listed = ", ".join(f"{n} ({str(v)[:12]})" for n, v in seen.items())
            raise ValueError(f"data: the sources were prepared with different {what}: {listed}; prepare them "
                             "with one tokenizer")


def _named(key: str, e: ValueError) -> str:
    """The error, led by the job key it is about (unless it names one already: data.tokenizer, data.dtype)."""
    return str(e) if str(e).startswith("data.") else f"{key}: {e}"


def _key(mix, name: str) -> str:
    return f"data.mix: {name}" if mix else "data.source"


def batch(corpus: Corpus, split: str, seed: int, step: int, dp_rank: int, dp: int,
          batch_size: int, block_size: int) -> tuple[torch.Tensor, ...]:
    """(x, y) of shape (batch_size/dp, block_size): DP rank `dp_rank`'s rows of the global batch; of
    conversations (x, y, documents): packed rows (raytp.data.packing), y -1 where not trained on."""
    streams = corpus.train if split == "train" else corpus.val
    if corpus.conversations:
        return _packed_batch(corpus, split, seed, step_samples(step, batch_size, dp_rank, dp), block_size)
    samples = step_samples(step, batch_size, dp_rank, dp)
    if len(streams) > 1:  # a blend (its validation too, held out of each source, unless data.val_source)
        source, index = blend(samples, list(corpus.weights))
    else:
        source, index = np.zeros_like(samples), samples
    rows = np.empty((len(samples), block_size + 1), dtype=np.int64)
    for d in np.unique(source).tolist():
        stream, sel = streams[d], np.flatnonzero(source == d)
        n = window_count(len(stream), block_size)
        if n == 0:
            which = f" of {corpus.names[d]}" if len(corpus.names) > 1 else ""
            raise ValueError(f"the {split} split{which} has {len(stream)} "
                             f"tokens, fewer than block_size+1={block_size + 1}")
        starts = windows(index[sel], n, derive_seed(seed, SPLITS[split]), d) * block_size
        rows[sel] = stream.rows(starts, block_size + 1)
    return torch.from_numpy(np.ascontiguousarray(rows[:, :-1])), torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))


def _packed_batch(corpus: Corpus, split: str, seed: int, samples: np.ndarray, block_size: int) -> tuple:
    streams = corpus.train if split == "train" else corpus.val
    source, index = blend(samples, list(corpus.weights)) if len(streams) > 1 else (np.zeros_like(samples), samples)
    out = [np.empty((len(samples), block_size), dtype=np.int64) for _ in range(3)]
    for d in np.unique(source).tolist():
        sel = np.flatnonzero(source == d)
        p = corpus.packed(split, d, block_size, seed)
        if p.rows == 0:
            raise ValueError(f"the {split} split of {corpus.names[d] if corpus.names else 'the data'} holds no "
                             "conversation of two tokens or more")
        which = windows(index[sel], p.rows, derive_seed(seed, SPLITS[split]), d)
        for o, part in zip(out, packing.rows(p, streams[d], corpus.documents[split][d][1], which, block_size)):
            o[sel] = part
    return tuple(torch.from_numpy(o) for o in out)


def packing_line(corpus: Corpus, seed: int, block_size: int) -> str:
    """What the packing of a conversations corpus's training split makes of it (for the start line):
    rows, and the conversations longer than a row, cut or left out; ValueError under data.too_long: refuse."""
    if not corpus.conversations or not corpus.documents.get("train"):
        return ""
    plans = [corpus.packed("train", d, block_size, seed) for d in range(len(corpus.train))]
    rows, long, short = (sum(getattr(p, k) for p in plans) for k in ("rows", "too_long", "short"))
    if corpus.too_long == "refuse" and long:
        raise ValueError(f"data.too_long: refuse, and {long:,} conversations are longer than model.block_size + 1 "
                         f"= {block_size + 1} tokens; raise block_size, or truncate or drop them (data.too_long)")
    how = "packed" if corpus.packing else "one per row"
    fate = "dropped" if corpus.too_long == "drop" else "truncated"
    return (f"; {how} into {rows:,} rows of {block_size}, {long:,} conversations longer than a row ({fate})"
            + (f", {short:,} of one token left out" if short else ""))


def job_corpus(data, progress: bool = False, peek: bool = False) -> Corpus:
    """The corpus of a job's `data` section (raytp.config.schema.DataConfig)."""
    c = load_corpus(data.source, data.val_fraction, data.tokenizer, progress, data.dtype,
                    dict(data.mix) if data.mix else None, data.val_source, peek)
    c.packing, c.too_long = data.packing, data.too_long
    if c.counts is not None and data.bad_rows == "refuse" and sum(c.counts["bad"].values()):
        raise ValueError(f"data.bad_rows: refuse, and the conversations hold bad rows "
                         f"({', '.join(f'{n} {k}' for k, n in c.counts['bad'].items())}); fix them, or skip them "
                         "(data.bad_rows: skip)")
    return c


def document_eod(data, corpus: Corpus) -> int | None:
    """The end-of-document id attention stops at (None: data.document_mask is off); ValueError if unknown."""
    if not data.document_mask:
        return None
    eod = data.eod_id if data.eod_id is not None else corpus.eod_id
    if eod is None:
        raise ValueError("data.document_mask: the data does not say its end-of-document id (a raytp prepared "
                         "dataset does, and text with data.tokenizer); set data.eod_id")
    if eod >= corpus.vocab_size and data.eod_id is not None:
        raise ValueError(f"data.eod_id: {eod} is not an id of the data (its ids are below {corpus.vocab_size})")
    return eod


def epochs_read(corpus: Corpus, samples: int, block_size: int) -> float:
    """How many epochs of its training data the first `samples` samples have read (of a blend: the most of any
    source's, the one repeated first)."""
    counts = corpus.windows("train", block_size)
    if not counts or min(counts) == 0:
        return 0.0
    shares = [w / sum(corpus.weights) for w in corpus.weights] if len(counts) > 1 else [1.0]
    return max(samples * s / n for s, n in zip(shares, counts))


def vocabulary_fits(corpus: Corpus, data, vocab_size: int) -> None:
    """The data's ids are below the model's vocabulary: ValueError naming the job keys if not."""
    if corpus.vocab_size > vocab_size:
        key = "data.mix" if data.mix else "data.source"
        raise ValueError(f"model.vocab_size: {vocab_size} is smaller than {key}'s "
                         f"vocabulary: it has token ids up to {corpus.vocab_size - 1}; valid: model.vocab_size >= "
                         f"{corpus.vocab_size}")


def check_ids(x: torch.Tensor, y: torch.Tensor, vocab_size: int, split: str, step: int) -> None:
    """A batch's ids are below the model's vocabulary (the check before the start reads the first 64M ids of a
    .bin; an id past it would fail the embedding on a GPU with a device-side assert): ValueError if not."""
    top = max(int(x.max()), int(y.max()))
    if top >= vocab_size:
        raise ValueError(f"data: the {split} batch of step {step} holds token id {top}, past model.vocab_size="
                         f"{vocab_size} (the check before the start reads the first 64M ids of each .bin)")
