"""`hscap merge`: dumps to training-ready samples."""

from __future__ import annotations

import json
import os
from typing import List, Tuple

import click

from hs_capture.offline.formats import FORMATS, NAMES  # the registry imports no torch: `hscap` starts fast
from hs_capture.cli._common import JOBS_DEFAULT, JSON, QUIET, Progress, emit_json
from hs_capture.offline.workers.procs import default_jobs


def _shard(ctx, param, value: str) -> Tuple[int, int]:
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise click.BadParameter("expected i/N, e.g. 0/4") from None
    if not (n >= 1 and 0 <= i < n):
        raise click.BadParameter(f"{value}: need 0 <= i < N")
    return i, n


@click.command()
@click.argument("dumps", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--format", "fmt_name", required=True, type=click.Choice(NAMES),
              help="Training format: " + "; ".join(f"{n} ({FORMATS[n].what})" for n in NAMES) + ".")
@click.option("--dataset", type=click.Path(exists=True),
              help="The JSONL sent (or speculators' prepared dataset dir): loss masks joined by id, token ids "
                   "checked; only its ids are merged.")
@click.option("-j", "--jobs", default=default_jobs, show_default=JOBS_DEFAULT, type=click.IntRange(1, 256),
              help="Worker processes.")
@click.option("--shard", default="0/1", show_default=True, callback=_shard, help="Merge only rows with row % N == i.")
@click.option("--cache-mb", default=2048, show_default=True, type=click.IntRange(16),
              help="Decoded step data kept in memory (all workers together).")
@click.option("--overwrite", is_flag=True,
              help="Replace what an earlier merge wrote in OUT (any format); files merge did not write are never "
                   "touched and still refuse the directory.")
@QUIET
@JSON
def merge_cmd(dumps: List[str], out_dir: str, fmt_name: str, dataset: str, jobs: int, shard: Tuple[int, int],
              cache_mb: int, overwrite: bool, quiet: bool, as_json: bool) -> None:
    """Stitch every request in DUMPS (dump or run dirs, e.g. one per node) and write one
    file per complete sample. Incomplete samples are never written: they are listed, with
    the reason, in OUT/merge_report.json (a step file that is missing, cut short or fails its
    crc32 when decoded makes its samples incomplete). Re-running skips finished files; Ctrl-C
    keeps them. OUT must be new, empty or hold only this format's merge output, and never lies
    inside a dump."""
    progress = Progress(enabled=not (quiet or as_json))
    try:
        _merge(dumps, out_dir, fmt_name, dataset, jobs, shard, cache_mb, overwrite, quiet, as_json, progress)
    except KeyboardInterrupt:  # anywhere, imports included: what is written stays, whole
        progress.close()
        click.echo(f"hscap merge: interrupted: the files finished so far are kept in {out_dir} (each written whole); "
                   "the same command resumes", err=True)
        raise SystemExit(130) from None


def _merge(dumps: List[str], out_dir: str, fmt_name: str, dataset: str, jobs: int, shard: Tuple[int, int],
           cache_mb: int, overwrite: bool, quiet: bool, as_json: bool, progress: Progress) -> None:
    from hs_capture.offline.merge.merge import REPORT, SETTINGS, MergeError, MergeResult, merge
    from hs_capture.offline.read.reader import DumpError

    def on_progress(r: "MergeResult", total: int, force: bool = False) -> None:
        progress.update(f"merged {r.written + r.skipped_existing}/{total}  {r.tokens:,} tokens  "
                        f"{r.raw_bytes / 1e9:.2f} GB raw", force)

    try:
        res = merge(dumps, out_dir, fmt_name, dataset, jobs, shard, cache_mb << 20, on_progress, overwrite)
    except (MergeError, DumpError) as e:
        raise click.ClickException(str(e))
    # the last result may have come within the redraw interval: the line ends on the final count
    on_progress(res, res.written + res.skipped_existing, force=True)
    progress.close()
    summary = {"format": res.format, "shard": res.shard, "written": res.written,
               "skipped_existing": res.skipped_existing, "incomplete": len(res.incomplete),
               "recaptured": len(res.recaptured), "left_out": len(res.left_out),
               "unattributed": len(res.unattributed), "tokens": res.tokens,
               "bytes_in": res.bytes_in, "raw_bytes": res.raw_bytes, "bytes_out": res.bytes_out,
               "worker_peak_rss_mb": res.worker_peak_rss_bytes >> 20,
               "seconds": res.seconds, "loss_mask": res.loss_mask_source,
               "report": os.path.join(out_dir, REPORT), "settings": res.settings, "serving": res.serving,
               "warnings": res.warnings}
    if as_json:
        emit_json(summary)
        return
    if not quiet:
        if res.loss_mask_source != "dataset":
            click.echo("hscap merge: no --dataset: loss_mask is all ones", err=True)
        for rid, why in sorted(res.incomplete.items())[:20]:
            click.echo(f"hscap merge: skipped {rid!r}: {why}", err=True)
        if len(res.incomplete) > 20:
            click.echo(f"hscap merge: ... {len(res.incomplete) - 20} more in {summary['report']}", err=True)
        for rid, why in sorted(res.left_out.items()):
            click.echo(f"hscap merge: left out {rid!r}: {why}", err=True)
        if res.unattributed:
            click.echo(f"hscap merge: warning: {len(res.unattributed)} samples have ids SGLang generated (their "
                       f"client sent no rid), e.g. {res.unattributed[0]!r}: written, but no dataset id names them "
                       "(list in the report)", err=True)
        if res.recaptured:
            click.echo(f"hscap merge: warning: {len(res.recaptured)} samples were captured again in part (a retry or "
                       "a re-send); each was written from its whole capture (list in the report)", err=True)
    for warning in res.warnings:  # even with --quiet: the output would not train
        click.echo(f"hscap merge: warning: {warning}", err=True)
    if res.settings:
        served = res.serving
        click.echo(f"hscap merge: {res.format} settings for this capture, layer ids as {served['engine']} "
                   f"{served['releases']} serves the drafter (also in {SETTINGS}): "
                   + ", ".join(f"{k}={json.dumps(v)}" for k, v in res.settings.items()), err=True)
    click.echo(" ".join(f"{k}={v}" for k, v in summary.items() if k not in ("settings", "serving", "warnings")))
