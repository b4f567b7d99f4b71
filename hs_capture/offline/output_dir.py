"""Where `hscap merge` may write: a new or empty directory, or one holding only its own output
in the same format (a resumed merge, or `--shard i/N` merges sharing one directory). Never a
dump, never inside one, and never beside files merge did not write: a trainer that reads
every file of its kind under the directory (SpecForge globs `**/*.ckpt`) would train on them,
and verify would report them as duplicates."""

from __future__ import annotations

import json
import os
from typing import Dict, List, Sequence

from hs_capture.offline.formats import FORMATS, TrainingFormat
from hs_capture.dump.paths import MERGE_REPORT, TEMP_MARK, holds_dump

SETTINGS = "trainer_settings.json"  # the trainer's settings that match the capture (merge writes it)
REPORTS = (MERGE_REPORT, SETTINGS)  # what every merge writes beside its samples


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


def _owner(rel: str) -> str:
    """The format that writes this path; '' for what every merge writes (its reports, the
    temp files a killed merge leaves); '?' for a path merge never writes."""
    parent, _, name = rel.rpartition("/")
    if rel in REPORTS or (TEMP_MARK in name and (not parent or any(f.owns(parent) for f in FORMATS.values()))):
        return ""
    return next((f.name for f in FORMATS.values() if f.owns(rel)), "?")


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
    for rel in _entries(out_dir):
        owners.setdefault(_owner(rel), []).append(rel)
    foreign = owners.pop("?", [])
    if foreign:
        raise OutputDirError(f"{out_dir} holds {len(foreign)} files merge did not write (e.g. {foreign[0]!r}): "
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
