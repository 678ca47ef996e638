"""The `raytp` command group and what its commands share: loading a job, one-line errors.

A job file is loaded and checked before anything else happens: a bad file or
override exits with status 2 and one line per problem, before Ray starts.
"""
from __future__ import annotations

import sys
from pathlib import Path

import click

from raytp import config as config_mod

EXIT_BAD_CONFIG = 2


def keys_help() -> str:
    lines = ["\b", "Job file keys (section.key  type  default  help):"]
    for key, typ, default, help_ in config_mod.describe():
        lines.append(f"  {key:<30} {typ:<8} {default:<10} {help_}")
    return "\n".join(lines)


def load_job(job: str, sets: tuple[str, ...]) -> config_mod.JobConfig:
    try:
        return config_mod.load(job, sets)
    except config_mod.ConfigError as e:
        for line in e.problems:
            click.echo(f"error: {line}", err=True)
        sys.exit(EXIT_BAD_CONFIG)


def check_data(cfg: config_mod.JobConfig) -> None:
    src = cfg.data.source
    if src != "builtin" and not Path(src).expanduser().exists():
        click.echo(f"error: data.source: {src} does not exist; valid: 'builtin', a directory of text files, "
                   "or a .bin file of uint16 token ids", err=True)
        sys.exit(EXIT_BAD_CONFIG)


@click.group()
@click.version_option(package_name="raytp")
def main():
    """raytp: tensor-parallel GPT training on Ray that survives failures and rescales."""


def fail(msg: str, code: int = EXIT_BAD_CONFIG):
    for line in str(msg).splitlines():
        click.echo(f"error: {line}", err=True)
    sys.exit(code)
