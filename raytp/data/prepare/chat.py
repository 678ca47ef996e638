"""Conversations: a row's messages, rendered with the model's own chat template as transformers renders them,
tokenized, and which tokens are trained on.

A row is ``{"messages": [{"role": ..., "content": ...}, ...]}`` or ``{"prompt": ..., "completion": ...}``
(strings: one user turn and one assistant turn; or lists of messages, joined). The template is the tokenizer's
(``chat_template.jinja`` beside its tokenizer.json, as transformers 5 writes it, else tokenizer_config.json's
``chat_template``) or one the job names; it is rendered by transformers' own ``apply_chat_template`` on a
tokenizer built from the same tokenizer.json and special tokens, so the text, and the ids, are transformers'.

Trained on: each assistant turn's content and its end-of-turn token. Turn k's span is found without any
``{% generation %}`` block: the conversation up to the turn rendered with the generation prompt is a prefix
P of the whole rendering F, and the turn starts where P ends; the up-to-and-including rendering of the turn,
past P, ends with the template's end-of-turn token (its last special token), and the span ends with the
first such token in F from there. A token is trained on when its first character lies in a span.

A row that is not a conversation, has a role outside ROLES, no assistant turn, or that the template cannot
render (or renders with no end-of-turn) is not trained on: `encode` says why (BAD_REASONS), and the
manifest counts it.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ROLES = ("system", "user", "assistant", "tool", "developer")
BAD_REASONS = ("not_a_conversation", "unknown_role", "no_assistant_turn", "template_error")
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_TOKENIZERS: dict[str, object] = {}  # (tokenizer, template) sha -> transformers tokenizer, once per process


def find_template(tok_path: Path, named: str | None = None) -> tuple[str | None, str]:
    """(the chat template's text, where it came from): the file `named` (a job's or --chat-template), else
    ``chat_template.jinja`` beside the tokenizer, else tokenizer_config.json's ``chat_template``; (None, "")
    if none. ValueError naming a file that cannot be read."""
    if named:
        p = Path(named).expanduser()
        if not p.is_file():
            raise ValueError(f"--chat-template: {named}: no such file")
        return p.read_text(encoding="utf-8"), str(p)
    beside = tok_path.parent / "chat_template.jinja"
    if beside.is_file():
        return beside.read_text(encoding="utf-8"), str(beside)
    template = special_tokens(tok_path).get("chat_template")
    if isinstance(template, list):  # named templates: transformers' default is "default"
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return (template, f"{tok_path.parent / 'tokenizer_config.json'}") if isinstance(template, str) else (None, "")


def special_tokens(tok_path: Path) -> dict:
    """tokenizer_config.json's fields beside `tok_path` ({} without one); ValueError if it is not JSON."""
    cfg = tok_path.parent / "tokenizer_config.json"
    if not cfg.is_file():
        return {}
    try:
        d = json.loads(cfg.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg}: not JSON ({e})") from None
    return d if isinstance(d, dict) else {}


def chat_spec(tok_path: Path, template: str) -> dict:
    """What a task builds its renderer from: the template and the special tokens (strings)."""
    cfg = special_tokens(tok_path)
    special = {}
    for k in SPECIAL_KEYS:
        v = cfg.get(k)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            special[k] = v
    return {"template": template, "special": special}


def renderer(tok_json: str, key: str, spec: dict):
    """A transformers tokenizer of `tok_json` with the spec's special tokens and template (cached by `key`)."""
    if key not in _TOKENIZERS:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast
        _TOKENIZERS[key] = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok_json),
                                                   chat_template=spec["template"], **spec["special"])
    return _TOKENIZERS[key]


def messages_of(row: dict) -> list | str:
    """A row's messages, or the reason it has none (a BAD_REASONS entry)."""
    if "messages" in row:
        msgs = row["messages"]
    else:
        p, c = row.get("prompt"), row.get("completion")
        p = [{"role": "user", "content": p}] if isinstance(p, str) else p
        c = [{"role": "assistant", "content": c}] if isinstance(c, str) else c
        msgs = p + c if isinstance(p, list) and isinstance(c, list) else None
    if not isinstance(msgs, list) or not msgs:
        return "not_a_conversation"
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return "not_a_conversation"
        if m["role"] not in ROLES:
            return "unknown_role"
    if not any(m["role"] == "assistant" for m in msgs):
        return "no_assistant_turn"
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def _render(tok, msgs: list, gen: bool) -> str:
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


def spans(tok, msgs: list, specials: list[str]) -> tuple[str, list[tuple[int, int]]] | str:
    """The whole rendering and each assistant turn's trained character span [start, end); or a reason."""
    try:
        whole = _render(tok, msgs, False)
        out = []
        for k, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            prefix = _render(tok, msgs[:k], True) if k else ""
            turn = whole if k == len(msgs) - 1 else _render(tok, msgs[:k + 1], False)
            if not whole.startswith(prefix) or not turn.startswith(prefix):
                return "template_error"
            tail = turn[len(prefix):]
            eot = max(specials, key=lambda s: (tail.rfind(s), len(s)), default=None)
            if eot is None or tail.rfind(eot) < 0:
                return "template_error"
            end = whole.find(eot, len(prefix))
            if end < 0:
                return "template_error"
            out.append((len(prefix), end + len(eot)))
    except Exception:  # noqa: BLE001 - jinja raises many kinds (the template's raise_exception among them)
        return "template_error"
    return whole, out


def specials_of(tok) -> list[str]:
    """The special tokens' strings (an end of turn is one of them)."""
    added = tok.backend_tokenizer.get_added_tokens_decoder() if hasattr(tok, "backend_tokenizer") else {}
    return sorted({t.content for t in added.values() if t.special} | set(tok.all_special_tokens))


def encode(tok, rows: list[dict]) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[str]]:
    """The ids and trained-mask (uint8) of each good row, and the reasons of the bad ones."""
    specials = specials_of(tok)
    good, bad = [], []
    for row in rows:
        msgs = messages_of(row)
        r = msgs if isinstance(msgs, str) else spans(tok, msgs, specials)
        if isinstance(r, str):
            bad.append(r)
        else:
            good.append(r)
    if not good:
        return [], bad
    encs = tok.backend_tokenizer.encode_batch([w for w, _ in good], add_special_tokens=False)
    out = []
    for (_, sp), e in zip(good, encs):
        starts = np.array([o[0] for o in e.offsets], dtype=np.int64)
        mask = np.zeros(len(starts), dtype=np.uint8)
        for a, b in sp:
            mask[(starts >= a) & (starts < b)] = 1
        out.append((np.asarray(e.ids, dtype=np.int64), mask))
    return out, bad


def prompt_ids(tok, prompt: str) -> tuple[list[int], int | None]:
    """A user turn rendered with the generation prompt, as ids, and the end-of-turn id generation stops at
    (the last special token of an assistant turn the template renders; None if it renders none)."""
    msgs = [{"role": "user", "content": prompt}]
    text = _render(tok, msgs, True)
    r = spans(tok, msgs + [{"role": "assistant", "content": "ok"}], specials_of(tok))
    eot = None
    if not isinstance(r, str):
        whole, [(a, b)] = r
        eot = tok.convert_tokens_to_ids(next(s for s in specials_of(tok) if whole[:b].endswith(s)))
    return tok.backend_tokenizer.encode(text, add_special_tokens=False).ids, eot
