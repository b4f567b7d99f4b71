"""Options and output helpers shared by the hscap commands."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Optional

import click

from hs_capture.offline.workers.procs import default_jobs

DUMP_DIR = click.argument("dump_dir", type=click.Path(exists=True, file_okay=False))
JSON = click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
# -j of merge, verify and send --check-data: what the machine has, the same rule for each
JOBS_DEFAULT = f"one per core, at most one per 2 GiB of available memory: {default_jobs()} here"
QUIET = click.option("--quiet", "-q", is_flag=True, help="No progress, no warnings: the result only.")


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, sort_keys=True))


class Progress:
    """A one-line progress display on stderr: redrawn on a TTY, a line every 10 s otherwise."""

    def __init__(self, enabled: bool, total: Optional[int] = None) -> None:
        self.enabled = enabled
        self.total = total
        self.tty = sys.stderr.isatty()
        self._last = 0.0
        self._shown = ""

    def update(self, text: str, force: bool = False) -> None:
        if not self.enabled or text == self._shown:  # a forced final line already on screen: once
            return
        now = time.monotonic()
        if not force and now - self._last < (0.25 if self.tty else 10.0):
            return
        self._last, self._shown = now, text
        if self.tty:
            click.echo("\r\033[K" + text, err=True, nl=False)
        else:
            click.echo(text, err=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            click.echo("", err=True)
