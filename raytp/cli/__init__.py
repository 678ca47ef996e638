"""The `raytp` command line: `raytp train | submit | attach | status | logs | stop | scale | export | sample | prepare`.

raytp.cli.base holds the command group and what the commands share; raytp.cli.local the commands
that run on this machine (train, export, sample); raytp.cli.cluster those that reach a cluster's
runs (submit, status, logs, stop, scale); raytp.cli.attach `raytp attach` (following a run's coordinator); raytp.cli.prepare `raytp prepare` (a corpus tokenized over a cluster).
"""
from raytp.cli import attach, cluster, local, prepare  # noqa: F401 - they register their commands on main
from raytp.cli.base import main

__all__ = ["main"]
