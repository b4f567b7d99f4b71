"""`hscap`: the command line, one module per command. Only `doctor` (and `serve`'s probe, in
the server's own Python) imports sglang, lazily; the offline commands never do."""

from __future__ import annotations

import click

from hs_capture import __version__
from hs_capture.cli.doctor_cmd import doctor
from hs_capture.cli.ls_cmd import ls
from hs_capture.cli.merge_cmd import merge_cmd
from hs_capture.cli.send_cmd import send
from hs_capture.cli.verify_cmd import verify_cmd
from hs_capture.cli.serve_cmd import pythonpath, serve
from hs_capture.cli.train_cmd import train_cmd


class _Hscap(click.Group):
    """Ctrl-C in any command: one line and exit 130 (click's own "Aborted!" exits 1). A command
    with more to say (merge: what it kept) says it itself."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo(f"hscap {ctx.invoked_subcommand or ''}".rstrip() + ": interrupted", err=True)
            raise SystemExit(130) from None


@click.group(cls=_Hscap, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hscap")
def main() -> None:
    """Capture SGLang hidden states for EAGLE-3 drafter training."""


for command in (pythonpath, serve, send, ls, doctor):
    main.add_command(command)
main.add_command(merge_cmd, name="merge")
main.add_command(verify_cmd, name="verify")
main.add_command(train_cmd, name="train")
