"""Prefill throughput with capture on vs off across the rate at which states are produced.

The real SGLang (the bundle's 0.5.15) serving the Kimi-K2.5-shaped target of gpu/purpose.py
(hidden 1024; its weights do not change the speed: the MoE routing is fixed by the model's
biases), with purpose.py's server flags and SGLang's defaults (overlap scheduler, decode CUDA
graphs). Each server gets a warm-up, then two timed sends with `hscap send -c 64` of texts of
256-640 tokens: `a` (the in-flight budget fills) and `b` (the steady state, reported). The
state rate is set by what is captured: layers x 1024 x 2 bytes a token, plus the final state
and, with --prenorm, the pre-norm state. Servers alternate with plain ones in one run; each
`on` is compared with the mean of the plain servers just before and after it.

The `chat-*` servers take production-like traffic instead, at SGLang's defaults with the radix
(prefix) cache on: multi-turn conversations whose system prompt (1024 tokens, one of three) is
shared, each turn sent when the one before is answered, 64 conversations at a time, by a
client that marks nothing. `chat-off` is the plain server; `chat-5` and `chat-100` the hooked
one keeping the radix cache (`hscap serve --keep-radix-cache`) capturing 5% of requests (by rid
hash) and all of them; `chat-serve` is `hscap serve` as for a dataset (radix cache off). Each
is compared with the mean of the plain chat servers. `alt-chat` and `alt-chat-reuse` take both
sides from one hooked server, in rounds (CHAT_ROUNDS): `off` unmarked, `onN` N% of requests
marked, `cvN` the first turn of N% of the conversations marked; `alt-chat-reuse` shares the
radix cache with its captured requests (HSCAP_REUSE_CAPTURED=1) and captures the turns that
continue a captured one (HSCAP_FOLLOW=1).

The `alt-*` and `split-*` servers take both sides from one hooked server that captures only
the requests a client marks: the same texts are sent in rounds, unmarked (`off`) and marked
(`on`), each `on` round against the `off` rounds beside it, with a pause after each `on` round
for the writer to drain. Some rounds move the server's processes from outside (tune_writer):
`-idle` and `-cores` the writer process, `-split` SGLang's processes and the writer onto
separate physical cores. Two uncaptured rounds run a load beside the server instead, each
against the plain rounds beside it: `off-burn`, BURNERS processes (default 6) encoding bf16
states as the writer does, with no GPU; `off-d2h`, one process copying 80 MB from the GPU to
pinned host memory at D2H_GBPS (default 3). ROUNDS sets the rounds (default ALT_ROUNDS).

For each server the results hold the writer's closing counters (forward cost by cause, the CPU
time of capture's threads in the server's process, raw and written bytes), the host's busy cores
during the steady send, and the CPU seconds of each process of the server (scheduler, writer
process, ...). The dump of the `--verify` server is checked with `hscap verify --dataset
--reference` before it is removed. With PYSPY (a py-spy binary) and PROFILES (a folder) set,
the scheduler's threads are sampled during the first `on` and `off` rounds of each alternating
server (collapsed stacks, PROFILES/<log>-r<round>-<name>.txt).

`--shape k25` serves a slice of Kimi-K2.5 at its real widths instead (hidden 7168, 64 MLA heads,
8 experts a token of 2048, 8 layers, 16 routed experts; SGLang's dummy weights, so verify
checks whole samples without a reference): its ~8 k-token prefill steps are expected to be
bound by the GPU, as a K2.5 node's are (no GPU run of it is recorded yet), and each token carries
7x the small target's bytes of states. The small target's steps take ~20 ms and are bound by
SGLang's own Python processes.

usage: python benchmarks/gpu/rate_sweep.py --root DIR --out FILE [--servers NAME,...] [--texts N] [--shape small|k25]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
import zlib
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "lib"))
import language  # noqa: E402
from serving import HSCAP, SERVER_FLAGS, Server, free_port, hscap_json, plain_command, read_jsonl  # noqa: E402

HIDDEN = language.SIZES["gpu"]["hidden_size"]
# --shape k25 (the docstring): K2.5's widths, SLICE_LAYERS layers and SLICE_EXPERTS routed experts
# (a token's compute per layer is K2.5's; fewer experts only save memory)
K25_TEXT = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=64,
                num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                v_head_dim=128, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1)
SLICE_LAYERS, SLICE_EXPERTS = 8, 16
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "target_training.json", "text_model")
# name -> (layers or None for a plain server, prenorm, environment, dump on "shm" or "disk", load)
SERVERS: Dict[str, tuple] = {
    "off": (None, False, {}, "shm", "ab"),
    "pre3": ("2,3,5", True, {}, "shm", "ab"),  # 5 states: the server
    "pre3-thread": ("2,3,5", True, {"HSCAP_WRITER": "thread"}, "shm", "ab"),  # the writer in the scheduler's process
    "all5": ("1,2,3,4,5", False, {}, "shm", "ab"),  # 6 states
    "one": ("3", False, {}, "shm", "ab"),  # 2 states
    "pre5": ("1,2,3,4,5", True, {}, "shm", "ab"),  # 7 states
    "three": ("2,3,5", False, {}, "shm", "ab"),  # 4 states
    "pre3-thread-2": ("2,3,5", True, {"HSCAP_WRITER": "thread", "HSCAP_WRITER_THREADS": "2"}, "shm", "ab"),
    "pre3-raw": ("2,3,5", True, {"HSCAP_CODEC": "raw"}, "shm", "ab"),
    "pre3-disk": ("2,3,5", True, {}, "disk", "a"),
    # the writer process's place on the host, set from outside once the server is up (tune_writer)
    "pre3-idle": ("2,3,5", True, {"WRITER": "idle"}, "shm", "ab"),  # SCHED_IDLE: runs only on idle cores
    "pre3-cores": ("2,3,5", True, {"WRITER": "cores"}, "shm", "ab"),  # kept to the last half of the cores
    "pre3-t6": ("2,3,5", True, {"HSCAP_WRITER_THREADS": "6"}, "shm", "ab"),
    # production-like traffic, the radix cache on (see above)
    "chat-off": (None, False, {}, "shm", "chat"),
    "chat-5": ("2,3,5", True, {"HSCAP_CAPTURE_FRACTION": "0.05"}, "shm", "chat"),
    "chat-0": ("2,3,5", True, {"HSCAP_CAPTURE_FRACTION": "0"}, "shm", "chat"),  # hooked, nothing captured
    "chat-100": ("2,3,5", True, {}, "shm", "chat"),
    "chat-serve": ("2,3,5", True, {"RADIX": "off"}, "shm", "chat"),
    # one hooked server capturing only marked requests, its sends alternating unmarked (off) and
    # marked (on): no drift between servers lands on the ratio (see run_rounds)
    "alt-pre3": ("2,3,5", True, {"HSCAP_CAPTURE_FRACTION": "0"}, "shm", "alt"),
    "alt-three": ("2,3,5", False, {"HSCAP_CAPTURE_FRACTION": "0"}, "shm", "alt"),
    # the rate sweep of --shape k25 in one server each: 2 and 7 states a token beside alt-three's 4 and alt-pre3's 5
    "alt-one": ("3", False, {"HSCAP_CAPTURE_FRACTION": "0"}, "shm", "alt"),
    "alt-pre5": ("1,2,3,4,5", True, {"HSCAP_CAPTURE_FRACTION": "0"}, "shm", "alt"),
    "alt-pre3-t6": ("2,3,5", True, {"HSCAP_CAPTURE_FRACTION": "0", "HSCAP_WRITER_THREADS": "6"}, "shm", "alt"),
    "alt-pre3-raw": ("2,3,5", True, {"HSCAP_CAPTURE_FRACTION": "0", "HSCAP_CODEC": "raw"}, "shm", "alt"),
    "alt-pre3-t4": ("2,3,5", True, {"HSCAP_CAPTURE_FRACTION": "0", "HSCAP_WRITER_THREADS": "4"}, "shm", "alt"),
    "split-pre3": ("2,3,5", True, {"HSCAP_CAPTURE_FRACTION": "0"}, "shm", "split-alt"),
    "split-three": ("2,3,5", False, {"HSCAP_CAPTURE_FRACTION": "0"}, "shm", "split-alt"),
    # the forwards send each step whose copy is done: no hand-off thread waking per step
    "alt-pre3-fwd": ("2,3,5", True, {"HSCAP_CAPTURE_FRACTION": "0", "HSCAP_HANDOFF": "forward"}, "shm", "alt"),
    "alt-three-fwd": ("2,3,5", False, {"HSCAP_CAPTURE_FRACTION": "0", "HSCAP_HANDOFF": "forward"}, "shm", "alt"),
    "alt-pre3-disk": ("2,3,5", True, {"HSCAP_CAPTURE_FRACTION": "0"}, "disk", "alt"),
    "alt-chat": ("2,3,5", True, {"HSCAP_CAPTURE_FRACTION": "0"}, "shm", "chat-alt"),
    # captured requests share the radix cache, reusing what captured requests computed, and the
    # server captures the turns that continue a captured one (`hscap serve --follow`)
    "alt-chat-reuse": ("2,3,5", True, {"HSCAP_CAPTURE_FRACTION": "0", "HSCAP_REUSE_CAPTURED": "1",
                                       "HSCAP_FOLLOW": "1"}, "shm", "chat-alt"),
    # the compact tier (states_gbps counts them as bfloat16, the rate the server produces)
    "alt-pre3-fp8": ("2,3,5", True, {"HSCAP_CAPTURE_FRACTION": "0", "HSCAP_STORE": "fp8"}, "shm", "alt"),
}
# the rounds of an `alt` server: off = unmarked, on = marked; `on-idle`/`on-cores` move the
# writer (tune_writer) for that round only
ALT_ROUNDS = os.environ.get("ROUNDS") or "off,on,off,on-idle,off,on-cores,off,on,off"
ROUND_NAMES = ("off", "on", "on-idle", "on-cores", "off-split", "on-split", "off-burn", "off-d2h")
PLAIN_ROUNDS = ("off", "off-split")  # what the other rounds are judged against
MOVES = ("idle", "cores", "split")  # round-name suffixes that move the server's processes (tune_writer)
# `off-burn`: an uncaptured round while BURNERS processes encode bf16 states as the writer does
# (its default codec and level), on no GPU: what the writer's CPU and memory load alone costs the server.
# `off-d2h`: an uncaptured round while another process copies device memory to pinned host memory at
# D2H_GBPS in 80 MB copies (a step's states): what the copies alone cost the server
BURNERS = int(os.environ.get("BURNERS", "6"))
D2H_GBPS = float(os.environ.get("D2H_GBPS", "3"))
# the same, with the processes split across physical cores (tune_writer) in the -split rounds
SPLIT_ROUNDS = "off,on,off-split,on-split,off-split,on,off,on-split,off-split"
DRAIN_S = 3.0  # after an `on` round: the writer's backlog (~1 s of states at most) drains before the next round
# a chat server's rounds: onN marks N% of requests; cvN marks the first turn of N% of the
# conversations, whose later turns a following server captures on its own
CHAT_ALT_ROUNDS = os.environ.get("CHAT_ROUNDS") or "off,on5,off,on5,off,on100,off"
CHAT_CONVERSATIONS, CHAT_TURNS, CHAT_SYSTEM, CHAT_CONCURRENCY = 600, 4, 1024, 64
SALT_TOKEN = 7  # a chat round's first token is SALT_TOKEN + its index
DEFAULT = "off,pre3,pre3-thread,off,all5,one,pre5,off,three,pre3-thread-2,pre3-raw,pre3-disk,off"


def states_per_token(layers: Optional[str], prenorm: bool) -> int:
    return 0 if layers is None else len(layers.split(",")) + 1 + int(prenorm)


def stage(root: str, texts: int) -> None:
    model = os.path.join(root, "model")
    if not os.path.exists(os.path.join(model, "target_training.json")):
        language.train(model, 60, "gpu")  # a few steps: the speed does not depend on the weights
    data = os.path.join(root, "data")
    os.makedirs(data, exist_ok=True)
    g = language.Grammar(0)
    language.write_jsonl(os.path.join(data, "warm.jsonl"), g, "warm", 512, 256, 640, 7)
    language.write_jsonl(os.path.join(data, "a.jsonl"), g, "a", texts // 3, 256, 640, 8)
    language.write_jsonl(os.path.join(data, "b.jsonl"), g, "b", texts, 256, 640, 9)
    chat = os.path.join(data, "chat.json")
    if not os.path.exists(chat):
        rng = random.Random(10)
        systems = [g.text(rng, CHAT_SYSTEM) for _ in range(3)]
        convs = [{"system": rng.randrange(3), "messages": [g.text(rng, rng.randint(32, 256))
                                                           for _ in range(2 * CHAT_TURNS)]}
                 for _ in range(CHAT_CONVERSATIONS + CHAT_CONCURRENCY)]
        with open(chat + ".tmp", "w") as f:
            json.dump({"systems": systems, "conversations": convs}, f)
        os.replace(chat + ".tmp", chat)


def slice_model(src: str, dst: str) -> str:
    """DST: the small target's files (its processor, remote code) without its weights, with a
    config of K2.5's widths (K25_TEXT); the server makes up the weights (--load-format dummy)."""
    if os.path.exists(os.path.join(dst, "config.json")):
        return dst
    tmp = dst + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=lambda d, names: [n for n in names if d == src and n in WEIGHT_FILES])
    with open(os.path.join(tmp, "config.json")) as f:
        config = json.load(f)
    config["text_config"].update(K25_TEXT, num_hidden_layers=SLICE_LAYERS, n_routed_experts=SLICE_EXPERTS)
    config["vision_config"]["text_hidden_size"] = K25_TEXT["hidden_size"]
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    os.replace(tmp, dst)
    return dst


def marked(rid: str, fraction: float) -> bool:
    """The client's own pick of a fraction of requests (a stable hash of the rid)."""
    return fraction >= 1 or zlib.crc32(rid.encode()) % 10000 < fraction * 10000


def post(url: str, ids: List[int], rid: str, mark: bool) -> dict:
    body = {"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    if mark:
        body["extra_key"] = "hscap"
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read()).get("meta_info", {})


def run_pool(items: list, job, concurrency: int) -> float:
    """job(item) for every item, on `concurrency` threads; returns the wall time."""
    work: "queue.Queue" = queue.Queue()
    for x in items:
        work.put(x)

    def worker() -> None:
        while True:
            try:
                x = work.get_nowait()
            except queue.Empty:
                return
            job(x)

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - t0


def send_texts(url: str, path: str, tag: str, fraction: float, concurrency: int = 64) -> dict:
    """`hscap send`'s load (one new token per text, `concurrency` in flight) from a plain client,
    marking `fraction` of the texts for capture; rids are unique per round."""
    totals = {"requests": 0, "tokens": 0, "failed": 0, "marked": 0}
    lock = threading.Lock()

    def one(row: dict) -> None:
        rid = f"{tag}-{row['id']}"
        mark = marked(rid, fraction)
        try:
            post(url, row["input_ids"], rid, mark)
            with lock:
                totals["requests"] += 1
                totals["tokens"] += len(row["input_ids"])
                totals["marked"] += int(mark)
        except Exception:
            with lock:
                totals["failed"] += 1

    wall = run_pool(read_jsonl(path), one, concurrency)
    return {"tokens_per_s": round(totals["tokens"] / wall, 1), "wall_s": round(wall, 2), **totals}


def flush_cache(url: str) -> None:
    urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", data=b""), timeout=60).read()


def send_chat(url: str, data: str, warm: bool, fraction: float = 0.0, tag: str = "",
              conversations: bool = False, salt: int = 0) -> dict:
    """The chat traffic (the first CHAT_CONCURRENCY conversations are the warm-up): each turn's
    prompt is the system prompt and every message before it, sent once the turn before is
    answered; the client marks `fraction` of the requests for capture (by default none), or
    with `conversations` the first turn of `fraction` of the conversations. A `salt` token
    before every prompt makes a round's prompts its own: a following server must not take an
    uncaptured round's turns for continuations of an earlier round's captured ones."""
    with open(os.path.join(data, "chat.json")) as f:
        doc = json.load(f)
    convs = doc["conversations"][:CHAT_CONCURRENCY] if warm else doc["conversations"][CHAT_CONCURRENCY:]
    totals = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "failed": 0}
    lock = threading.Lock()

    def conversation(i: int) -> None:
        c = convs[i]
        prompt = ([salt] if salt else []) + list(doc["systems"][c["system"]])
        for t in range(CHAT_TURNS):
            prompt += c["messages"][2 * t]
            rid = f"chat{tag}-{'w' if warm else ''}{i}-{t}"
            try:
                mark = (t == 0 and marked(f"chat{tag}-{i}", fraction)) if conversations else marked(rid, fraction)
                meta = post(url, prompt, rid, mark)
                with lock:
                    totals["requests"] += 1
                    totals["prompt_tokens"] += len(prompt)
                    totals["cached_tokens"] += int(meta.get("cached_tokens") or 0)
            except Exception:
                with lock:
                    totals["failed"] += 1
            prompt += c["messages"][2 * t + 1]  # the assistant's answer, as the next turn sends it

    wall = run_pool(list(range(len(convs))), conversation, CHAT_CONCURRENCY)
    return {"tokens_per_s": round(totals["prompt_tokens"] / wall, 1), "requests_per_s": round(totals["requests"] / wall, 1),
            "computed_tokens_per_s": round((totals["prompt_tokens"] - totals["cached_tokens"]) / wall, 1),
            "wall_s": round(wall, 2), **totals}


class CoreMeter:
    """The host's busy cores over an interval, from /proc/stat."""

    @staticmethod
    def _read():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait

    def __enter__(self):
        self.t0, self.i0 = self._read()
        return self

    def __exit__(self, *exc):
        t1, i1 = self._read()
        busy = (t1 - self.t0) - (i1 - self.i0)
        self.busy_cores = round(busy / max(1, t1 - self.t0) * (os.cpu_count() or 1), 2)


class ThreadMeter:
    """CPU seconds over an interval of every thread of the server's processes, summed by
    process and thread name (`main`: a process's first thread; capture names its own threads
    hscap-*), from /proc: where a captured round's extra CPU goes."""

    def __init__(self, pgid: int) -> None:
        self.pgid = pgid

    def _read(self) -> Dict[str, float]:
        tick = os.sysconf("SC_CLK_TCK")
        out: Dict[str, float] = {}
        for pid, name, _ in group_processes(self.pgid):
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        stat = f.read()
                except OSError:
                    continue
                fields = stat[stat.rindex(")") + 2:].split()
                thread = "main" if int(tid) == pid else stat[stat.index("(") + 1:stat.rindex(")")]
                key = f"{name}/{thread}"
                out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        return out

    def __enter__(self):
        self.t0 = self._read()
        return self

    def __exit__(self, *exc):
        t1 = self._read()
        delta = {k: round(v - self.t0.get(k, 0.0), 2) for k, v in t1.items()}
        self.cpu_s = {k: v for k, v in sorted(delta.items(), key=lambda kv: -kv[1]) if v >= 0.05}


def physical_cores() -> List[List[int]]:
    """The host's logical CPUs grouped by physical core (hyperthread siblings together)."""
    allowed, seen, out = set(os.sched_getaffinity(0)), set(), []
    for cpu in sorted(allowed):
        if cpu in seen:
            continue
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                text = f.read().strip()
            sib = set()
            for part in text.split(","):
                lo, _, hi = part.partition("-")
                sib.update(range(int(lo), int(hi or lo) + 1))
        except (OSError, ValueError):
            sib = {cpu}
        group = sorted(sib & allowed)
        seen.update(group)
        out.append(group)
    return out


def tune_writer(pgid: int, how: Optional[str]) -> Optional[dict]:
    """Move the server's processes from outside: `idle` (the writer SCHED_IDLE), `cores` (the
    writer on the last half of the logical CPUs), `split` (SGLang's processes on the first half
    of the PHYSICAL cores, hyperthread siblings included, the writer on the other half: no
    writer thread shares a core with the scheduler), or `reset` (everything back to the
    defaults). What a setting of the writer would do, tried before it is one."""
    if not how:
        return None
    cpus = sorted(os.sched_getaffinity(0))
    phys = physical_cores()
    first = sorted(c for g in phys[:len(phys) // 2] for c in g)
    last = sorted(c for g in phys[len(phys) // 2:] for c in g)
    moved = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                writer = b"writer_process" in f.read()
            if os.getpgid(int(pid)) != pgid or (not writer and how in ("idle", "cores")):
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                if how == "idle":
                    os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
                elif how == "cores":
                    os.sched_setaffinity(int(tid), cpus[len(cpus) // 2:])
                elif how == "split":
                    os.sched_setaffinity(int(tid), last if writer else first)
                else:  # back to the defaults
                    if writer:
                        os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
                    os.sched_setaffinity(int(tid), cpus)
                moved.append(int(tid))
        except (OSError, ValueError):
            continue
    return {"how": how, "threads": len(moved), "physical_cores": len(phys), "logical": len(cpus)}


def group_processes(pgid: int):
    """(pid, name, the stat fields after the name) of every process in process group `pgid`;
    the writer process is named hscap-writer."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) != pgid:
            continue
        name = "hscap-writer" if b"writer_process" in cmd else stat[stat.index("(") + 1:stat.rindex(")")]
        yield int(pid), name, fields


def process_cpu(pgid: int) -> Dict[str, float]:
    """CPU seconds of every process in the server's process group, by name (pid appended)."""
    tick = os.sysconf("SC_CLK_TCK")
    return {f"{name}:{pid}": round((int(fields[11]) + int(fields[12])) / tick, 2)
            for pid, name, fields in group_processes(pgid)}


def rank_meta(dump: str) -> List[dict]:
    out = []
    for run in sorted(os.listdir(dump)) if os.path.isdir(dump) else []:
        ranks = os.path.join(dump, run, "ranks")
        for name in sorted(os.listdir(ranks)) if os.path.isdir(ranks) else []:
            if name.endswith(".json"):
                with open(os.path.join(ranks, name)) as f:
                    out.append(json.load(f))
    return out


def run_server(name: str, a, work: str, data: str) -> dict:
    layers, prenorm, extra_env, where, load = SERVERS[name]
    port = free_port()
    flags = ["--model-path", a.model, *a.server_flags.split(), "--trust-remote-code", "--host", "127.0.0.1",
             "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSCAP_")}
    base = "/dev/shm/hscap-sweep" if where == "shm" else os.path.join(work, "disk")
    dump = os.path.join(base, f"dump-{name}")
    shutil.rmtree(dump, ignore_errors=True)
    chat = load == "chat"
    keep = ["--keep-radix-cache"] if load in ("chat", "chat-alt") and extra_env.get("RADIX") != "off" else []
    if layers is None:
        cmd = plain_command(os.path.join(work, "unused"), flags, env, keep)
    else:
        cmd = [*HSCAP, "serve", "-d", dump, "--layers", layers, *(["--prenorm"] if prenorm else []), *keep, "--", *flags]
        env.update({k: v for k, v in extra_env.items() if k.startswith("HSCAP_")})
    log_path = os.path.join(work, f"server-{name}-{port}.log")
    res: Dict[str, object] = {"server": name, "layers": layers, "prenorm": prenorm, "env": extra_env, "dump_on": where,
                              "bytes_per_token": states_per_token(layers, prenorm) * a.hidden * 2}
    srv = Server(cmd, env, log_path, port)
    captured: List[tuple] = []  # alternating loads: the (rid tag, part) of each marked send
    try:
        res["startup_s"] = round(srv.wait_healthy(), 1)
        res["writer_tuned"] = tune_writer(srv.proc.pid, extra_env.get("WRITER"))
        if load in ("alt", "split-alt", "chat-alt"):
            # the dump of a server not verified is emptied between rounds: at K2.5's widths three
            # rounds of states outgrow a /dev/shm as large as the host's memory
            res["rounds"] = run_rounds(srv, "chat-alt" if load == "chat-alt" else "alt", data, captured,
                                       split=load == "split-alt",
                                       prune=None if name == a.verify else lambda: remove_step_files(dump))
            res["tokens_per_s"] = None
            res["alt"] = summarize_rounds(res["rounds"])
            on = [r["tokens_per_s"] for r in res["rounds"] if r["round"] == "on"]
            res["states_gbps"] = None if load == "chat-alt" or not on else round(
                sum(on) / len(on) * res["bytes_per_token"] / 1e9, 3)
            load = ()
        elif chat:
            send_chat(srv.url, data, warm=True)
            with CoreMeter() as cores:
                res["chat"] = send_chat(srv.url, data, warm=False)
            res["chat"]["busy_cores"] = cores.busy_cores
            load = ()
        else:
            hscap_json("send", os.path.join(data, "warm.jsonl"), "--url", srv.url, "-c", "64")
        for part in load:
            with CoreMeter() as cores:
                s = hscap_json("send", os.path.join(data, f"{part}.jsonl"), "--url", srv.url, "-c", "64")
            res[part] = {"tokens_per_s": s.get("tokens_per_s"), "tokens": s.get("tokens"), "wall_s": s.get("wall_s"),
                         "failed": s.get("failed"), "busy_cores": cores.busy_cores}
        if "rounds" not in res:
            res["tokens_per_s"] = res["chat"]["tokens_per_s"] if chat else res[load[-1]]["tokens_per_s"]
            # chat: most prompt tokens come from the cache and only some requests are captured
            res["states_gbps"] = None if chat else round((res["tokens_per_s"] or 0) * res["bytes_per_token"] / 1e9, 3)
        res["cpu_s"] = process_cpu(srv.proc.pid)
    finally:
        res["stop_s"] = round(srv.stop(), 1)
        res["hs_dump_lines"] = [x[-600:] for x in srv.log().splitlines() if "[HS_DUMP]" in x][-8:]
        shutil.copy(log_path, os.path.join(a.logs, f"server-{name}.log"))
    metas = rank_meta(dump)
    if metas:
        m = metas[0]
        res["writer"] = {k: m["stats"].get(k) for k in ("writer", "writer_threads", "steps_written", "steps_written_raw",
                                                         "steps_dropped", "steps_failed", "raw_bytes", "file_bytes",
                                                         "forward_cost", "server_threads", "scheduler_cost", "cuda_allocator",
                                                         "forward_waited_s",
                                                         "held_by_budget_s", "held_by_pinned_s", "pinned_bytes",
                                                         "inflight_budget_bytes", "peak_inflight_bytes")}
        res["writer"]["status"], res["writer"]["disk_bound"] = m.get("status"), m.get("disk_bound")
    if SERVERS[name][4] == "chat-alt":
        counts = chat_captured(dump)
        for i, r in enumerate(res.get("rounds") or []):
            r.update(counts.get(f"r{i}", {"captured_requests": 0, "captured_tokens": 0, "joined": 0}))
    if layers is not None and a.verify == name:
        res["verify"] = verify(dump, a, work, data, None if SERVERS[name][4] == "chat-alt" else captured)
    shutil.rmtree(dump, ignore_errors=True)
    print(json.dumps({k: v for k, v in res.items() if k not in ("hs_dump_lines", "cpu_s")}), flush=True)
    return res


def scheduler_pid(pgid: int) -> Optional[int]:
    return next((pid for pid, name, _ in group_processes(pgid) if name.startswith("sglang::schedul")), None)


def profile(srv, name: str, seconds: float):
    """py-spy (the PYSPY setting: its binary) sampling the scheduler's threads for `seconds`, into
    PROFILES/NAME.txt (collapsed stacks); None where either setting is missing."""
    spy, out = os.environ.get("PYSPY"), os.environ.get("PROFILES")
    pid = scheduler_pid(srv.proc.pid)
    if not spy or not out or pid is None:
        return None

    os.makedirs(out, exist_ok=True)
    return subprocess.Popen([spy, "record", "-p", str(pid), "-r", "250", "-d", str(int(seconds)), "--threads", "--nonblocking",
                             "-f", "raw", "-o", os.path.join(out, f"{name}.txt")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def remove_step_files(dump: str) -> None:
    """The files of the steps committed so far (their index lines name them; a step still
    being written is left alone): what a round's states took. Index and metadata stay."""
    from hs_capture.offline.read.reader import open_runs

    for run in open_runs(dump, errors=[]) if os.path.isdir(dump) else []:
        for tag in run.ranks:
            for line in run.index(tag, strict=False):
                for f in line.files.values():
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(run.path, f.path))


def run_rounds(srv, load: str, data: str, captured: List[tuple], split: bool = False,
               prune=None) -> List[dict]:
    """The alternating sends of one hooked server that captures only marked requests: the same
    texts each round, unmarked (`off`: the hook runs, nothing is captured) or marked (`on`).
    Each marked send's (rid tag, data part) is appended to `captured`; `prune`, where given, is
    called after each marked round has drained."""
    rounds = []
    if load == "alt":
        send_texts(srv.url, os.path.join(data, "warm.jsonl"), "warm", 0.0)
        send_texts(srv.url, os.path.join(data, "warm.jsonl"), "warm-on", 1.0)
        captured.append(("warm-on", "warm"))
        for i, r in enumerate((SPLIT_ROUNDS if split else ALT_ROUNDS).split(",")):
            if i and rounds[-1]["round"].startswith("on"):
                time.sleep(DRAIN_S)
                if prune is not None:
                    prune()
            how = r.partition("-")[2] if r.partition("-")[2] in MOVES else None
            tuned = tune_writer(srv.proc.pid, how) if how else None
            load_cmds = round_load(r)
            with beside(load_cmds) as alive, CoreMeter() as cores, ThreadMeter(srv.proc.pid) as threads:
                spy = profile(srv, f"{os.path.basename(srv.log_path)}-r{i}-{r}", 4) if i in (1, 2) else None
                s = send_texts(srv.url, os.path.join(data, "b.jsonl"), f"r{i}", 1.0 if r.startswith("on") else 0.0)
            if r.startswith("on"):
                captured.append((f"r{i}", "b"))
            if how:
                tune_writer(srv.proc.pid, "reset")
            if spy is not None:
                spy.wait(30)
            rounds.append({"round": r, **s, "busy_cores": cores.busy_cores, "writer_tuned": tuned,
                           "thread_cpu_s": threads.cpu_s, **({"beside_alive": alive[0]} if load_cmds else {})})
            print(json.dumps(rounds[-1]), flush=True)
    else:
        send_chat(srv.url, data, warm=True, fraction=1.0, tag="w")
        for i, r in enumerate(CHAT_ALT_ROUNDS.split(",")):
            flush_cache(srv.url)  # every round starts from an empty prefix cache
            fraction = 0.0 if r == "off" else int(r[2:]) / 100
            with CoreMeter() as cores, ThreadMeter(srv.proc.pid) as threads:
                s = send_chat(srv.url, data, warm=False, fraction=fraction, tag=f"r{i}", conversations=r[:2] == "cv",
                              salt=SALT_TOKEN + i)
            rounds.append({"round": r, **s, "busy_cores": cores.busy_cores, "thread_cpu_s": threads.cpu_s})
            print(json.dumps(rounds[-1]), flush=True)
    return rounds


BURN = """
import sys, numpy as np
from hs_capture.dump import codec
rows = np.random.default_rng(int(sys.argv[1])).standard_normal((8192, 1024), dtype=np.float32)
raw = (rows.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # bf16: the float32's top half
while True:
    codec.encode(raw, "bytegroup", 1, 2, "bfloat16", 2048)
"""


D2H = """
import sys, time, torch
step, rate = 80 << 20, float(sys.argv[1]) * 1e9
src = torch.empty(step, dtype=torch.uint8, device="cuda")
dst = [torch.empty(step, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
stream, t0, n = torch.cuda.Stream(), time.monotonic(), 0
while True:
    with torch.cuda.stream(stream):
        dst[n % 4].copy_(src, non_blocking=True)
    stream.synchronize()
    n += 1
    time.sleep(max(0.0, t0 + n * step / rate - time.monotonic()))
"""


def round_load(r: str) -> list:
    """The commands run beside the server for round `r`: burners (`off-burn`), a copier (`off-d2h`)."""
    if r == "off-burn":
        return [[sys.executable, "-c", BURN, str(k)] for k in range(BURNERS)]
    return [[sys.executable, "-c", D2H, str(D2H_GBPS)]] if r == "off-d2h" else []


@contextlib.contextmanager
def beside(cmds: list):
    """The processes `cmds` running for the block (killed after it)."""
    procs: List[subprocess.Popen] = []
    alive: List[int] = []
    try:
        for c in cmds:
            procs.append(subprocess.Popen(c))
        time.sleep(4.0 if cmds else 0)  # numpy or torch imported, the buffers made
        yield alive
        alive.append(sum(p.poll() is None for p in procs))  # those that ran to the end
    finally:
        for p in procs:
            p.kill()
            p.wait()


def summarize_rounds(rounds: List[dict]) -> dict:
    """Each round but the plain `off` ones against the mean of the `off` rounds just before and
    after it that ran as it did (`on-split` against `off-split`; `on-idle`, `on-cores` and
    `off-burn` and `off-d2h` against `off`)."""
    out: Dict[str, list] = {}
    for i, r in enumerate(rounds):
        if r["round"] in PLAIN_ROUNDS or not r.get("tokens_per_s"):
            continue
        base = "off-split" if r["round"] == "on-split" else "off"
        offs = [o["tokens_per_s"] for o in rounds[max(0, i - 1):i + 2] if o["round"] == base and o.get("tokens_per_s")]
        if offs:
            out.setdefault(r["round"], []).append(round(r["tokens_per_s"] / (sum(offs) / len(offs)), 4))
    return {"on_over_off": out, "off_tokens_per_s": [round(r["tokens_per_s"]) for r in rounds if r["round"] in PLAIN_ROUNDS]}


def chat_captured(dump: str) -> Dict[str, dict]:
    """Per chat round (its rid tag, `r<i>`): the requests captured, the tokens prefilled for
    them, and how many of them joined a prefix from another capture (index lines only)."""
    out: Dict[str, dict] = {}
    for run in sorted(os.listdir(dump)) if os.path.isdir(dump) else []:
        index = os.path.join(dump, run, "index")
        for name in sorted(os.listdir(index)) if os.path.isdir(index) else []:
            for line in read_jsonl(os.path.join(index, name)):
                for s in line.get("seqs") or []:
                    rid = s.get("rid") or ""
                    if not rid.startswith("chat"):
                        continue
                    c = out.setdefault(rid[4:].split("-")[0], {"captured_requests": set(), "captured_tokens": 0,
                                                               "joined": 0})
                    c["captured_requests"].add(rid)
                    c["captured_tokens"] += int(s.get("len") or 0)
                    c["joined"] += bool(s.get("src"))
    return {tag: {**c, "captured_requests": len(c["captured_requests"])} for tag, c in out.items()}


def verify(dump: str, a, work: str, data: str, captured: Optional[List[tuple]]) -> dict:
    """`hscap verify --dataset --reference` of the dump against what was sent marked: `hscap
    send`'s parts under their own ids, or each alternating round's texts under its rids.
    captured None (chat traffic, whose turns are not listed): every captured request as far as
    it was captured, without --dataset."""
    dataset = []
    if captured is not None:
        sent = os.path.join(work, "sent.jsonl")
        with open(sent, "w") as f:
            for tag, part in captured or [(None, p) for p in ("warm", "a", "b")]:
                for row in read_jsonl(os.path.join(data, f"{part}.jsonl")):
                    f.write(json.dumps({**row, "id": f"{tag}-{row['id']}"} if tag else row) + "\n")
        dataset = ["--dataset", sent]
    t0 = time.monotonic()
    # dummy weights (--shape k25) have no checkpoint to compute a reference from: whole samples only
    reference = [] if a.shape == "k25" else ["--reference", os.path.join(a.model, "text_model"),
                                              "--reference-samples", "8", "--reference-device", "cuda"]
    doc = hscap_json("verify", dump, *dataset, "-j", "16", *reference, "--max-findings", "5")
    st = doc.get("stats", {})
    return {"ok": doc.get("ok"), "verify_s": round(time.monotonic() - t0, 1),
            "samples_complete": st.get("samples_complete"), "samples_incomplete": st.get("samples_incomplete"),
            "findings": [f.get("message", "")[:300] for f in doc.get("findings", [])][:6],
            "reference_states": st.get("reference_states")}


def summarize(res: dict) -> None:
    """Each `on` server against the plain servers of its kind just before and after it (one of
    them at the ends): a drift over the run does not land on the servers at one end."""
    servers = [s for s in res["servers"] if s.get("tokens_per_s")]
    plain = lambda s: s["server"] in ("off", "chat-off")  # noqa: E731
    kind = lambda s: s["server"].startswith("chat-")  # noqa: E731
    res["off_tokens_per_s"] = [round(s["tokens_per_s"]) for s in servers if s["server"] == "off"]
    res["summary"] = []
    for i, s in enumerate(servers):
        if plain(s):
            continue
        before = [o for o in servers[:i] if plain(o) and kind(o) == kind(s)][-1:]
        after = [o for o in servers[i + 1:] if plain(o) and kind(o) == kind(s)][:1]
        offs = [o["tokens_per_s"] for o in before + after]
        if not offs:
            continue
        res["summary"].append({"server": s["server"], "states_gbps": s.get("states_gbps"),
                               "on_over_off": round(s["tokens_per_s"] / (sum(offs) / len(offs)), 4),
                               "against": [round(x) for x in offs], "dump_on": s["dump_on"],
                               "writer": (s.get("writer") or {}).get("writer"),
                               "held_s": ((s.get("writer") or {}).get("forward_cost") or {}).get("held_s")})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--logs", help="where the server logs go (default: beside --out)")
    ap.add_argument("--servers", default=DEFAULT)
    ap.add_argument("--texts", type=int, default=4500, help="texts of the steady send (b); a has a third")
    ap.add_argument("--verify", default="pre3", help="the server whose dump verify checks")
    ap.add_argument("--stage-only", action="store_true")
    ap.add_argument("--shape", choices=("small", "k25"), default="small",
                    help="small: the trained target (hidden 1024); k25: a slice of Kimi-K2.5 at its widths, dummy weights")
    ap.add_argument("--server-flags", default=" ".join(SERVER_FLAGS + ["--cuda-graph-max-bs", "16"]))
    a = ap.parse_args()
    unknown = sorted(set(ALT_ROUNDS.split(",")) - set(ROUND_NAMES))
    if unknown:
        ap.error(f"ROUNDS: unknown round {', '.join(unknown)} (the rounds are {', '.join(ROUND_NAMES)})")
    bad = [r for r in CHAT_ALT_ROUNDS.split(",") if not re.fullmatch(r"off|(on|cv)\d+", r)]
    if bad:
        ap.error(f"CHAT_ROUNDS: unknown round {', '.join(bad)} (off, onN: N% of requests marked, cvN: the first "
                 "turn of N% of conversations marked)")
    if a.verify in SERVERS and SERVERS[a.verify][4] == "chat":
        ap.error(f"--verify {a.verify}: the chat traffic's requests are not listed for verify; name another server "
                 "(an alt-chat server's dump is verified without --dataset)")
    stage(a.root, a.texts)
    if a.stage_only:
        return
    a.model = os.path.join(a.root, "model")
    a.hidden = HIDDEN
    if a.shape == "k25":
        a.model = slice_model(a.model, os.path.join(a.root, "model-k25"))
        a.hidden = K25_TEXT["hidden_size"]
        a.server_flags += " --load-format dummy"
    a.logs = a.logs or os.path.dirname(os.path.abspath(a.out))
    work = os.path.join(a.root, "sweep")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    os.makedirs(a.logs, exist_ok=True)
    import torch

    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(0),
           "cpu_cores": os.cpu_count(), "servers": [], "texts": a.texts, "shape": a.shape, "hidden": a.hidden,
           "shm_bytes": shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else None,
           "note": __doc__.split("\n\n")[1]}
    for name in a.servers.split(","):
        try:
            r = run_server(name, a, work, os.path.join(a.root, "data"))
        except Exception as e:
            r = {"server": name, "error": f"{type(e).__name__}: {str(e)[-2000:]}"}
            print(r["error"], flush=True)
        res["servers"].append(r)
        summarize(res)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res.get("summary"), indent=1), flush=True)


if __name__ == "__main__":
    main()
