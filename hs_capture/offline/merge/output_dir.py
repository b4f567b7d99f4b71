"""Where `hscap merge` may write: a new or empty directory, or one holding only its own output
in the same format (a resumed merge, or `--shard i/N` merges sharing one directory). Never a
dump, never inside one, and never beside files merge did not write: a trainer that reads
every file of its kind under the directory (SpecForge globs `**/*.ckpt`) would train on them,
and verify would report them as duplicates.

What merge wrote is what it recorded writing: every path goes into the directory's manifest
(MANIFEST, one a line) before the file is written. A file's name never makes it merge's: a
user's `data_0.ckpt` is SpecForge's own name too. `--overwrite` removes only recorded paths."""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, Sequence, Set

from hs_capture.offline.formats import FORMATS, TrainingFormat
from hs_capture.dump.paths import MERGE_REPORT, TEMP_MARK, holds_dump

SETTINGS = "trainer_settings.json"  # the trainer's settings that match the capture (merge writes it)
REPORTS = (MERGE_REPORT, SETTINGS)  # what every merge writes beside its samples
MANIFEST = ".hscap-merge-files"  # every path merge wrote in the directory, recorded before it is written


class OutputDirError(Exception):
    """The output directory cannot take this merge: the message is the one line to print."""


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _entries(out_dir: str) -> List[str]:
    """Every file and directory under out_dir, relative, '/'-separated."""
    found = []
    for dirpath, dirs, names in os.walk(out_dir):
        rel = os.path.relpath(dirpath, out_dir)
        for name in sorted(dirs) + sorted(names):
            found.append(name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"))
    return found


def _reported_format(out_dir: str) -> str:
    """The format an earlier merge's reports name ('' when there are none)."""
    for name in REPORTS:
        try:
            with open(os.path.join(out_dir, name)) as f:
                return str(json.load(f).get("format") or "")
        except (OSError, ValueError, AttributeError):
            continue
    return ""


def recorded(out_dir: str) -> Set[str]:
    """The paths merge recorded writing in out_dir (none without a manifest)."""
    try:
        with open(os.path.join(out_dir, MANIFEST), encoding="utf-8") as f:
            return {line.rstrip("\n") for line in f if line.strip()}
    except OSError:
        return set()


def record(out_dir: str, rels: Iterable[str]) -> None:
    """Add paths to out_dir's manifest before they are written (one append, whole lines)."""
    new = sorted(set(rels) - recorded(out_dir))
    if not new:
        return
    os.makedirs(out_dir, exist_ok=True)
    fd = os.open(os.path.join(out_dir, MANIFEST), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, "".join(rel + "\n" for rel in new).encode())
    finally:
        os.close(fd)


def _owner(rel: str, mine: Set[str]) -> str:
    """The format of a path merge recorded writing ('' for its reports and manifest, the temp
    files a killed merge leaves, and the directories that hold them); '?' for any other path."""
    parent, _, name = rel.rpartition("/")
    if rel == MANIFEST or (mine and rel in REPORTS):
        return ""
    if rel in mine:
        return next((f.name for f in FORMATS.values() if f.owns(rel)), "")
    if TEMP_MARK in name and name.startswith("."):  # temp_name(): ".<name>.tmp-<pid>"
        final = name[1:name.index(TEMP_MARK)]
        if (f"{parent}/{final}" if parent else final) in mine:
            return ""
    if any(m.startswith(rel + "/") for m in mine):
        return ""  # a directory merge made for its files
    return "?"


def _counted(out_dir: str, rels: List[str]) -> str:
    files = sum(not os.path.isdir(os.path.join(out_dir, r)) for r in rels)
    dirs = len(rels) - files
    parts = [f"{n} {one if n == 1 else many}" for n, one, many in
             ((files, "file", "files"), (dirs, "directory", "directories")) if n]
    return " and ".join(parts)


def prepare(out_dir: str, dump_dirs: Sequence[str], training_format: TrainingFormat, overwrite: bool) -> None:
    """Raise OutputDirError unless merge may write `training_format` into out_dir; with
    `overwrite`, first remove what an earlier merge wrote there (only that)."""
    out = os.path.realpath(out_dir)
    for d in dump_dirs:
        if not holds_dump(d):
            continue  # not a dump at all: merge's reader says so
        dump = os.path.realpath(d)
        if _inside(out, dump):
            raise OutputDirError(f"{out_dir} is inside the dump {d}: merge never writes into a dump "
                                 "(verify would read its output as part of the dump); choose a directory outside it")
        if _inside(dump, out):
            raise OutputDirError(f"the dump {d} is inside {out_dir}: merge into a directory of its own")
    if not os.path.isdir(out_dir):
        if os.path.exists(out_dir):
            raise OutputDirError(f"{out_dir} exists and is not a directory")
        return
    if holds_dump(out_dir):
        raise OutputDirError(f"{out_dir} holds an hs_capture dump: merge into a directory of its own")
    owners: Dict[str, List[str]] = {}
    mine = recorded(out_dir)
    for rel in _entries(out_dir):
        owners.setdefault(_owner(rel, mine), []).append(rel)
    foreign = owners.pop("?", [])
    if not mine and any(rel in REPORTS for rel in foreign):
        # a merge from before the manifest: its report counts files but names none, so nothing
        # there can be told from a file of the user's; resuming or --overwrite would have to guess
        raise OutputDirError(f"{out_dir} holds the output of a merge that kept no record of its files (no {MANIFEST}): "
                             f"merge into a new directory, or remove {out_dir} yourself and merge again")
    if foreign:
        top = [r for r in foreign if "/" not in r or r.rpartition("/")[0] not in foreign]
        raise OutputDirError(f"{out_dir} holds {_counted(out_dir, foreign)} merge did not write (e.g. {top[0]!r}): "
                             "merge into a new or empty directory (a trainer reading it would take them as samples)")
    earlier = _reported_format(out_dir)
    others = sorted({name for name in owners if name and name != training_format.name}
                    | ({earlier} - {"", training_format.name}))
    if others and not overwrite:
        raise OutputDirError(f"{out_dir} holds the {', '.join(others)} output of an earlier merge: merge "
                             f"--format {training_format.name} into another directory, or pass --overwrite to "
                             "replace it")
    if overwrite:
        for rel in sorted((r for rels in owners.values() for r in rels), key=lambda r: -r.count("/")):
            path = os.path.join(out_dir, rel)
            if os.path.isdir(path):
                os.rmdir(path)  # merge's own directories hold only merge's files (checked above)
            else:
                os.remove(path)
