"""A tokenizer's chat template and special tokens, read from the files beside its tokenizer.json: what
`raytp prepare` renders conversations with (raytp.data.prepare.chat), what an export ships and `raytp sample
--chat` renders with (raytp.files.interop.export)."""
from __future__ import annotations

import json
from pathlib import Path

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


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
