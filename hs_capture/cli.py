"""`hscap`: the offline command line. Never imports sglang."""

from __future__ import annotations

import json
import os
import sys

import click

from . import __version__
from .reader import DumpError, open_runs

DUMP_DIR = click.argument("dump_dir", type=click.Path(exists=True, file_okay=False))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hscap")
def main() -> None:
    """Capture SGLang hidden states for EAGLE-3 drafter training."""


@main.command()
def pythonpath() -> None:
    """Print the directory to put on PYTHONPATH to load the capture hook.

    \b
    PYTHONPATH=$(hscap pythonpath) HSCAP_DIR=/data/hs python -m sglang.launch_server ...
    """
    click.echo(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sitecustomize"))


@main.command("ls")
@DUMP_DIR
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
def ls(dump_dir: str, as_json: bool) -> None:
    """List the runs in a dump dir: ranks, steps, tokens, status."""
    try:
        runs = open_runs(dump_dir)
        rows = []
        for run in runs:
            for tag, meta in run.ranks.items():
                lines = list(run.index(tag))
                rows.append({
                    "run": os.path.basename(run.path), "rank": tag, "status": meta.get("status"),
                    "layers": meta.get("layers"), "steps": sum(1 for x in lines if "files" in x),
                    "dropped": sum(1 for x in lines if "dropped" in x),
                    "tokens": sum(x.get("num_tokens", 0) for x in lines if "files" in x),
                    "model": meta.get("model_path"),
                })
    except (OSError, ValueError, KeyError, DumpError) as e:
        raise click.ClickException(f"{dump_dir}: cannot read the dump: {e}")
    if as_json:
        click.echo(json.dumps(rows))
        return
    if not rows:
        click.echo("no runs", err=True)
        sys.exit(1)
    for r in rows:
        click.echo(f"{r['run']}  {r['rank']}  {r['status']}  layers={r['layers']}  steps={r['steps']}  "
                   f"tokens={r['tokens']}  dropped={r['dropped']}  model={r['model']}")


if __name__ == "__main__":
    main()
