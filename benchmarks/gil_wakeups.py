"""What a thread that wakes for each of the writer's messages costs a busy thread of the same
process that releases the interpreter lock at every torch call, as SGLang's scheduler does
(each kernel launch is a torch call that releases it).

A "scheduler" thread runs small in-place torch ops for --seconds and counts them. Another
process sends small pickled messages at RATE a second, as the writer process sends its
replies. They are read either by a thread of their own that blocks on the socket and wakes for
each (`thread`: how HSCAP_HANDOFF=thread hears the writer), or by the busy thread itself,
without waiting, every --poll-every ops (`inline`: HSCAP_HANDOFF=forward, where each forward
reads the replies that came). Each mode's rate is against runs with no messages at all,
interleaved with it (medians of --repeats); every figure of a run is measured in that run.

usage: python benchmarks/gil_wakeups.py [--rates 40,200] [--seconds 2] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import socket
import statistics
import sys
import threading
import time

REPLY = ("done", 1, {k: 1 for k in "abcdefghijklmnop"}, None, None)  # the size of the writer's reply


def feed(sock: socket.socket, rate: float, seconds: float) -> None:
    msg = pickle.dumps(REPLY)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sock.send(msg)
        time.sleep(1.0 / rate)
    sock.close()


def busy(seconds: float, poll=None, every: int = 0) -> float:
    """Small torch ops per second (each releases and retakes the interpreter lock)."""
    import torch

    a, b = torch.ones(16), torch.ones(16)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(100):
            a.add_(b)
        n += 100
        if poll is not None and n % every == 0:
            poll()
    return n / (time.perf_counter() - t0)


def one(mode: str, rate: float, seconds: float, every: int) -> float:
    if mode == "none":
        return busy(seconds)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = mp.get_context("fork").Process(target=feed, args=(theirs, rate, seconds + 0.5))
    proc.start()
    theirs.close()
    got = [0]
    try:
        if mode == "thread":
            def hear() -> None:
                while True:
                    data = ours.recv(4096)
                    if not data:
                        return
                    pickle.loads(data)
                    got[0] += 1

            threading.Thread(target=hear, daemon=True).start()
            time.sleep(0.2)
            return busy(seconds)

        def poll() -> None:
            while True:
                try:
                    data = ours.recv(4096, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return
                if not data:
                    return
                pickle.loads(data)
                got[0] += 1

        time.sleep(0.2)
        return busy(seconds, poll, every)
    finally:
        proc.join()
        ours.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="40,200", help="messages a second (a step's reply each)")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--poll-every", type=int, default=2000, help="inline: ops between reads (a forward's launches)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    rows = []
    for rate in [float(x) for x in a.rates.split(",")]:
        runs = {"none": [], "thread": [], "inline": []}
        for _ in range(a.repeats):
            for mode in runs:
                runs[mode].append(one(mode, rate, a.seconds, a.poll_every))
        base = statistics.median(runs["none"])
        row = {"messages_per_s": rate, "ops_per_s_none": round(base),
               "thread": round(statistics.median(runs["thread"]) / base, 3),
               "inline": round(statistics.median(runs["inline"]) / base, 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu_count": os.cpu_count(),
           "python": sys.version.split()[0], "torch": torch.__version__, "seconds": a.seconds,
           "repeats": a.repeats, "poll_every": a.poll_every, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
