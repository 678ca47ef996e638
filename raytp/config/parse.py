"""Reading a job: a YAML file (safe_load, aliases expanded under a budget: raytp.trust), `--set`
overrides on top, one validated JobConfig.

Precedence is override > file > default. All problems are collected and raised
together as one ConfigError, one line each, naming the file (or `--set`), the
dotted key and what would be valid.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any, Iterable, Optional

import yaml

from raytp.config.rules import check
from raytp.trust import Untrusted, load_yaml
from raytp.config.schema import LEAVES, SECTIONS, JobConfig
from raytp.config.values import ConfigError, IntList, at, literal, show, type_name, unwrap

# PyYAML follows YAML 1.1, where `3e-4` (no dot) is a string, not a float.
_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_ACCEPT = {  # base type -> (accepts a parsed YAML value?, what was expected)
    bool: (lambda x: isinstance(x, bool), "true or false"),
    int: (lambda x: isinstance(x, int) and not isinstance(x, bool), "an integer"),
    float: (lambda x: (isinstance(x, (int, float)) and not isinstance(x, bool))
            or (isinstance(x, str) and _FLOAT_RE.fullmatch(x.strip())), "a number"),
    str: (lambda x: isinstance(x, str), "a string"),
    IntList: (lambda x: isinstance(x, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in x),
              "a list of integers"),
}


def _coerce(value: Any, tp: Any, cli_text: Optional[str]) -> Any:
    """Type a parsed YAML value as `tp`; raises ValueError('expected ..., got ...')."""
    base, optional = unwrap(tp)
    if value is None and optional:
        return None
    if hasattr(base, "parse"):  # a mapping that checks itself (model.rope_scaling)
        return base.parse(value)
    accepts, expected = _ACCEPT[base]
    if accepts(value):
        return base(value)
    if base is str and cli_text is not None and isinstance(value, (int, float)):
        return cli_text  # `--set name=2024` means the string "2024"
    raise ValueError(f"expected {expected}{' or null' if optional else ''}, "
                     f"got {literal(value)}")


def _unknown(where: str, key: str) -> str:
    if key in SECTIONS:
        example = f"{key}.{dataclasses.fields(SECTIONS[key])[0].name}"
        return f"{at(where, key)}: is a section; set one of its keys, e.g. {example}"
    head = key.split(".")[0]
    sec, _, leaf = key.partition(".") if head in SECTIONS else ("", "", head)
    if sec in SECTIONS:
        valid, scope = [f.name for f in dataclasses.fields(SECTIONS[sec])], sec
    else:
        valid, scope = [f.name for f in dataclasses.fields(JobConfig)], "the job file"
    close = difflib.get_close_matches(leaf, valid, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"{at(where, key)}: unknown key{hint}; valid keys in {scope}: {', '.join(valid)}"


def describe() -> list[tuple[str, str, str, str]]:
    """(dotted key, type name, default, help) for every field, in order."""
    return [(key, type_name(tp), show(f.default), f.metadata["help"])
            for key, (tp, f) in LEAVES.items()]


def load(path: Any, overrides: Iterable[str] = ()) -> JobConfig:
    """Read a YAML job file, apply `--set` overrides, validate."""
    source = str(path)
    try:
        with open(path, encoding="utf-8") as fh:
            data = load_yaml(fh, source)
    except Untrusted as e:
        raise ConfigError([str(e)]) from None
    except UnicodeDecodeError as e:
        raise ConfigError([f"{source}: not UTF-8 text ({e.reason} at byte {e.start})"]) from None
    except OSError as e:
        raise ConfigError([f"{source}: cannot read: {e.strerror or e}"]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError([f"{source}{at}: invalid YAML: {what}"]) from None
    return from_dict(data, source=source, overrides=overrides)


def from_dict(d: Any, source: str = "<dict>",
              overrides: Iterable[str] = ()) -> JobConfig:
    """Build and validate a JobConfig from a nested dict plus `--set` overrides."""
    if not isinstance(d, (dict, type(None))):
        raise ConfigError([f"{source}: expected a mapping of sections, "
                           f"got {literal(d)}"])
    problems: list[str] = []
    given: dict[str, tuple[Any, str, Optional[str]]] = {}  # key -> (value, where, cli)
    for sec, body in (d or {}).items():
        if sec in SECTIONS and isinstance(body, dict):
            pairs = [(f"{sec}.{k}", v) for k, v in body.items()]
        elif sec in SECTIONS and body is not None:
            problems.append(f"{source}: {sec}: expected a mapping of keys, "
                            f"got {literal(body)}")
            continue
        else:
            pairs = [] if sec in SECTIONS else [(str(sec), body)]
        for key, v in pairs:
            if key in LEAVES:
                given[key] = (v, source, None)
            else:
                problems.append(_unknown(source, key))

    for item in overrides:  # applied in order, after the file: the last one wins
        key, eq, text = (s.strip() for s in str(item).partition("="))
        if not eq:
            problems.append(f"--set {item}: expected KEY=VALUE, e.g. parallel.tp=2")
        elif key not in LEAVES:
            problems.append(_unknown("--set", key))
        else:
            try:
                given[key] = (load_yaml(text, f"--set {key}"), "--set", text)
            except (yaml.YAMLError, Untrusted):
                problems.append(f"--set {key}: cannot parse value {text!r}")

    # A value of the wrong type keeps its default and is kept out of the
    # range and cross-field checks, so each mistake is reported once.
    typed: dict[str, Any] = {}
    bad: set[str] = set()
    for key, (value, where, cli_text) in given.items():
        try:
            typed[key] = _coerce(value, LEAVES[key][0], cli_text)
        except ValueError as e:
            problems.append(f"{at(where, key)}: {e}")
            bad.add(key)
    kwargs: dict[str, Any] = {k: v for k, v in typed.items() if "." not in k}
    for sec, cls in SECTIONS.items():
        kwargs[sec] = cls(**{k.partition(".")[2]: v for k, v in typed.items()
                             if k.startswith(sec + ".")})
    cfg = JobConfig(**kwargs)
    problems += check(cfg, lambda k: given[k][1] if k in given else source, bad, shape_known=False)
    if problems:
        raise ConfigError(problems)
    return cfg
