"""`hscap train`: a trainer's own entry point, reading its offline data straight from a dump."""

from __future__ import annotations

from typing import Optional, Tuple

import click

from hs_capture.offline.train.trainers import NAMES, load


@click.command()
@click.argument("trainer", type=click.Choice(NAMES))
@click.option("--dataset", type=click.Path(exists=True),
              help="The JSONL sent (or speculators' prepared dataset dir): loss masks joined by id, token ids "
                   "checked; only its ids are trained on.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def train_cmd(trainer: str, dataset: Optional[str], args: Tuple[str, ...]) -> None:
    """Run TRAINER's own training command on a dump: no merge pass, no second copy.

    Point the trainer's own offline-data argument at the dump dir (docs/training.md, "Train straight from
    the dump"); everything after `--` is the trainer's own command line. Any other path goes to
    the trainer untouched."""
    from hs_capture.offline.train.trainers.patching import run

    problem = run(load(trainer), dataset, list(args))
    if problem:
        raise click.ClickException(problem)
