"""Serve a tiny random DeepSeek-V3 with the REAL SGLang on this CPU, started the way the
README documents (PYTHONPATH=hs_capture/sitecustomize python -m sglang.launch_server),
and compare with transformers. Used by the tests and by bin/demo.py."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Callable, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SHIMS = os.path.join(HERE, "shims")
HOOK_DIR = os.path.join("hs_capture", "sitecustomize")  # relative: the documented form
LAUNCHER = os.path.join(REPO, "bin", "hscap-serve")

# Flags this CPU needs (see README.md here). Capture itself needs none of them but the
# prefill-graph flags, added per release by graph_flags().
CPU_FLAGS = [
    "--device", "cpu", "--skip-tokenizer-init", "--attention-backend", "torch_native",
    "--grammar-backend", "none", "--sampling-backend", "pytorch",
    "--max-total-tokens", "8192", "--context-length", "4096", "--mem-fraction-static", "0.05",
    "--host", "127.0.0.1", "--log-level", "warning",
]


def make_tiny_deepseek(out: str, layers: int = 6, dtype: str = "float32", seed: int = 0,
                       fixed_routing: bool = False) -> str:
    """A random DeepSeek-V3 (MLA, MoE with noaux_tc routing) small enough for the CPU."""
    from tests.sglang_cpu.models import make_tiny

    return make_tiny("deepseek_v3", out, layers, dtype, seed, fixed_routing)


def free_port() -> int:
    """A free port BELOW Linux's ephemeral range (32768+), where SGLang's own internal
    ports (bound to port 0) are picked: they cannot take ours while the server starts."""
    import random

    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000..32000")


def _flag_value(args: Sequence[str], names: Sequence[str]) -> Optional[str]:
    """The value of the first of `names` in an argument list (`-d X` or `--dump-dir=X`)."""
    for i, a in enumerate(args):
        if a in names and i + 1 < len(args):
            return args[i + 1]
        for n in names:
            if n.startswith("--") and a.startswith(n + "="):
                return a[len(n) + 1:]
    return None


def server_env(dump_dir: Optional[str], hook: bool = True, **extra: str) -> Dict[str, str]:
    """hook=False leaves the hook off PYTHONPATH (for a launcher that adds it itself)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HSCAP_", "SGLANG_HS_"))}
    env.pop("SGLANG_USE_CPU_ENGINE", None)  # that path needs a CPU sgl_kernel no registry has
    env["PYTHONPATH"] = os.pathsep.join([HOOK_DIR, SHIMS] if hook else [SHIMS])
    env["TORCHDYNAMO_DISABLE"] = "1"  # the MoE top-k would be torch.compiled for ~12 s otherwise
    env["PYTHON"] = sys.executable  # the interpreter bin/hscap-serve runs hscap with
    if dump_dir is not None:
        env["HSCAP_DIR"] = dump_dir
    env.update(extra)
    return env


@functools.lru_cache(maxsize=None)
def graph_flags(python: str) -> tuple:
    """What `hscap serve` adds to keep prefill eager in that python's release (0.5.10 would
    otherwise build piecewise CUDA graphs, and fail on this CPU)."""
    from hs_capture.cli.serve_cmd import graph_off_flags

    return tuple(graph_off_flags(python))


@functools.lru_cache(maxsize=None)
def idle_flags(python: str) -> tuple:
    """`--sleep-on-idle` where that python's release has it. An idle scheduler otherwise polls
    without pause and keeps one of this machine's two cores busy, which the test's own send,
    verify or second server then lack (two idle servers made a 0.7 s send take 25 s). Read from
    the release's field declarations, as `hscap serve` reads its flags."""
    from hs_capture.server import release_source

    package = release_source.package_dir(python)
    return ("--sleep-on-idle",) if package and release_source.declared_fields(package, ["sleep_on_idle"]) else ()


def terminate(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, and up to `timeout` s for the process to exit (the hook flushes meanwhile)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


class Server:
    """One real `python -m sglang.launch_server`, in its own process group."""

    def __init__(self, model: str, env: Dict[str, str], log_path: str, extra_flags: Sequence[str] = (),
                 launcher: Optional[Sequence[str]] = None, python: Optional[str] = None, warmup: bool = True) -> None:
        """The documented command, or with `launcher` (e.g. bin/hscap-serve -d DUMP --) in front of
        the sglang flags instead of `python -m sglang.launch_server`. `python`: another venv's
        interpreter (another sglang release). warmup=False adds `--skip-server-warmup` (what `hscap
        serve` adds): SGLang's startup warmup, a second's wait for its own HTTP server and one
        request, ~2-4 s of each start here, for a test that neither reads the warmup's capture
        nor times the first requests."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        flags = ["--model-path", model, "--dtype", "float32", *CPU_FLAGS, *graph_flags(python or sys.executable),
                 *idle_flags(python or sys.executable), *(() if warmup else ("--skip-server-warmup",)),
                 "--port", "PORT", *extra_flags]
        self._cmd = [*launcher, *flags] if launcher else [python or sys.executable, "-m", "sglang.launch_server", *flags]
        # SGLang's ZMQ sockets are temp files it never removes: give them a dir removed at kill
        self._tmp = tempfile.mkdtemp(prefix="sglang-")
        self._env = {**env, "TMPDIR": self._tmp}
        self._log = open(log_path, "wb")
        self._dump_dir = env.get("HSCAP_DIR") or _flag_value(launcher or (), ("-d", "--dump-dir"))
        self._launch()

    def _launch(self) -> None:
        # what a restart must remove: a killed attempt's run would be a second run in the dump
        self._dump_before = set(os.listdir(self._dump_dir)) if self._dump_dir and os.path.isdir(self._dump_dir) else set()
        cmd = [str(self.port) if a == "PORT" else a for a in self._cmd]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=self._env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_healthy(self, timeout: float = 240.0, attempts: int = 3) -> None:
        """Wait for /health; a port taken meanwhile (the server then idles without HTTP)
        restarts it on another port."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            if attempts > 1 and f"('127.0.0.1', {self.port}): address already in use" in self.log():
                self._kill_group()
                self._remove_attempt_runs()
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"
                attempts -= 1
                self._launch()
                continue
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy in {timeout}s:\n{self.log()[-3000:]}")

    def _remove_attempt_runs(self) -> None:
        if self._dump_dir and os.path.isdir(self._dump_dir):
            for name in set(os.listdir(self._dump_dir)) - self._dump_before:
                shutil.rmtree(os.path.join(self._dump_dir, name), ignore_errors=True)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def generate(self, rid: str, input_ids: List[int], timeout: float = 300.0) -> dict:
        body = json.dumps({"input_ids": input_ids, "rid": rid,
                           "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode()
        req = urllib.request.Request(self.url + "/generate", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM to the launcher (what an orchestrator sends), then the group if it lingers."""
        terminate(self.proc, timeout)
        self.kill()
        return self.proc.returncode

    def _kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(30)

    def kill(self) -> None:
        self._kill_group()
        if not self._log.closed:
            self._log.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")


def hf_hidden_states(model_dir: str, input_ids: List[int], prenorm: bool = False):
    """transformers' float32 forward: hidden_states[i] enters layer i; the last is post-norm.
    With prenorm, also the final norm's input (returned as a second value)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.sglang_cpu.models import reference_dir

    if _HF.get(model_dir) is None:
        _HF[model_dir] = AutoModelForCausalLM.from_pretrained(reference_dir(model_dir), dtype=torch.float32).eval()
    hf = _HF[model_dir]
    seen = {}
    handle = hf.model.norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("pre", a[0][0].clone()))
    try:
        with torch.no_grad():
            out = hf(torch.tensor([input_ids]), output_hidden_states=True)
    finally:
        handle.remove()
    states = [h[0].numpy() for h in out.hidden_states]
    return (states, seen["pre"].numpy()) if prenorm else states


_HF: Dict[str, object] = {}


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def hscap_send(*args):
    """`hscap send --json ...` in a subprocess: (exit code, summary)."""
    out = subprocess.run([sys.executable, "-m", "hs_capture.cli", "send", "--json", *args], cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return out.returncode, json.loads(out.stdout)


def serve_and_send(model: str, env: Dict[str, str], root, flags: Sequence[str], data: str, rows: int,
                   concurrency: int = 4, times: int = 1, while_up: Optional[Callable[[], object]] = None,
                   warmup: bool = True) -> "Server":
    """Start the real server, send the dataset `times` times with `hscap send` (each send must
    send every row), stop it (SIGTERM: the hook flushes). Returns the stopped server (its log);
    `while_up`, called after the sends and before the stop, leaves its answer in
    srv.seen_while_up. warmup: as Server's."""
    srv = Server(model, env, os.path.join(str(root), "server.log"), flags, warmup=warmup)
    try:
        srv.wait_healthy()
        for k in range(times):
            rc, summary = hscap_send(data, "--url", srv.url, "-c", str(concurrency),
                                     "--failures", os.path.join(str(root), f"failures-{k}.jsonl"))
            assert rc == 0 and summary["sent"] == rows, summary
        srv.seen_while_up = while_up() if while_up is not None else None
    finally:
        srv.stop()
    return srv
