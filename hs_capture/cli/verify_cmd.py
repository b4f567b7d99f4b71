"""`hscap verify`: the gate between extraction and training."""

from __future__ import annotations

import sys
from typing import List, Optional

import click

from hs_capture.cli._common import JOBS_DEFAULT, JSON, QUIET, Progress, emit_json
from hs_capture.offline.workers.procs import default_jobs


def _layers(ctx, param, value: Optional[str]) -> Optional[List[int]]:
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter("expected comma-separated layer numbers, e.g. 2,30,58") from None


def _check_device(name: str) -> None:
    try:
        import torch

        dev = torch.device(name)
    except (ImportError, RuntimeError) as e:
        raise click.BadParameter(f"{name!r} is not a torch device ({e})", param_hint="--reference-device")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter(f"{name!r}: no CUDA device here", param_hint="--reference-device")


@click.command("verify")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--dataset", type=click.Path(exists=True),
              help="The JSONL sent: every id must be whole and its token ids must match.")
@click.option("--sample", type=click.IntRange(1), default=None,
              help="Decode only K random steps (dumps) or samples (merged); index checks still cover all.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of --sample and --reference picks.")
@click.option("-j", "--jobs", type=click.IntRange(1, 256), default=default_jobs, show_default=JOBS_DEFAULT,
              help="Worker processes for dump steps (threads for merged samples).")
@click.option("--reference", "reference", type=click.Path(exists=True, file_okay=False),
              help="Model dir: recompute samples with transformers (float32) and compare.")
@click.option("--reference-device", default="cpu", show_default=True,
              help="Where transformers recomputes them (cpu, cuda, cuda:1, ...).")
@click.option("--reference-samples", type=click.IntRange(1), default=4, show_default=True,
              help="How many random samples --reference recomputes.")
@click.option("--atol", type=float, default=None,
              help="--reference: a fixed absolute bound. Default: 1e-4 for float32 dumps; bf16/fp16 dumps are "
                   "held to transformers' own error in that dtype (docs/verify.md).")
@click.option("--rtol", type=float, default=None, help="--reference: a fixed relative bound (default 0 with --atol).")
@click.option("--layers", callback=_layers, help="Merged output without merge_report.json: its aux layers.")
@click.option("--max-findings", type=click.IntRange(1), default=20, show_default=True,
              help="Findings printed per check (--json lists all).")
@QUIET
@JSON
def verify_cmd(paths: List[str], dataset: Optional[str], sample: Optional[int], seed: int, jobs: int,
               reference: Optional[str], reference_device: str, reference_samples: int, atol: Optional[float],
               rtol: Optional[float],
               layers: Optional[List[int]], max_findings: int, quiet: bool, as_json: bool) -> None:
    """Prove dumps (or merged datasets) complete, intact and sane. PATHS: dump dirs, run
    dirs or `hscap merge` output dirs. Every step file of a dump is decoded and checked
    against its crc32s (--sample: K of them); a damaged step makes its samples not whole, by
    the rule send and merge use. Exit 0 only when every check passes."""
    from hs_capture.offline.read.inputs import BadLine, load_inputs  # the dataset exactly as merge reads it
    from hs_capture.offline.workers.heap import keep_large_buffers
    from hs_capture.offline.verify import verify

    keep_large_buffers()  # decoded steps reuse the heap instead of faulting fresh pages in

    ids, order = None, None
    if dataset:
        try:
            ds = load_inputs(dataset)
        except BadLine as e:
            raise click.ClickException(str(e))
        ids, order = ds.ids, ds.order
    if reference:
        _check_device(reference_device)
    bar = Progress(enabled=not (quiet or as_json))

    def on_progress(what: str, done: int, total: int) -> None:
        bar.update(f"verify {what}: {done}/{total} {'steps' if what == 'dump' else 'samples'}", force=done == total)

    try:
        report = verify(paths, ids, order, sample, jobs, seed, reference, reference_samples, atol, rtol, layers,
                        on_progress, reference_device)
    except OSError as e:
        raise click.ClickException(f"{e.filename or ''}: {e.strerror or e}")
    except ImportError as e:
        raise click.ClickException(f"--reference needs transformers: {e}")
    bar.close()
    if as_json:
        emit_json(report.to_json())
    elif not quiet:
        click.echo(report.render(max_findings))
    else:
        click.echo("PASS" if report.ok else "FAIL")
    sys.exit(0 if report.ok else 1)
