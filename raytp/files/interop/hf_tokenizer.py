"""The tokenizer files and special token ids a Hugging Face export ships, so that transformers'
AutoTokenizer, vLLM and lm-eval find what they look for.

Beside tokenizer.json an export holds tokenizer_config.json and
special_tokens_map.json (and the chat template: in tokenizer_config.json, or the
chat_template.jinja beside them, copied). What the user's directories say wins: those files,
where they sit beside the exported tokenizer.json (or in the model.init_from
directory, when it holds the same tokenizer.json), are copied as they are, and
the bos/eos/pad ids of the init_from directory's config.json are the model's
own. Only what none of them says is made: the special tokens are then found
among the tokenizer's own special tokens by the names common tokenizers give
them (a lone <|endoftext|> is both bos and eos, as in GPT-2), and
tokenizer_config.json is written as transformers 4 writes one
(PreTrainedTokenizerFast), which transformers 5 reads too.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")
CHAT_TEMPLATE = "chat_template.jinja"  # a conversation model's chat template (else in tokenizer_config.json)
NAMES = {  # role -> the names common tokenizers give it, the likeliest first
    "bos_token": ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>"),
    "eos_token": ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>"),
    "unk_token": ("<unk>", "<|unk|>", "[UNK]"),
    "pad_token": ("<pad>", "<|pad|>", "[PAD]"),
}
ADDED_TOKEN_FIELDS = {"content": "", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True}


def guess_special_tokens(tokenizer: dict) -> dict[str, str]:
    """role (bos_token, eos_token, unk_token, pad_token) -> token, for the roles a tokenizer.json's special
    tokens have a common name for (and its model's unk_token)."""
    specials = {t["content"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
    out = {role: next(n for n in names if n in specials) for role, names in NAMES.items() if specials & set(names)}
    unk = (tokenizer.get("model") or {}).get("unk_token")
    if unk and "unk_token" not in out:
        out["unk_token"] = unk
    return out


def declared_special_tokens(side: dict[str, dict]) -> dict[str, str]:
    """role -> token as side files (name -> parsed JSON) declare them: tokenizer_config.json's, then
    special_tokens_map.json's (a token is a string or an AddedToken's {"content": ...})."""
    out: dict[str, str] = {}
    for name in reversed(SIDE_FILES):
        d = side.get(name) or {}
        for role in NAMES:
            v = d.get(role)
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str):
                out[role] = v
    return out


def made_side_files(tokens: dict[str, str], tokenizer: dict, max_length: int) -> dict[str, dict]:
    """tokenizer_config.json and special_tokens_map.json for a tokenizer.json and its special tokens, as
    PreTrainedTokenizerFast.save_pretrained of transformers 4 writes them; `max_length`: the context the
    model was trained at."""
    added = {str(t["id"]): {k: t.get(k, d) for k, d in ADDED_TOKEN_FIELDS.items()}
             for t in tokenizer.get("added_tokens", [])}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokens, "model_max_length": max_length,
              "clean_up_tokenization_spaces": False, "added_tokens_decoder": added}
    return {"tokenizer_config.json": config, "special_tokens_map.json": dict(tokens)}


def tokenizer_files(tokenizer: Path, init_from: Path | None, max_length: int) -> tuple[dict[str, bytes], dict[str, str]]:
    """(file name -> bytes, role -> special token) of the tokenizer an export of `tokenizer` (a
    tokenizer.json) ships: tokenizer.json, and its side files copied from beside it (or from `init_from`
    if that holds the same tokenizer.json), each missing one made. ValueError naming a file that is not
    JSON."""
    text = Path(tokenizer).read_bytes()
    side: dict[str, bytes] = {}
    template = None  # the chat template transformers 5 writes beside them, copied as it is
    for src in (Path(tokenizer).parent, init_from):
        if src is not None and (src / "tokenizer.json").is_file() and (src / "tokenizer.json").read_bytes() == text:
            side = {n: (src / n).read_bytes() for n in SIDE_FILES if (src / n).is_file()}
            if (src / CHAT_TEMPLATE).is_file():
                template = (src / CHAT_TEMPLATE).read_bytes()
            if side or template is not None:
                break
    parsed = {n: _json(b, str(src / n)) for n, b in side.items()}
    tok = _json(text, str(tokenizer))
    tokens = declared_special_tokens(parsed) or guess_special_tokens(tok)
    made = made_side_files(tokens, tok, max_length)
    files = {"tokenizer.json": text}
    files.update({n: (json.dumps(made[n], indent=2) + "\n").encode() for n in SIDE_FILES if n not in side})
    files.update(side)
    if template is not None:
        files[CHAT_TEMPLATE] = template
    return files, tokens


def special_ids(tokens: dict[str, str], token_id: Callable[[str], int | None], init_config: dict | None) -> dict:
    """bos/eos/pad_token_id: the init_from directory's config.json's where it names them (the model's own;
    an eos may be a list), else the ids of the special tokens (`token_id`: the tokenizer's token_to_id)."""
    out = {}
    for role in ("bos", "eos", "pad"):
        key, token = f"{role}_token_id", tokens.get(f"{role}_token")
        if init_config and init_config.get(key) is not None:
            out[key] = init_config[key]
        elif token is not None and (i := token_id(token)) is not None:
            out[key] = i
    return out


def _json(data: bytes, where: str):
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
