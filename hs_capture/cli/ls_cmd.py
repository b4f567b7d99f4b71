"""`hscap ls`: the runs in a dump dir."""

from __future__ import annotations

import os
import sys

import click

from hs_capture.offline.read.reader import DumpError, open_runs
from hs_capture.cli._common import DUMP_DIR, JSON, emit_json


@click.command("ls")
@DUMP_DIR
@JSON
def ls(dump_dir: str, as_json: bool) -> None:
    """List the runs in a dump dir: ranks, steps, tokens, status."""
    try:
        rows = []
        for run in open_runs(dump_dir):
            for tag, meta in run.ranks.items():
                lines = list(run.index(tag))
                rows.append({
                    "run": os.path.basename(run.path), "rank": tag, "status": meta.status,
                    "layers": meta.layers, "steps": sum(1 for x in lines if x.written),
                    "dropped": sum(1 for x in lines if x.dropped is not None),
                    "tokens": sum(x.num_tokens for x in lines if x.written),
                    "model": meta.model_path,
                })
    except (OSError, ValueError, KeyError, DumpError) as e:
        raise click.ClickException(f"{dump_dir}: cannot read the dump: {e}")
    if as_json:
        emit_json(rows)
        return
    if not rows:
        click.echo("no runs", err=True)
        sys.exit(1)
    for r in rows:
        click.echo(f"{r['run']}  {r['rank']}  {r['status']}  layers={r['layers']}  steps={r['steps']}  "
                   f"tokens={r['tokens']}  dropped={r['dropped']}  model={r['model']}")
