"""`hscap send`: feed a JSONL dataset to a running server that has capture on."""

from __future__ import annotations

import json
import os
from typing import List, Optional

import click

from hs_capture.offline import send as sender
from hs_capture.offline.read.inputs import BadLine, InputSample, read_inputs
from hs_capture.cli._common import JOBS_DEFAULT, JSON, QUIET, Progress, emit_json
from hs_capture.offline.workers.procs import default_jobs


@click.command()
@click.argument("dataset", type=click.Path(exists=True))
@click.option("--url", default="http://127.0.0.1:30000", show_default=True, help="The SGLang server.")
@click.option("--concurrency", "-c", default=8, show_default=True, type=click.IntRange(1, 4096),
              help="Requests in flight (SGLang batches them into one forward).")
@click.option("--dump-dir", "-d", "dump_dirs", multiple=True, type=click.Path(file_okay=False),
              help="Resume: skip samples this dump already holds completely (repeatable), by merge's rule: "
                   "every piece captured, every step file there at the size its index line recorded.")
@click.option("--check-data", is_flag=True,
              help="Resume: also decode every step file of the dumps and check its crc32s, so the samples of a "
                   "corrupt file are sent again (reads the whole dump; without it a flipped bit is found by "
                   "merge and verify, not here).")
@click.option("-j", "--jobs", default=default_jobs, show_default=JOBS_DEFAULT, type=click.IntRange(1, 256),
              help="Worker processes for --check-data.")
@click.option("--retries", default=5, show_default=True, type=click.IntRange(0, 100),
              help="Retries on connection errors and HTTP 5xx, with exponential back-off.")
@click.option("--backoff", default=0.5, show_default=True, type=click.FloatRange(0), help="First back-off, seconds.")
@click.option("--timeout", default=600.0, show_default=True, type=click.FloatRange(1), help="Seconds per request.")
@click.option("--on-bad-line", type=click.Choice(["skip", "stop"]), default="skip", show_default=True,
              help="A malformed line is reported with its number, then skipped or stops the run.")
@click.option("--failures", "failures_path", default="hscap-send-failures.jsonl", show_default=True,
              type=click.Path(dir_okay=False), help="Where failed and malformed samples are listed (JSONL).")
@click.option("--dry-run", is_flag=True, help="Validate the dataset and count what would be sent; send nothing.")
@QUIET
@JSON
def send(dataset: str, url: str, concurrency: int, dump_dirs: List[str], check_data: bool, jobs: int, retries: int,
         backoff: float, timeout: float, on_bad_line: str, failures_path: str, dry_run: bool, quiet: bool,
         as_json: bool) -> None:
    """Send every sample of DATASET (JSONL: id, input_ids[, loss_mask]; or speculators'
    prepared dataset directory, row k sent as id "k") to the server's
    /generate with rid = id, one new token, temperature 0. Exit 0 only if every sample was
    sent or was already captured."""
    from hs_capture.offline.read.planning import Captured
    from hs_capture.offline.read.reader import DumpError

    if check_data and not dump_dirs:
        raise click.UsageError("--check-data checks the dumps --dump-dir names: give one")
    progress = Progress(enabled=not (quiet or as_json))
    damaged = None
    try:  # the rule merge and verify judge by: a sample whole in the dumps is not sent again
        have = Captured(dump_dirs, strict=False, allow_empty=True) if dump_dirs else None
        if check_data and have is not None:
            damaged = have.check_contents(jobs, lambda done, total: progress.update(
                f"checked {done}/{total} steps", force=done == total))
            progress.close()
            if damaged and not quiet and not as_json:
                steps = "1 step of the dumps does" if damaged == 1 else f"{damaged} steps of the dumps do"
                click.echo(f"hscap send: {steps} not decode to their crc32s: the samples they hold count as not "
                           "captured", err=True)
    except DumpError as e:
        raise click.ClickException(str(e))

    def skip(sample: InputSample) -> bool:
        return have is not None and have.judge(sample.id, len(sample.input_ids))[0] is not None

    failures: List[dict] = []

    def on_failure(entry: dict) -> None:
        failures.append(entry)
        if not quiet and not as_json:
            where = f"line {entry['line']}" + (f" (id {entry['id']!r})" if entry["id"] is not None else "")
            msg = entry["error"] if entry["error"].startswith("line ") else f"{where}: {entry['error']}"
            click.echo(f"hscap send: {msg}", err=True)

    def on_progress(stats: sender.SendStats) -> None:
        sps, tps = stats.rate()
        progress.update(f"sent {stats.sent}  failed {stats.failed}  {sps:.1f} samples/s  {tps:,.0f} tokens/s")

    try:
        stats = _send_all(dataset, url, concurrency, retries, timeout, backoff, skip, on_failure, on_progress,
                          on_bad_line, dry_run)
    except BadLine as e:  # the dataset as a whole cannot be read
        raise click.ClickException(str(e))
    progress.close()
    summary = {"sent" if not dry_run else "would_send": stats.sent, "tokens": stats.tokens,
               "skipped_already_captured": stats.skipped_captured, "bad_lines": stats.bad_lines}
    if not dry_run:  # a dry run sends nothing: no rates, and no failures file (the lines are printed)
        _write_failures(failures_path, failures)
        sps, tps = stats.rate()
        summary.update(failed=stats.failed, retries=stats.retries, samples_per_s=round(sps, 2),
                       tokens_per_s=round(tps, 1), failures_file=failures_path if failures else None)
    if damaged is not None:
        summary["damaged_steps"] = damaged
    summary["stopped_at_bad_line"] = stats.stopped
    if as_json:
        emit_json(summary)
    elif not quiet:
        click.echo(" ".join(f"{k}={v}" for k, v in summary.items() if v not in (None, False)))
    if stats.failed or stats.bad_lines:
        raise SystemExit(1)


def _send_all(dataset: str, url: str, concurrency: int, retries: int, timeout: float, backoff: float, skip, on_failure,
              on_progress, on_bad_line: str, dry_run: bool) -> "sender.SendStats":
    """Send (or, dry, count) every sample; BadLine when the dataset as a whole is unreadable."""
    if dry_run:
        stats = sender.SendStats()
        for n, sample, error in read_inputs(dataset):
            if error is not None:
                stats.bad_lines += 1
                on_failure({"id": error.id, "line": n, "error": str(error)})
                if on_bad_line == "stop":
                    stats.stopped = True
                    break
            elif skip(sample):
                stats.skipped_captured += 1
            else:
                stats.sent += 1
                stats.tokens += len(sample.input_ids)
    else:
        stats = sender.run(url, read_inputs(dataset), concurrency=concurrency, retries=retries,
                           timeout=timeout, backoff=backoff, skip=skip, on_failure=on_failure,
                           on_progress=on_progress, stop_on_bad_line=on_bad_line == "stop")
    return stats


def _write_failures(path: str, failures: List[dict]) -> Optional[str]:
    if not failures:
        if os.path.exists(path):
            os.remove(path)  # a stale list from an earlier run would mislead
        return None
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for entry in failures:
            f.write(json.dumps(entry) + "\n")
    os.replace(tmp, path)
    return path
