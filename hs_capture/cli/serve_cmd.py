"""`hscap pythonpath` and `hscap serve`: start SGLang with the capture hook loaded."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from typing import List, Optional, Sequence, Tuple

import click

from hs_capture.server import config, release_source
from hs_capture.server.bootstrap import HOOK_DIR
from hs_capture.server.sglang_compat import PREFILL_GRAPH_FIELDS, prefill_graph_off_flags


# The flags capture needs, each for a reason (docs/capture.md "The flags hscap serve adds"):
# Prefill CUDA graphs would run the forward wrapper only at graph capture: captures vanish.
# Decode is never captured, so its graphs stay on. Which flag turns prefill graphs alone off
# depends on the release: asked of the server's own Python.
CAPTURE_FLAGS = (
    # A radix-cache prefix hit is never recomputed: that sample's capture would start past 0.
    # (--keep-radix-cache keeps it: each captured request then gets a namespace of its own.)
    "--disable-radix-cache",
    # The warmup request is not the user's data.
    "--skip-server-warmup",
)


@click.command()
def pythonpath() -> None:
    """Print the directory to put on PYTHONPATH to load the capture hook.

    \b
    PYTHONPATH=$(hscap pythonpath) HSCAP_DIR=/data/hs python -m sglang.launch_server ...
    """
    click.echo(HOOK_DIR)


_PROBE = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
          "from hs_capture.server.sglang_compat import prefill_off_flags_here; "
          "print(json.dumps(prefill_off_flags_here()))")


def graph_off_flags(python: str) -> List[str]:
    """The flags that keep prefill eager (and decode graphs on) in the sglang `python` runs:
    read from the release's field declarations, asked of the release itself where they do not
    say."""
    return graph_off_flags_declared(python) or graph_off_flags_asked(python)


def graph_off_flags_declared(python: str) -> Optional[List[str]]:
    """graph_off_flags from the release's source (no import), or None where it declares neither
    field they are decided by. (A release that moved the prefill field out of the files read
    but kept the piecewise one there would get the piecewise flag: the hook's own check at
    start would then refuse prefill graphs in one line, never lose captures.)"""
    package = release_source.package_dir(python)
    declared = release_source.declared_fields(package, PREFILL_GRAPH_FIELDS) if package else set()
    return prefill_graph_off_flags(declared) if declared else None


def graph_off_flags_asked(python: str) -> List[str]:
    """graph_off_flags from the release itself: imports its server arguments (seconds)."""
    package_parent = os.path.dirname(os.path.dirname(HOOK_DIR))
    try:
        out = subprocess.run([python, "-c", _PROBE, package_parent], capture_output=True, text=True, timeout=300,
                             env={k: v for k, v in os.environ.items() if not k.startswith("HSCAP_")})
        return list(json.loads(out.stdout.strip().splitlines()[-1]))
    except Exception:  # that python cannot tell: the flag every release has (the hook still checks)
        return ["--disable-cuda-graph"]


def build_command(dump_dir: str, sglang_args: Tuple[str, ...], python: str,
                  keep_radix_cache: bool = False) -> Tuple[list, dict]:
    env = dict(os.environ)
    env["HSCAP_DIR"] = os.path.abspath(dump_dir)
    env["PYTHONPATH"] = os.pathsep.join([HOOK_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    given = set(a.split("=", 1)[0] for a in sglang_args)
    capture = [f for f in CAPTURE_FLAGS if not (keep_radix_cache and f == "--disable-radix-cache")]
    flags = [f for f in (*graph_off_flags(python), *capture) if f not in given]
    return [python, "-m", "sglang.launch_server", *flags, *sglang_args], env


def flag_value(args: Sequence[str], name: str) -> Optional[str]:
    """The value of `name` in server flags (`--name X` or `--name=X`; the last one, as argparse
    reads it), or None."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a[len(name) + 1:]
    return value


def check_before_start(env: dict, sglang_args: Sequence[str]) -> None:
    """What the server would refuse at start, found before SGLang starts and without
    creating anything: the settings' syntax, the dump dir, and the layer set against a
    local checkpoint's config.json (a hub id is left to the server's own check).
    ConfigError on the first problem; nothing when HSCAP_DISABLE turns the hook off."""
    if not config.is_enabled(env):
        return
    # load() wants the run id the hook fixes at start; any name checks the rest
    cfg = config.load({**env, "HSCAP_RUN_ID": env.get("HSCAP_RUN_ID") or "check"})
    config.check_model_path(flag_value(sglang_args, "--model-path"))
    config.check_checkpoint_layers(env, flag_value(sglang_args, "--model-path"),
                                   flag_value(sglang_args, "--json-model-override-args"))
    # last: its probe file touches the dir's mtime, which a refused layer set leaves alone
    config.check_dump_dir(cfg.dump_dir, create=False)


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--dump-dir", "-d", required=True, type=click.Path(file_okay=False),
              help="Where the hidden states go (HSCAP_DIR).")
@click.option("--layers", help="HSCAP_LAYERS, e.g. 2,30,58 (entering-layer convention).")
@click.option("--prenorm", is_flag=True, help="Also capture the pre-norm final state (HSCAP_PRENORM=1), "
              "what speculators trains on.")
@click.option("--fraction", type=click.FloatRange(0.0, 1.0),
              help="Capture this fraction of requests, picked by a hash of their rid (HSCAP_CAPTURE_FRACTION; "
              "default all). Requests marked extra_key=hscap (hscap send marks its own) are always captured.")
@click.option("--keep-radix-cache", is_flag=True, help="Keep SGLang's radix (prefix) cache: each captured "
              "request gets a cache namespace of its own and is prefilled whole; the rest keep their prefix reuse.")
@click.option("--reuse-captured", is_flag=True, help="With the radix cache kept: captured requests share it, but "
              "reuse only prefixes that captured requests computed (HSCAP_REUSE_CAPTURED=1; merge joins them), "
              "instead of being prefilled whole. Implies --keep-radix-cache. SGLang 0.5.15 or later.")
@click.option("--follow", is_flag=True, help="Also capture every request that continues a captured prompt (the "
              "next turns of a captured conversation; HSCAP_FOLLOW=1). Implies --reuse-captured.")
@click.option("--store", type=click.Choice(config.STORES), help="How states are stored (HSCAP_STORE): lossless "
              "(the default) or fp8, the compact tier (FP8 e4m3, one scale per token, quantized on the GPU); "
              "readers hand both out as bfloat16.")
@click.option("--python", default=sys.executable, show_default=True, help="The server's Python.")
@click.option("--dry-run", is_flag=True, help="Print the command and exit.")
@click.argument("sglang_args", nargs=-1, type=click.UNPROCESSED)
def serve(dump_dir: str, layers: str, prenorm: bool, fraction: Optional[float], keep_radix_cache: bool,
          reuse_captured: bool, follow: bool, store: Optional[str], python: str, dry_run: bool, sglang_args: Tuple[str, ...]) -> None:
    """Start `python -m sglang.launch_server SGLANG_ARGS...` with capture on.

    Adds the flag that keeps prefill eager in this release (--disable-prefill-cuda-graph
    from 0.5.15, --disable-piecewise-cuda-graph in 0.5.10-0.5.14; decode CUDA graphs and
    the overlap scheduler stay on), --disable-radix-cache (unless --keep-radix-cache) and
    --skip-server-warmup (see docs/capture.md); every other flag is passed through.
    """
    settings = {"HSCAP_DIR": os.path.abspath(dump_dir)}
    if layers:
        settings["HSCAP_LAYERS"] = layers
    if prenorm:
        settings["HSCAP_PRENORM"] = "1"
    if fraction is not None:
        settings["HSCAP_CAPTURE_FRACTION"] = repr(fraction)
    if store:
        settings["HSCAP_STORE"] = store
    if reuse_captured or follow:
        keep_radix_cache = True
        settings["HSCAP_REUSE_CAPTURED"] = "1"
    if follow:
        settings["HSCAP_FOLLOW"] = "1"
    # before the release probe and SGLang: a refused start costs nothing and creates nothing
    try:
        check_before_start({**os.environ, **settings}, sglang_args)
    except config.ConfigError as e:
        raise SystemExit(f"hscap serve: {e}") from None
    cmd, env = build_command(dump_dir, sglang_args, python, keep_radix_cache)
    env.update(settings)
    if not config.prenorm(env):
        click.echo("hscap serve: the pre-norm final state is not captured; speculators trains on it "
                   "(merge --format speculators needs it): add --prenorm to capture it too", err=True)
    if dry_run:  # the settings the hook reads, then the command
        click.echo(" ".join([*(f"{k}={shlex.quote(v)}" for k, v in sorted(settings.items())), *map(shlex.quote, cmd)]))
        return
    os.execvpe(cmd[0], cmd, env)
