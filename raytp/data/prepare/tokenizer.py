"""The tokenizer a corpus is prepared with, and its end-of-document token.

The end-of-document token is `--eod` when given; else the ``eos_token`` of a ``tokenizer_config.json``
beside the ``tokenizer.json`` (what Hugging Face model directories carry); else the first of KNOWN_EOD the
vocabulary holds (GPT-2's, Llama 3's, Llama 2's, Gemma's). None of these: one error saying to pass --eod.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from raytp.data import tokens

KNOWN_EOD = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


@dataclass(frozen=True)
class TokenizerInfo:
    json: str          # the tokenizer.json's text: what the tasks build their tokenizer from
    sha256: str        # of that file
    vocab_size: int    # with added tokens
    eod_id: int
    eod_token: str

    def manifest_entry(self) -> dict:
        return {"sha256": self.sha256, "vocab_size": self.vocab_size, "eod_id": self.eod_id,
                "eod_token": self.eod_token}


def _config_eos(tok_path) -> str | None:
    cfg = tok_path.parent / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    try:
        eos = json.loads(cfg.read_text()).get("eos_token")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{cfg}: not a tokenizer config ({e})") from None
    return eos.get("content") if isinstance(eos, dict) else eos


def resolve(spec: str, eod: str | None = None) -> TokenizerInfo:
    """The tokenizer of `spec` (a tokenizer.json or a directory holding one) and its end-of-document token;
    ValueError naming what is missing."""
    path = tokens.tokenizer_file(spec, "--tokenizer")
    tok = tokens.load(spec, "--tokenizer")
    if eod is not None:
        where = "--eod"
    else:
        eod = _config_eos(path)
        where = f"{path.parent / 'tokenizer_config.json'} (eos_token)"
        if eod is None:
            eod = next((t for t in KNOWN_EOD if tok.token_to_id(t) is not None), None)
            where = path
    if eod is None:
        raise ValueError(f"--tokenizer: {path} has no end-of-document token raytp knows "
                         f"({', '.join(KNOWN_EOD)}) and no tokenizer_config.json naming one; pass --eod TOKEN")
    eod_id = tok.token_to_id(eod)
    if eod_id is None:
        raise ValueError(f"{where}: end-of-document token {eod!r} is not in the vocabulary of {path}")
    data = path.read_bytes()
    return TokenizerInfo(data.decode("utf-8"), hashlib.sha256(data).hexdigest(),
                         tok.get_vocab_size(with_added_tokens=True), eod_id, eod)
