"""What one captured forward hands the writer: the step's index metadata (which requests,
their lengths, prefix lengths and rows) and its tensors, trimmed of padding rows, with
SGLang's aux captures (a packed [T, K*H] tensor from 0.5.23, a list of [T, H] up to 0.5.15)
named by the layers they hold; `compact` turns them into the compact tier (dump/quant.py) on
the device. Pure logic on what the forward returned: no state, no I/O."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from hs_capture.dump.paths import FINAL, PRENORM, part_name
from hs_capture.dump.schema import IndexLine, SeqEntry, step_line
from hs_capture.dump.hst import dtype_name
from hs_capture.dump import quant
from hs_capture.server.step_files import INPUT_PARTS, SCALE


Borrows = Callable[[Optional[str], int], Optional[Tuple[str, str]]]


def take_step(fb: Any, mode: str, hidden: torch.Tensor, aux: Any, current: List[int], layers: List[int],
              hidden_size: int, prenorm: Optional[torch.Tensor] = None, keep: Optional[List[bool]] = None,
              borrows: Optional[Borrows] = None) -> Tuple[IndexLine, Dict[str, torch.Tensor], List[int]]:
    """(the step's index line before the writer numbers it, tensors, the layers of the packed
    "aux" tensor's column blocks).
    `current`: the layers SGLang captured in this forward (ours and the host's); `layers`: ours.
    `keep`: which of the batch's sequences the capture policy picked (None: all).
    `borrows(rid, prefix)`: for a sequence starting past 0, the request whose capture holds
    its prefix and the prefix's digest (requests.RequestPicker.borrow_of)."""
    seq_lens = [int(x) for x in fb.extend_seq_lens_cpu]
    prefix = [int(x) for x in fb.extend_prefix_lens_cpu]
    rids = getattr(fb, "rids", None)
    rids = [None if r is None else str(r) for r in rids] if rids is not None else [None] * len(seq_lens)
    if not (len(rids) == len(seq_lens) == len(prefix)):
        raise ValueError(f"batch of {len(seq_lens)} sequences carries {len(rids)} rids")
    n = sum(seq_lens)  # rows past n are padding (DP attention, graphs)
    if hidden.shape[0] < n:
        raise ValueError(f"final state has {hidden.shape[0]} rows for {n} tokens")
    tensors: Dict[str, torch.Tensor] = {FINAL: hidden[:n], "tokens": fb.input_ids[:n], "positions": fb.positions[:n]}
    if prenorm is not None:
        if prenorm.shape[0] < n:
            raise ValueError(f"the final norm's input has {prenorm.shape[0]} rows for {n} tokens")
        tensors[PRENORM] = prenorm[:n]
    aux_layers = _take_aux(tensors, aux, current, layers, hidden_size, n)
    seqs = list(zip(rids, seq_lens, prefix))
    if keep is not None:
        if len(keep) != len(seqs):
            raise ValueError(f"batch of {len(seqs)} sequences has {len(keep)} capture choices")
        spans = _kept_spans(seq_lens, keep)
        tensors = {name: _rows(t, spans) for name, t in tensors.items()}
        seqs = [s for s, k in zip(seqs, keep) if k]
        n = sum(length for _, length, _ in seqs)
    offsets, acc = [], 0
    for _, length, _ in seqs:
        offsets.append(acc)
        acc += length
    entries = []
    for (r, ln, p), o in zip(seqs, offsets):
        src = borrows(r, p) if borrows is not None and p > 0 else None
        entries.append(SeqEntry(r, ln, p, o, *(src or (None, None))))
    line = step_line(mode, n, int(hidden.shape[0]), dtype_name(hidden.dtype), entries)
    return line, tensors, aux_layers


def _kept_spans(seq_lens: List[int], keep: List[bool]) -> List[Tuple[int, int]]:
    """The row ranges of the kept sequences, adjacent ones merged."""
    spans: List[List[int]] = []
    at = 0
    for length, k in zip(seq_lens, keep):
        if k:
            if spans and spans[-1][1] == at:
                spans[-1][1] = at + length
            else:
                spans.append([at, at + length])
        at += length
    return [(a, b) for a, b in spans]


def _rows(t: torch.Tensor, spans: List[Tuple[int, int]]) -> torch.Tensor:
    """Those rows of `t`: a view for one span, else copies on the device. Never an index
    tensor built on the host: its copy to the device would wait for the forward (a pageable
    host-to-device copy synchronizes the stream), ending the scheduler's overlap."""
    if len(spans) == 1:
        return t[spans[0][0]:spans[0][1]]
    return torch.cat([t[a:b] for a, b in spans])


def _take_aux(tensors: Dict[str, torch.Tensor], aux: Any, current: List[int], layers: List[int], h: int,
              n: int) -> List[int]:
    """Our layers out of SGLang's aux captures, into `tensors`; returns the packed tensor's layers."""
    if isinstance(aux, torch.Tensor):  # 0.5.23: one packed [T, K*H] tensor, blocks in layer order
        if aux.shape[-1] != h * len(current):
            raise ValueError(f"aux is {tuple(aux.shape)}, expected {len(current)} x {h} columns")
        if current == layers:
            tensors["aux"] = aux[:n]  # split on the host by the writer: no device copy
            return list(current)
        for layer in layers:
            j = current.index(layer)
            tensors[part_name(layer)] = aux[:n, j * h:(j + 1) * h]
        return []
    if len(aux) != len(current):  # up to 0.5.15: a list of [T, H] tensors in layer order
        raise ValueError(f"{len(aux)} aux tensors for layers {current}")
    for layer in layers:
        tensors[part_name(layer)] = aux[current.index(layer)][:n]
    return []


def compact(line: IndexLine, tensors: Dict[str, torch.Tensor], aux_layers: List[int], hidden_size: int
            ) -> Tuple[IndexLine, Dict[str, torch.Tensor], List[int]]:
    """The step's states in the compact tier, quantized where they are (on the device, on the
    forward's stream, before any copy: the copy, the pinned memory and the writer's work all
    shrink). Each state `name` becomes FP8 `name` and its scale `name#scale`; SGLang's packed
    aux is cut into its layers' parts on the way (the quantized tensors are new memory)."""
    out: Dict[str, torch.Tensor] = {}
    states: Dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in INPUT_PARTS:
            out[name] = t
        elif name == "aux":
            for j, layer in enumerate(aux_layers):
                states[part_name(layer)] = t[:, j * hidden_size:(j + 1) * hidden_size]
        else:
            states[name] = t
    for name, (q, scale) in zip(states, quant.quantize_parts(list(states.values()))):
        out[name], out[name + SCALE] = q, scale
    return replace(line, dtype=quant.STORED_DTYPE), out, []
