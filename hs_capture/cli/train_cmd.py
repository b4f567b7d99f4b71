"""`hscap train`: a trainer's own entry point, reading its offline data straight from a dump."""

from __future__ import annotations

import sys
from typing import Optional, Tuple

import click

from hs_capture.offline.trainers import NAMES, load


def _one_line(e: BaseException) -> str:
    """A DumpError's own line, also when a DataLoader worker re-raised it with its traceback."""
    lines = [x for x in str(e).strip().splitlines() if x.strip()]
    last = lines[-1] if lines else type(e).__name__
    return last.split("DumpError: ", 1)[-1]


@click.command()
@click.argument("trainer", type=click.Choice(NAMES))
@click.option("--dataset", type=click.Path(exists=True),
              help="The JSONL sent (or speculators' prepared dataset dir): loss masks joined by id, token ids "
                   "checked; only its ids are trained on.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def train_cmd(trainer: str, dataset: Optional[str], args: Tuple[str, ...]) -> None:
    """Run TRAINER's own training command on a dump: no merge pass, no second copy.

    Point the trainer's own offline-data argument at the dump dir (README, "Train straight from
    the dump"); everything after `--` is the trainer's own command line. Any other path goes to
    the trainer untouched."""
    from hs_capture.offline.reader import DumpError

    patch = load(trainer)
    problem = patch.check()
    if problem:
        raise click.ClickException(problem)
    patch.instrument(dataset)
    try:
        patch.main(list(args))
    except DumpError as e:
        click.echo(f"Error: {_one_line(e)}", err=True)
        sys.exit(1)
    finally:
        patch.uninstrument()
