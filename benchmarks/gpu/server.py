"""The REAL SGLang on the GPU, with and without the hook: same flags, same load, one run.

Runs on the GPU machine: `bash benchmarks/gpu/device.sh stage`, then `bash benchmarks/gpu/device.sh
run --out FILE [options]` stages sglang 0.5.15 and the model and runs this script (the commands
and figures are in benchmarks/README.md). For each server in --servers:

  off       `python -m sglang.launch_server` with exactly the flags `hscap serve` adds, no hook
  on        `hscap serve -d DUMP -- ...`, the documented command: SGLang's defaults (overlap
            scheduler, decode CUDA graphs) plus what the launcher adds (prefill graphs off,
            radix cache off, no warmup request)
  unfixed   like `on`, with the staging fix taken out again (a second sitecustomize, chained
            by ours, makes the forward-stream clone a no-op): shows the race it fixes

each gets a warm-up load, then the timed prefill load through `hscap send -c C` (prompts of
512-2048 tokens, max_new_tokens 1) while S streams of decode traffic (64 new tokens each)
run beside it, so decode batches (CUDA-graph replays) interleave with the captured prefills.
A captured dump is then checked with `hscap verify --dataset ... --reference MODEL
--reference-device cuda` (every sample whole, token ids equal the dataset's; per state, the
capture vs transformers float32 and transformers' own bf16 vs float32 on the same weights).

usage: python benchmarks/gpu/server.py --root /root/hscap-gpu --out FILE [--servers off,on,off]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
import urllib.request
from typing import Dict, List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from serving import HSCAP, SERVER_FLAGS, Server, free_port, hscap_json, plain_command, read_jsonl  # noqa: E402

UNFIX = "import hs_capture.server.staging as s\ns.CudaSideStream.own = lambda self, t: t  # the code before the fix\n"


class DecodeTraffic:
    """S streams of generation requests (64 new tokens), each prompt used once."""

    def __init__(self, url: str, rows: List[dict], streams: int) -> None:
        self.url, self.rows, self.streams = url, list(rows), streams
        self.sent: List[str] = []
        self.errors = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(streams)]

    def _next(self) -> Optional[dict]:
        with self._lock:
            return self.rows.pop(0) if self.rows else None

    def _run(self) -> None:
        while not self._stop.is_set():
            row = self._next()
            if row is None:
                return
            body = json.dumps({"input_ids": row["input_ids"], "rid": row["id"],
                               "sampling_params": {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}})
            req = urllib.request.Request(self.url + "/generate", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=300) as r:
                    r.read()
                with self._lock:
                    self.sent.append(row["id"])
            except OSError:
                with self._lock:
                    self.errors += 1

    def __enter__(self) -> "DecodeTraffic":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(330)


def commands(model: str, dump: str, port: int, kind: str, work: str, server_flags: List[str] = SERVER_FLAGS):
    """(cmd, env) of the server `kind`: the documented commands."""
    flags = ["--model-path", model, *server_flags, "--host", "127.0.0.1", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSCAP_")}
    if kind == "off":
        return plain_command(dump, flags, env), env
    if kind == "unfixed":
        site = os.path.join(work, "unfixed-site")
        os.makedirs(site, exist_ok=True)
        with open(os.path.join(site, "sitecustomize.py"), "w") as f:
            f.write(UNFIX)
        env["PYTHONPATH"] = os.pathsep.join([site, env.get("PYTHONPATH", "")])  # ours goes first, then chains here
    return [*HSCAP, "serve", "-d", dump, "--", *flags], env


def run_server(kind: str, args, work: str, data: str, dump: str) -> dict:
    port = free_port()
    cmd, env = commands(args.model, dump, port, kind, work, args.server_flags.split())
    log_path = os.path.join(work, f"server-{kind}-{port}.log")
    srv = Server(cmd, env, log_path, port)
    res: Dict[str, object] = {"server": kind, "command": " ".join(cmd[:6]) + " ..."}
    try:
        res["startup_s"] = round(srv.wait_healthy(), 1)
        warm = os.path.join(data, "warm_on.jsonl" if kind != "off" else "warm_off.jsonl")
        failures = os.path.join(work, f"send-failures-{kind}.jsonl")
        hscap_json("send", warm, "--url", srv.url, "-c", str(args.concurrency), "--failures", failures)
        decode_rows = read_jsonl(os.path.join(data, "decode.jsonl"))
        with DecodeTraffic(srv.url, decode_rows, args.decode_streams) as dec:
            summary = hscap_json("send", os.path.join(data, "timed.jsonl"), "--url", srv.url,
                                 "-c", str(args.concurrency), "--failures", failures)
        res.update(timed=summary, decode_requests=len(dec.sent), decode_errors=dec.errors)
        res["tokens_per_s"] = summary.get("tokens_per_s")
        if kind != "off":
            with open(os.path.join(work, f"sent-{kind}.jsonl"), "w") as f:
                for path in (warm, os.path.join(data, "timed.jsonl")):
                    for row in read_jsonl(path):
                        f.write(json.dumps(row) + "\n")
                sent = set(dec.sent)
                for row in read_jsonl(os.path.join(data, "decode.jsonl")):
                    if row["id"] in sent:
                        f.write(json.dumps(row) + "\n")
    finally:
        res["stop_s"] = round(srv.stop(), 1)
        log = srv.log()
        res["hs_dump_lines"] = [x for x in log.splitlines() if "[HS_DUMP]" in x][:12]
        res["decode_graph_lines"] = [x[-160:] for x in log.splitlines() if "cuda graph" in x.lower()][:4]
        if args.out_dir:
            shutil.copy(log_path, os.path.join(args.out_dir, f"server-{kind}.log"))
    print(json.dumps({k: v for k, v in res.items() if k not in ("hs_dump_lines", "decode_graph_lines")}), flush=True)
    return res


def check_dump(kind: str, args, work: str, dump: str) -> dict:
    runs = sorted(os.listdir(dump))
    metas = []
    for run in runs:
        for name in os.listdir(os.path.join(dump, run, "ranks")):
            if name.endswith(".json"):
                with open(os.path.join(dump, run, "ranks", name)) as f:
                    metas.append(json.load(f))
    t0 = time.monotonic()
    doc = hscap_json("verify", dump, "--dataset", os.path.join(work, f"sent-{kind}.jsonl"), "-j", "16",
                     "--reference", args.model, "--reference-samples", str(args.reference_samples),
                     "--reference-device", args.reference_device, "--max-findings", "5")
    checks = {c["check"]: c for c in doc.get("checks", [])} if isinstance(doc.get("checks"), list) else doc.get("checks")
    failing: Dict[str, int] = {}
    for f in doc.get("findings", []):
        if f.get("severity", "error") == "error":
            failing[f["check"]] = failing.get(f["check"], 0) + 1
    st = doc.get("stats", {})
    return {
        "verify_ok": doc.get("ok"), "verify_s": round(time.monotonic() - t0, 1),
        "errors_by_check": failing, "first_errors": [f["message"][:200] for f in doc.get("findings", [])][:6],
        "samples_complete": st.get("samples_complete"), "samples_incomplete": st.get("samples_incomplete"),
        "steps": st.get("steps"), "fidelity": st.get("reference_states"),
        "reference_samples": st.get("reference_samples"),
        "writer": [m.get("stats") for m in metas], "server_modes": [m.get("server_modes") for m in metas],
        "checks": checks,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="where device.sh staged the model and datasets")
    ap.add_argument("--out", required=True, help="the results file")
    ap.add_argument("--out-dir", help="also copy server logs here")
    ap.add_argument("--servers", default="off,on,off")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--decode-streams", type=int, default=8)
    ap.add_argument("--reference-samples", type=int, default=8)
    ap.add_argument("--reference-device", default="cuda")
    ap.add_argument("--server-flags", default=" ".join(SERVER_FLAGS),
                    help="the flags every server gets (a CPU smoke run of this script passes the CPU ones)")
    args = ap.parse_args()
    args.model = os.path.join(args.root, "model")
    data = os.path.join(args.root, "data")
    work = os.path.join(args.root, "work")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    t0 = time.time()
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "servers": [], "dumps": {}}
    try:
        import torch

        results["device"] = torch.cuda.get_device_name(0)
        results["torch"] = torch.__version__
        import importlib.metadata as md

        results["sglang"] = md.version("sglang")
    except Exception as e:
        results["device"] = f"? ({e})"
    timed = read_jsonl(os.path.join(data, "timed.jsonl"))
    results["load"] = {"timed_prompts": len(timed), "timed_tokens": sum(len(r["input_ids"]) for r in timed),
                       "concurrency": args.concurrency, "decode_streams": args.decode_streams}
    for kind in args.servers.split(","):
        dump = os.path.join(work, f"dump-{kind}")
        try:
            res = run_server(kind, args, work, data, dump)
        except Exception as e:
            res = {"server": kind, "error": f"{type(e).__name__}: {str(e)[-3000:]}"}
            print(res["error"], flush=True)
        results["servers"].append(res)
        if kind != "off" and os.path.isdir(dump) and "error" not in res:
            results["dumps"][kind] = check_dump(kind, args, work, dump)
            print(json.dumps({k: v for k, v in results["dumps"][kind].items() if k != "checks"}), flush=True)
            shutil.rmtree(dump, ignore_errors=True)  # ~15 GB a dump: room on the disk for the next server
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    off = [s["tokens_per_s"] for s in results["servers"] if s["server"] == "off" and s.get("tokens_per_s")]
    on = [s["tokens_per_s"] for s in results["servers"] if s["server"] == "on" and s.get("tokens_per_s")]
    if off and on:
        results["on_over_off"] = round((sum(on) / len(on)) / (sum(off) / len(off)), 4)
    results["wall_s"] = round(time.time() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps({"on_over_off": results.get("on_over_off"), "wall_s": results["wall_s"]}), flush=True)


if __name__ == "__main__":
    main()
