"""What the GPU benchmarks that serve the real SGLang share: the documented server commands, a
server process with its log, and `hscap ... --json`. Imported by gpu/server.py, gpu/rate_sweep.py
and gpu/purpose.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)
# Below Linux's ephemeral range: SGLang binds its own ports there, and adds offsets to ours
# (sglang 0.5.15 refuses a server port whose gRPC port, +10000, passes 65535).
from tests.sglang_cpu.harness import free_port, terminate  # noqa: E402,F401  (free_port: for the benchmarks)
HSCAP = [sys.executable, "-m", "hs_capture.cli"]
SERVER_FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
                "--skip-tokenizer-init", "--mem-fraction-static", "0.35", "--context-length", "4096"]


def read_jsonl(path: str) -> List[dict]:
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


class Server:
    def __init__(self, cmd: List[str], env: Dict[str, str], log_path: str, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_healthy(self, timeout: float = 600.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"not healthy in {timeout}s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 180.0) -> float:
        """SIGTERM (the hook flushes its queue), then the group if it lingers."""
        t0 = time.monotonic()
        terminate(self.proc, timeout)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(30)
        self._log.close()
        return time.monotonic() - t0

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")


def hscap_json(*args: str, env: Optional[Dict[str, str]] = None) -> dict:
    out = subprocess.run([*HSCAP, *args, "--json"], cwd=REPO, capture_output=True, text=True, env=env)
    try:
        return json.loads(out.stdout)
    except ValueError:
        raise RuntimeError(f"hscap {args[0]} exited {out.returncode}: {out.stdout[-2000:]} {out.stderr[-3000:]}")


def plain_command(dump: str, flags: List[str], env: Dict[str, str], serve_options: Sequence[str] = ()) -> List[str]:
    """What `hscap serve` runs, without the hook (its own dry run says what: the settings it
    would set, then the command)."""
    dry = subprocess.run([*HSCAP, "serve", "-d", dump, *serve_options, "--dry-run", "--", *flags], cwd=REPO, env=env,
                         capture_output=True, text=True, check=True)
    words = shlex.split(dry.stdout.strip().splitlines()[-1])
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words.pop(0)
    return words
