"""Conversations: a row's messages, rendered with the model's own chat template as transformers renders them,
tokenized, and which tokens are trained on.

A row is ``{"messages": [{"role": ..., "content": ...}, ...]}`` or ``{"prompt": ..., "completion": ...}``
(strings: one user turn and one assistant turn; or lists of messages, joined). The template is the tokenizer's
(``chat_template.jinja`` beside its tokenizer.json, as transformers 5 writes it, else tokenizer_config.json's
``chat_template``) or one the job names; it is rendered by transformers' own ``apply_chat_template`` on a
tokenizer built from the same tokenizer.json and special tokens, so the text, and the ids, are transformers'.

Trained on: each assistant turn's content and its end-of-turn token. Turn k's span is found without any
``{% generation %}`` block: the conversation up to the turn rendered with the generation prompt is a prefix
P of the whole rendering F, and the turn starts where P ends; it ends with the first end-of-turn token in F
from there (the template's: the last special token an assistant turn renders with, past its generation
prompt). A token is trained on when its first character lies in a span. Conversations are rendered in
batches (transformers renders each alone), the prefixes of a batch in one call.

A row that is not a conversation, has a role outside ROLES, no assistant turn, or that the template cannot
render (or renders with no end-of-turn) is not trained on: `encode` says why (BAD_REASONS), and the
manifest counts it.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

ROLES = ("system", "user", "assistant", "tool", "developer")
BAD_REASONS = ("not_a_conversation", "unknown_role", "no_assistant_turn", "template_error")
_TOKENIZERS: dict[str, object] = {}  # (tokenizer, template) sha -> transformers tokenizer, once per process


def renderer(tok_json: str, spec: dict):
    """A transformers tokenizer of `tok_json` with the spec's special tokens and template (one per process)."""
    key = hashlib.sha256((tok_json + json.dumps(spec, sort_keys=True)).encode()).hexdigest()
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


def _render_all(tok, convs: list[list], gen: bool) -> list[str | None]:
    """Each conversation rendered (None where the template fails): one batched call, as transformers renders
    a batch (each conversation alone), or one call each when some conversation fails."""
    if not convs:
        return []
    try:
        return list(tok.apply_chat_template(convs, tokenize=False, add_generation_prompt=gen))
    except Exception:  # noqa: BLE001 - jinja raises many kinds (the template's raise_exception among them)
        out = []
        for c in convs:
            try:
                out.append(_render(tok, c, gen))
            except Exception:  # noqa: BLE001
                out.append(None)
        return out


_EOT: dict[int, str | None] = {}


def end_of_turn(tok) -> str | None:
    """The template's end of an assistant turn: the last special token an assistant turn renders with, past
    the generation prompt (None if the template renders none, or cannot render a turn)."""
    if id(tok) not in _EOT:
        user = [{"role": "user", "content": "x"}]
        try:
            prefix, turn = _render(tok, user, True), _render(tok, user + [{"role": "assistant", "content": "y"}], False)
        except Exception:  # noqa: BLE001
            prefix, turn = None, ""
        tail = turn[len(prefix):] if prefix is not None and turn.startswith(prefix) else ""
        found = [(tail.rfind(s), len(s), s) for s in specials_of(tok) if s in tail]
        _EOT[id(tok)] = max(found)[2] if found else None
    return _EOT[id(tok)]


def spans(whole: str, prefixes: list[str | None], eot: str | None) -> list[tuple[int, int]] | str:
    """Each assistant turn's trained character span [start, end) of the whole rendering, from the renderings
    up to each turn with the generation prompt; or the reason there is none (template_error)."""
    out = []
    for prefix in prefixes:
        if eot is None or prefix is None or not whole.startswith(prefix):
            return "template_error"
        end = whole.find(eot, len(prefix))
        if end < 0:
            return "template_error"
        out.append((len(prefix), end + len(eot)))
    return out


def specials_of(tok) -> list[str]:
    """The special tokens' strings (an end of turn is one of them)."""
    added = tok.backend_tokenizer.get_added_tokens_decoder() if hasattr(tok, "backend_tokenizer") else {}
    return sorted({t.content for t in added.values() if t.special} | set(tok.all_special_tokens))


def encode(tok, rows: list[dict]) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[str]]:
    """The ids and trained-mask (uint8) of each good row, and the reasons of the bad ones."""
    convs, bad = [], []
    for row in rows:
        msgs = messages_of(row)
        (bad if isinstance(msgs, str) else convs).append(msgs)
    turns = [[k for k, m in enumerate(c) if m["role"] == "assistant"] for c in convs]
    wholes = _render_all(tok, convs, False)
    asked = [c[:k] for c, ks in zip(convs, turns) for k in ks if k]  # a first-message turn: the prefix is ""
    done = iter(_render_all(tok, asked, True))
    eot, good = end_of_turn(tok), []
    for whole, ks in zip(wholes, turns):
        prefixes = [next(done) if k else "" for k in ks]
        sp = "template_error" if whole is None else spans(whole, prefixes, eot)
        if isinstance(sp, str):
            bad.append(sp)
        else:
            good.append((whole, sp))
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
    (None if the template renders none)."""
    text = _render(tok, [{"role": "user", "content": prompt}], True)
    eot = end_of_turn(tok)
    return (tok.backend_tokenizer.encode(text, add_special_tokens=False).ids,
            None if eot is None else tok.convert_tokens_to_ids(eot))
