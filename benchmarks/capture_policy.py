"""The scheduler-thread time of `--reuse-captured --follow`'s index per request, on the chat
traffic of gpu/rate_sweep.py: 600 conversations of 4 turns, each prompt one of three 1,024-token
system prompts and every message before it (~1,600 tokens on average), 64 conversations at a
time. Each round's prompts start with a token of their own (as rate_sweep's rounds do), so a
round only follows conversations captured in it.

Rounds: `off` (nothing marked: every request is judged for following, none is captured) and
`cv5` (the first turn of 5% of the conversations marked, each followed turn by turn). Per
request, as the picker does it in SGLang's scheduler thread: a marked request's prompt is
digested and held (CapturedPrefixes.prompt, .add), any other is judged (.continuing) and, when
it continues a captured prompt, held. Three indexes side by side on the same requests: the
default, which first tests the one block of a request where it would part from a shared system
prompt against the blocks captured prompts have there, then takes the digests of a prefix a
recent request shared from that request's walk; the same without the one-block test; and one
that digests every request from its first token (the alternatives).

Then the index's memory once it holds as many captured prompts' ends as it keeps (MAX_ENDS,
prompts of a system prompt and 60-900 tokens more, each after an uncaptured request of the same
system prompt is judged), with the one-block test's records and without them (tracemalloc).

usage: python benchmarks/capture_policy.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from collections import deque
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

sys.path.insert(0, os.path.join(HERE, "gpu"))

from hs_capture.dump.capture_policy import rid_fraction  # noqa: E402
from hs_capture.server.captured_prefixes import CapturedPrefixes  # noqa: E402
from rate_sweep import CHAT_CONCURRENCY as CONCURRENCY, CHAT_CONVERSATIONS as CONVERSATIONS  # noqa: E402
from rate_sweep import CHAT_SYSTEM as SYSTEM, CHAT_TURNS as TURNS, SALT_TOKEN  # noqa: E402

GPU_REQUESTS_PER_S = 440  # rate_sweep's chat rounds on an H100 (rate_sweep.h100.results.json, run N)


def conversations(rng: random.Random) -> List[List[List[int]]]:
    """Each conversation's prompts, turn by turn (messages of 60-260 tokens)."""
    systems = [[rng.randrange(150_000) for _ in range(SYSTEM)] for _ in range(3)]
    out = []
    for _ in range(CONVERSATIONS):
        prompt, turns = list(rng.choice(systems)), []
        for _ in range(TURNS):
            prompt = prompt + [rng.randrange(150_000) for _ in range(rng.randrange(60, 260))]
            turns.append(prompt)
            prompt = prompt + [rng.randrange(150_000) for _ in range(rng.randrange(60, 260))]  # the answer
        out.append(turns)
    return out


def arrival_order(n: int) -> List[tuple]:
    """(conversation, turn) in the order a client with CONCURRENCY conversations in flight
    sends them: a conversation's next turn after its last, the next conversation when one ends."""
    order, active, nxt = [], deque(), 0
    while nxt < min(CONCURRENCY, n):
        active.append((nxt, 0))
        nxt += 1
    while active:
        i, t = active.popleft()
        order.append((i, t))
        if t + 1 < TURNS:
            active.append((i, t + 1))
        elif nxt < n:
            active.append((nxt, 0))
            nxt += 1
    return order


def run_round(idx: CapturedPrefixes, convs, order, salt: int, fraction: float, tag: str) -> Dict[str, float]:
    captured = 0
    prompts = [([salt] + convs[i][t], f"chat{tag}-{i}-{t}") for i, t in order]  # made outside the clock
    t0 = time.perf_counter()
    for (i, t), (tokens, rid) in zip(order, prompts):
        if t == 0 and fraction > 0 and rid_fraction(f"chat{tag}-{i}") < fraction:
            p = idx.prompt(tokens)
        else:
            p = idx.continuing(tokens)
        if p is not None:
            idx.add(p, rid)
            captured += 1
    wall = time.perf_counter() - t0
    us = wall / len(order) * 1e6
    return {"requests": len(order), "captured": captured, "us_per_request": round(us, 1),
            "scheduler_share_at_gpu_rate": round(us * GPU_REQUESTS_PER_S / 1e6, 4)}


def index_memory(block_test: bool) -> Dict[str, int]:
    """The index's memory, filled past the number of ends it keeps."""
    import tracemalloc

    from hs_capture.server.captured_prefixes import MAX_ENDS

    rng = random.Random(1)
    systems = [[rng.randrange(150_000) for _ in range(SYSTEM)] for _ in range(3)]
    def prompt() -> List[int]:
        return rng.choice(systems) + [rng.randrange(150_000) for _ in range(rng.randrange(60, 900))]

    prompts = [(prompt(), prompt()) for _ in range(MAX_ENDS + 4096)]  # (uncaptured, captured)
    tracemalloc.start()
    idx = CapturedPrefixes()
    if not block_test:
        idx._record_end = lambda *a: None
    for i, (other, p) in enumerate(prompts):
        idx.continuing(other)
        idx.add(idx.prompt(p), f"r{i}")
    mb = tracemalloc.get_traced_memory()[0] / 1e6
    tracemalloc.stop()
    return {"ends": len(idx._ends), "mb": round(mb)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "capture_policy.cpu2.results.json"))
    a = ap.parse_args()
    convs = conversations(random.Random(0))
    order = arrival_order(len(convs))
    rounds = ["off", "cv5", "off", "cv5", "off", "cv5", "off"]
    res: Dict[str, list] = {}
    for name in ("default", "no_block_test", "full_walk"):
        idx = CapturedPrefixes()
        if name != "default":
            idx._differs = lambda *a: False  # every request judged in full
        if name == "full_walk":
            idx._remember = lambda *a: None  # no walk is remembered: every request digested from its start
        res[name] = [dict(round=r, **run_round(idx, convs, order, SALT_TOKEN + k, 0.05 if r == "cv5" else 0.0, f"r{k}"))
                     for k, r in enumerate(rounds)]
        for x in res[name]:
            print(name, json.dumps(x), flush=True)
    mean = {n: {r: round(sum(x["us_per_request"] for x in v if x["round"] == r) / rounds.count(r), 1)
                for r in ("off", "cv5")} for n, v in res.items()}
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.machine(),
           "cpu_cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
           "traffic": f"{CONVERSATIONS} conversations x {TURNS} turns, {SYSTEM}-token system prompts (3), "
                      f"{CONCURRENCY} in flight", "rounds": res, "mean_us_per_request": mean,
           "full_walk_over_default_cv5": round(mean["full_walk"]["cv5"] / mean["default"]["cv5"], 2),
           "no_block_test_over_default_cv5": round(mean["no_block_test"]["cv5"] / mean["default"]["cv5"], 2),
           "note": "scheduler_share_at_gpu_rate: the share of one scheduler thread this would take at "
                   f"{GPU_REQUESTS_PER_S} requests/s, on this machine's core"}
    out["memory_at_bound"] = {"default": index_memory(True), "no_block_test": index_memory(False)}
    print(json.dumps({k: out[k] for k in ("mean_us_per_request", "full_walk_over_default_cv5",
                                          "no_block_test_over_default_cv5", "memory_at_bound")}))
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
