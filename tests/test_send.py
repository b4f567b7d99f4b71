"""hscap send's own logic: dataset validation, retries with back-off, failures file, resume
bookkeeping. (Against the real server: tests/test_e2e.py.)"""

import http.server
import json
import threading

import pytest
from click.testing import CliRunner

from hs_capture.cli import main
from hs_capture.offline.read.coverage import Span, holes, whole_chain


class FlakyHandler(http.server.BaseHTTPRequestHandler):
    """503 for the first `fail` requests, then 200: a server restarting under load."""

    fail = 2
    seen = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FlakyHandler.seen.append(body)
        code = 503 if len(FlakyHandler.seen) <= FlakyHandler.fail else (400 if body["rid"] == "bad" else 200)
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b'{"ok": true}' if code == 200 else b'{"error": "busy"}')

    def log_message(self, *a):
        pass


@pytest.fixture
def flaky():
    FlakyHandler.seen = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FlakyHandler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def write(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def invoke(*args):
    return CliRunner().invoke(main, ["send", *args], catch_exceptions=False)


def test_5xx_is_retried_with_backoff_and_4xx_is_not(tmp_path, flaky):
    ds = write(tmp_path / "d.jsonl", [{"id": "a", "input_ids": [5, 6]}, {"id": "bad", "input_ids": [7]}])
    fails = tmp_path / "f.jsonl"
    res = invoke(ds, "--url", flaky, "-c", "1", "--backoff", "0.01", "--json", "--failures", str(fails))
    summary = json.loads(res.output)
    assert summary["sent"] == 1 and summary["failed"] == 1 and summary["retries"] == 2
    assert res.exit_code == 1
    (failure,) = [json.loads(x) for x in fails.read_text().splitlines()]
    assert failure["id"] == "bad" and failure["line"] == 2 and "HTTP 400" in failure["error"]
    sent = FlakyHandler.seen[-2:]
    assert {b["rid"] for b in sent} == {"a", "bad"}
    assert all(b["sampling_params"] == {"max_new_tokens": 1, "temperature": 0} for b in sent)


def test_connection_errors_give_up_after_the_retries(tmp_path):
    ds = write(tmp_path / "d.jsonl", [{"id": 1, "input_ids": [5]}])
    res = invoke(ds, "--url", "http://127.0.0.1:9", "--retries", "2", "--backoff", "0.01", "--json",
                 "--failures", str(tmp_path / "f.jsonl"))
    summary = json.loads(res.output)
    assert res.exit_code == 1 and summary["failed"] == 1 and summary["retries"] == 2
    assert "connection" in (tmp_path / "f.jsonl").read_text()


BAD = ["{not json", {"id": "", "input_ids": [1]}, {"id": "x", "input_ids": []}, {"id": "y", "input_ids": [1, -2]},
       {"id": "z", "input_ids": [1, 2], "loss_mask": [1]}, [1, 2], {"id": True, "input_ids": [1]}]


def test_malformed_lines_are_named_and_skipped(tmp_path, flaky):
    FlakyHandler.fail = 0
    try:
        ds = write(tmp_path / "d.jsonl", [{"id": "ok1", "input_ids": [1]}, *BAD, {"id": "ok1", "input_ids": [2]},
                                           {"id": "ok2", "input_ids": [3], "loss_mask": [0]}])
        res = CliRunner().invoke(main, ["send", ds, "--url", flaky, "--failures", str(tmp_path / "f.jsonl")])
    finally:
        FlakyHandler.fail = 2
    assert res.exit_code == 1 and "Traceback" not in res.output
    entries = [json.loads(x) for x in (tmp_path / "f.jsonl").read_text().splitlines()]
    assert [e["line"] for e in entries] == [2, 3, 4, 5, 6, 7, 8, 9]  # 9: the duplicate id
    # the id is recorded wherever the line had a readable one
    assert [e["id"] for e in entries] == [None, None, "x", "y", "z", None, None, "ok1"]
    assert "line 2: not JSON" in res.output and "line 9: duplicate id 'ok1'" in res.output
    assert sorted(b["rid"] for b in FlakyHandler.seen) == ["ok1", "ok2"]


def test_a_dry_run_sends_nothing_and_writes_no_failures_file(tmp_path, flaky):
    ds = write(tmp_path / "d.jsonl", [{"id": "a", "input_ids": [5, 6]}, "{not json"])
    fails = tmp_path / "f.jsonl"
    res = invoke(ds, "--url", flaky, "--dry-run", "--json", "--failures", str(fails))
    summary = json.loads(res.output)
    assert summary["would_send"] == 1 and summary["bad_lines"] == 1 and res.exit_code == 1
    assert "samples_per_s" not in summary and not fails.exists() and FlakyHandler.seen == []


def test_stop_on_bad_line_sends_nothing_after_it(tmp_path, flaky):
    ds = write(tmp_path / "d.jsonl", ["{not json", {"id": "later", "input_ids": [1]}])
    res = invoke(ds, "--url", flaky, "--on-bad-line", "stop", "--json", "--failures", str(tmp_path / "f.jsonl"))
    summary = json.loads(res.output)
    assert res.exit_code == 1 and summary["stopped_at_bad_line"] and FlakyHandler.seen == []


def test_the_completeness_rule():
    def sp(a, b, order=0):
        return Span(a, b, (order,))

    assert whole_chain([sp(0, 10)], 10).whole and whole_chain([sp(0, 11)], 10).whole
    assert not whole_chain([sp(3, 10)], 10).whole and not whole_chain([], 1).whole
    assert whole_chain([sp(3, 10)], 10).reason == "positions 0..2 missing (a prefix-cache hit?)"
    # captured whole, then its last token again (a re-send under the radix cache): whole, one extra
    j = whole_chain([sp(0, 10, 1), sp(9, 10, 5)], 10)
    assert j.whole and [(s.start, s.end) for s in j.chain] == [(0, 10)] and len(j.extras) == 1
    # split across two captures (runs): whole from both
    j = whole_chain([sp(0, 4, 1), sp(4, 10, 2)], 10)
    assert j.whole and len(j.chain) == 2 and not j.extras
    # two whole captures: the latest wins at every point
    j = whole_chain([sp(0, 5, 1), sp(5, 10, 1), sp(0, 10, 3)], 10)
    assert [s.order for s in j.chain] == [(3,)] and len(j.extras) == 2
    # covered, but only by pieces that never meet end to start
    j = whole_chain([sp(0, 6), sp(4, 10)], 10)
    assert not j.whole and "never line up" in j.reason
    assert holes([(0, 4), (6, 10)], 12) == [(4, 6), (10, 12)]
    assert holes([(2, 12)], 12) == [(0, 2)]
