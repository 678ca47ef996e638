"""`raytp attach RUN`: follow a run that joined a cluster, from any machine that reaches it, to its end."""
from __future__ import annotations

import sys

import click

from raytp.cli.base import check_request, ended_line, fail, failed, main
from raytp.cli.cluster import ADDRESS_HELP, _cluster_errors, _head


@main.command()
@click.argument("run")
@click.option("--address", default=None, help=ADDRESS_HELP)
@_cluster_errors
def attach(run, address):
    """Follow RUN from now to its end: its progress and events as `raytp train` prints them, then its exit status.

    A run that joined a cluster (`raytp train --address`, `raytp submit`) is driven by its coordinator in the
    cluster and goes on when the process that started it is gone; its earlier output is in its run
    directory's driver.log. Ctrl-C leaves the run training (`raytp stop RUN` stops it); SIGTERM stops it at its
    next step boundary with a checkpoint, as for the client that started it."""
    from raytp.api import errors, follow
    check_request(run)
    _head(address).connect()
    with follow.sigterm_flag() as asked:  # after ray.init, which sets its own SIGTERM handler
        try:
            s = follow.attach(run, sys.stderr, asked)
        except follow.NotFollowable as e:
            fail(str(e), 1)
        except errors.Interrupted as e:
            click.echo(f"[raytp] {e}", err=True)
            sys.exit(e.exit_code)
        except errors.TrainError as e:
            if e.__cause__ is not None:
                failed(e.__cause__, e.exit_code)
            fail(str(e), e.exit_code)
    click.echo(ended_line(s["state"], s["steps"], s["seconds"], s["loss"], s["val_loss"], s["run_dir"]), err=True)
