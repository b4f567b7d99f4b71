"""The benchmark figures as pictures, drawn from the committed results files alone.

  capture_overhead.png  prefill throughput with capture on over off, by the rate states are produced
  bytes_per_token.png   bytes a token takes, raw and on disk, by what is captured; bytes a value by codec
  dataloader.png        GB/s of states through a torch DataLoader by workers, from the dump and merged
  drafters.png          held-out top-1 and simulated accept length of each drafter of gpu/purpose.py

Every figure is deterministic (the same results give the same bytes). A results file missing or
not of the shape its benchmark writes stops the script with one line naming it.

usage: python benchmarks/plots.py [--out DIR] [--root DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Dict, List, Tuple

# Every results file read, relative to --root: the one place to change when they are renamed.
RESULTS: Dict[str, Tuple[str, ...]] = {
    "rate_sweep": ("benchmarks/gpu/rate_sweep.h100.results.json",),
    "codec": ("benchmarks/codec.cpu2.results.json",),
    "dump_dataset": ("benchmarks/dump_dataset.cpu2.results.json", "benchmarks/dump_dataset.h200.results.json"),
    "purpose": ("benchmarks/gpu/purpose.h200.results.json",),
}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = "docs/img"

# purpose.py's drafters, in the order a reader compares them; any other is drawn after these
DRAFTERS = {"right": "right (merged)", "dump": "from the dump", "shifted": "shifted one token",
            "wrong": "wrong layers", "permuted": "layers reordered", "untrained": "untrained"}
WRITER_MARKERS = {"process": "o", "thread": "X", "one server": "D"}
WRITER_LABELS = {"process": "writer process", "thread": "writer threads", "one server": "one server, its rounds alternating"}


class ResultsError(Exception):
    """A results file missing or not of its benchmark's shape: said in one line."""


def load(root: str) -> Dict[str, List[Tuple[str, dict]]]:
    docs = {}
    for name, paths in RESULTS.items():
        docs[name] = []
        for rel in paths:
            try:
                with open(os.path.join(root, rel)) as f:
                    docs[name].append((rel, json.load(f)))
            except FileNotFoundError:
                raise ResultsError(f"{rel}: missing") from None
            except (ValueError, UnicodeDecodeError) as e:
                raise ResultsError(f"{rel}: not JSON ({e})") from None
    return docs


def _bar_labels(ax, bars, fmt: str) -> None:
    for b in bars:
        ax.annotate(fmt.format(b.get_width()), (b.get_width(), b.get_y() + b.get_height() / 2),
                    xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)


def capture_overhead(plt, docs):
    (_, sweep), = docs["rate_sweep"]
    rate, chat = [], []  # (run index, summary entry)
    for i, run in enumerate(sweep["runs"]):
        for s in run["summary"]:
            # chat servers' states_gbps is None: their prompts come mostly from the prefix cache
            (rate if isinstance(s["states_gbps"], (int, float)) else chat).append((i, s))
        for s in run["servers"]:
            # one server, its sends alternating uncaptured and captured: each captured round at
            # the default settings against the uncaptured rounds beside it
            on = ((s.get("alt") or {}).get("on_over_off") or {}).get("on")
            if on and isinstance(s.get("states_gbps"), (int, float)) and _default_settings(s):
                for x in on:
                    rate.append((i, {"server": s["server"], "states_gbps": s["states_gbps"], "on_over_off": x,
                                     "writer": "one server"}))
    fig, axes = plt.subplots(1, 2 if chat else 1, figsize=(10 if chat else 7.5, 4.2), squeeze=False,
                             gridspec_kw={"width_ratios": [2, 1]} if chat else None)
    ax = axes[0][0]
    colors = plt.get_cmap("tab10").colors
    named = set()
    for i, s in rate:
        ax.scatter(s["states_gbps"], s["on_over_off"], color=colors[i % 10], s=46, zorder=3,
                   marker=WRITER_MARKERS.get(s.get("writer"), "^"))
        if s.get("writer") != "one server" or (i, s["server"]) not in named:  # its rounds: named once
            named.add((i, s["server"]))
            ax.annotate(s["server"], (s["states_gbps"], s["on_over_off"]), xytext=(5, -3),
                        textcoords="offset points", fontsize=7)
    ax.axhline(1.0, color="0.5", lw=0.8, ls="--")
    ax.set_xlim(0, max([s["states_gbps"] for _, s in rate] + [1]) * 1.2)
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("states produced by the hooked server (GB/s)")
    ax.set_ylabel("prefill tokens/s, capture on / off")
    ax.set_title("Prefill throughput with capture on vs off", fontsize=10)
    handles = [plt.Line2D([], [], ls="", marker="s", color=colors[i % 10],
                          label=f"{run['date']}, {run['device'].replace('NVIDIA ', '')}")
               for i, run in enumerate(sweep["runs"]) if any(j == i for j, _ in rate + chat)]
    handles += [plt.Line2D([], [], ls="", marker=m, color="0.3", label=WRITER_LABELS[w])
                for w, m in WRITER_MARKERS.items() if any(s.get("writer") == w for _, s in rate)]
    ax.legend(handles=handles, fontsize=7, loc="lower left")
    ax.grid(alpha=0.3)
    if chat:
        ax = axes[0][1]
        # by position: a server name in two runs keeps a bar each, coloured by its run
        bars = ax.barh(range(len(chat)), [s["on_over_off"] for _, s in chat], color=[colors[i % 10] for i, _ in chat])
        ax.set_yticks(range(len(chat)), [s["server"] for _, s in chat])
        _bar_labels(ax, bars, "{:.2f}")
        ax.axvline(1.0, color="0.5", lw=0.8, ls="--")
        ax.invert_yaxis()
        ax.set_xlim(0, 1.25)
        ax.set_xlabel("tokens/s, on / plain chat server")
        ax.set_title("Chat traffic, prefix cache on", fontsize=10)
    return fig


def _tier(s: dict) -> str:
    n = len(str(s["layers"]).split(","))
    return f"{n} layer{'s' if n > 1 else ''}\n+ final" + ("\n+ pre-norm" if s["prenorm"] else "")


def _default_settings(s: dict) -> bool:
    """The server captured at the default settings (the panels say what the defaults cost): no
    setting of hs_capture's changed but the share of requests captured."""
    return all(k == "HSCAP_CAPTURE_FRACTION" or not k.startswith("HSCAP_") for k in s.get("env") or {})


def bytes_per_token(plt, docs):
    (_, sweep), = docs["rate_sweep"]
    (_, codec), = docs["codec"]
    tiers: Dict[str, List[float]] = {}  # label -> [raw bytes a token, raw bytes, file bytes]
    for run in sweep["runs"]:
        if run.get("hidden", 1024) != 1024:  # the panel's bytes are of hidden 1024 (not --shape k25)
            continue
        for s in run["servers"]:
            w = s.get("writer") or {}
            if s.get("bytes_per_token") and w.get("raw_bytes") and _default_settings(s):
                t = tiers.setdefault(_tier(s), [s["bytes_per_token"], 0, 0])
                t[1] += w["raw_bytes"]
                t[2] += w["file_bytes"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2, 3]})
    order = sorted(tiers, key=lambda k: (tiers[k][0], k))
    x = range(len(order))
    raw = [tiers[k][0] for k in order]
    disk = [tiers[k][0] * tiers[k][2] / tiers[k][1] for k in order]  # the writer's own file/raw bytes
    left.bar([i - 0.2 for i in x], raw, 0.4, label="raw (bf16)", color="0.7")
    bars = left.bar([i + 0.2 for i in x], disk, 0.4, label="on disk (default codec)", color="tab:blue")
    for b in bars:
        left.annotate(f"{b.get_height():,.0f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                      xytext=(0, 2), textcoords="offset points", ha="center", fontsize=7)
    left.set_xticks(list(x), order, fontsize=7)
    left.set_ylabel("bytes a token (hidden 1024)")
    left.set_title("What is captured (gpu/rate_sweep.py's servers)", fontsize=10)
    left.legend(fontsize=7, loc="upper left")
    left.grid(axis="y", alpha=0.3)

    data = list(dict.fromkeys(r["data"] for r in codec["results"]))
    codecs = list(dict.fromkeys(r["codec"] for r in codec["results"]))
    ratio = {(r["data"], r["codec"]): r["ratio"] for r in codec["results"]}
    width = 0.8 / len(codecs)
    colors = plt.get_cmap("tab10").colors
    for j, c in enumerate(codecs):
        xs, ys = [], []
        for i, d in enumerate(data):
            if (d, c) in ratio:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(_value_bytes(d) / ratio[(d, c)])
        right.bar(xs, ys, width, label=c, color=colors[j % 10])
    for i, d in enumerate(data):
        right.hlines(_value_bytes(d), i - 0.42, i + 0.42, color="0.3", lw=0.8, ls="--")
    right.set_xticks(range(len(data)), [d.replace(" (", "\n(") for d in data], fontsize=7)
    right.set_ylabel("bytes a value on disk (dashed: raw)")
    right.set_title("By codec (codec.py, one core each)", fontsize=10)
    right.legend(fontsize=7, ncol=3, loc="upper left")
    right.set_ylim(0, 5)
    right.grid(axis="y", alpha=0.3)
    return fig


def _value_bytes(data: str) -> int:
    """A value's raw bytes, from the dtype codec.py names in its data label."""
    for word, n in (("bf16", 2), ("fp16", 2), ("fp32", 4)):
        if word in data.split():
            return n
    raise ValueError(f"no dtype (bf16, fp16, fp32) in data label {data!r}")


def dataloader(plt, docs):
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    styles = ["-", "--", ":", "-."]
    readers: List[str] = []
    top = 0.0
    for k, (_, doc) in enumerate(docs["dump_dataset"]):
        by: Dict[str, List[Tuple[int, float]]] = {}
        for r in doc["runs"]:
            by.setdefault(r["reader"], []).append((r["workers"], r["raw_gb_per_s"]))
        for reader, pts in by.items():
            if reader not in readers:
                readers.append(reader)
            pts.sort()
            top = max([top] + [g for _, g in pts])
            ax.plot([w for w, _ in pts], [g for _, g in pts], marker="o", ls=styles[k % 4],
                    color=plt.get_cmap("tab10").colors[readers.index(reader) % 10],
                    label=f"{reader}, {doc['machine']}")
    workers = sorted({r["workers"] for _, doc in docs["dump_dataset"] for r in doc["runs"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(workers, [str(w) for w in workers])
    ax.minorticks_off()
    ax.set_ylim(0, top * 1.15)
    ax.set_xlabel("DataLoader workers")
    ax.set_ylabel("GB/s of states (raw bf16)")
    ax.set_title("One shuffled epoch through a torch DataLoader (dump_dataset.py)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    return fig


def drafters(plt, docs):
    (_, doc), = docs["purpose"]
    top1 = doc["summary"]["heldout_top1"]
    accept = doc["summary"]["heldout_simulated_accept_length"]
    names = [n for n in DRAFTERS if top1.get(n) is not None]
    names += sorted(n for n in top1 if n not in DRAFTERS and top1[n] is not None)
    labels = [DRAFTERS.get(n, n) for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    color = ["tab:green" if n in ("right", "dump") else "tab:red" if n == "untrained" else "tab:orange"
             for n in names]
    bars = left.barh(labels, [top1[n] for n in names], color=color)
    _bar_labels(left, bars, "{:.3f}")
    left.set_xlim(0, 1.18)
    left.set_xlabel("held-out top-1 agreement with the target")
    left.invert_yaxis()
    have = [n for n in names if accept.get(n) is not None]
    bars = right.barh([DRAFTERS.get(n, n) for n in have], [accept[n] for n in have],
                      color=[c for n, c in zip(names, color) if n in have])
    _bar_labels(right, bars, "{:.2f}")
    steps = len(((doc.get("train") or {}).get("right") or {}).get("per_position_acc") or [])
    if steps:
        right.axvline(steps, color="0.5", lw=0.8, ls="--")
    right.set_xlim(0, max([steps] + [accept[n] for n in have]) * 1.18)
    right.set_xlabel("simulated accept length" + (f" (dashed: all {steps} positions)" if steps else ""))
    for ax in (left, right):
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"EAGLE-3 drafters trained on captured states (gpu/purpose.py, {doc['device']})", fontsize=10)
    return fig


FIGURES: Dict[str, Callable] = {"capture_overhead.png": capture_overhead, "bytes_per_token.png": bytes_per_token,
                                "dataloader.png": dataloader, "drafters.png": drafters}
# the results each figure reads, for the one-line error when one is not of its shape
READS = {"capture_overhead.png": ("rate_sweep",), "bytes_per_token.png": ("rate_sweep", "codec"),
         "dataloader.png": ("dump_dataset",), "drafters.png": ("purpose",)}


def render(root: str, out: str) -> List[str]:
    docs = load(root)
    import matplotlib

    matplotlib.use("Agg", force=True)  # no display: a CI runner or a GPU host has none
    import matplotlib.pyplot as plt

    plt.rcdefaults()
    plt.rcParams.update({"font.size": 8, "savefig.dpi": 100, "axes.spines.top": False, "axes.spines.right": False})
    figs = {}
    try:
        for name, draw in FIGURES.items():  # all drawn before any is written: no half-updated set
            try:
                figs[name] = draw(plt, docs)
            except (KeyError, IndexError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
                files = ", ".join(rel for k in READS[name] for rel, _ in docs[k])
                raise ResultsError(f"{files}: not the shape {name} reads ({type(e).__name__}: {e})") from None
        os.makedirs(out, exist_ok=True)
        for name, fig in figs.items():
            fig.tight_layout()
            # no Software tag: the same results give the same bytes whatever wrote them
            fig.savefig(os.path.join(out, name), format="png", metadata={"Software": None},
                        pil_kwargs={"optimize": True})
    finally:
        plt.close("all")
    return [os.path.join(out, name) for name in figs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(REPO, OUT), help=f"where the PNGs go (default {OUT})")
    ap.add_argument("--root", default=REPO, help="the checkout whose results files are read (default this one)")
    a = ap.parse_args(argv)
    try:
        for path in render(a.root, a.out):
            print(path)
    except ResultsError as e:
        print(f"benchmarks/plots.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
