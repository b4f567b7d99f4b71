"""`hscap doctor`: what the hook will find and do in this environment."""

from __future__ import annotations

import sys
from typing import Tuple

import click

from hs_capture.cli._common import JSON, emit_json

_MARK = {"ok": "ok   ", "info": "info ", "warn": "WARN ", "block": "BLOCK"}


@click.command("doctor", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@JSON
@click.argument("sglang_args", nargs=-1, type=click.UNPROCESSED)
def doctor(as_json: bool, sglang_args: Tuple[str, ...]) -> None:
    """Check this environment before serving: the sglang version, the classes the hook
    patches, sitecustomize shadowing, the HSCAP_* settings, and (with the server's flags
    after --) the flags that would break or thin capture. Exit 1 on a blocking problem.

    \b
    hscap doctor -- --model-path /models/DeepSeek-V3 --tp 8
    """
    from hs_capture.server.doctor import BLOCK, as_dicts, diagnose  # imports sglang: only when asked

    findings = diagnose(list(sglang_args))
    blocked = any(f.status == BLOCK for f in findings)
    if as_json:
        emit_json({"ok": not blocked, "findings": as_dicts(findings)})
    else:
        for f in findings:
            click.echo(f"{_MARK[f.status]} {f.topic}: {f.detail}" + (f"\n      -> {f.action}" if f.action else ""))
        click.echo("BLOCKED: fix the BLOCK lines before serving" if blocked else "ready")
    sys.exit(1 if blocked else 0)
