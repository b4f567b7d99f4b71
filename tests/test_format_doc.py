"""FORMAT.md is held against the code: every field of the dump's typed records, every key a
real server writes (run metadata, its stats, parallel and modes objects, index lines, sequence
entries) and every key of the native index is documented in its section, with the versions the
code writes. A field added without documentation fails here."""

import dataclasses
import json
import os
import re
from typing import Dict, Iterable, Set

from hs_capture.dump import hst
from hs_capture.dump.paths import index_path, rank_meta_path, rank_tags, run_dirs
from hs_capture.dump.schema import SCHEMA_LOSSLESS, SCHEMA_VERSION, FileRef, IndexLine, RankMeta, SeqEntry
from tests.sglang_cpu.harness import REPO

RUN_META, INDEX, NATIVE = "## 2.", "## 3.", "## 5."


def sections() -> Dict[str, str]:
    text = open(os.path.join(REPO, "FORMAT.md")).read()
    parts = re.split(r"(?m)^(?=## )", text)
    return {p.split(" ", 2)[0] + " " + p.split(" ", 2)[1]: p for p in parts if p.startswith("## ")}


def documented(section: str) -> Set[str]:
    """Every name written in backticks in a section (table rows and their notes)."""
    return set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", sections()[section]))


def undocumented(names: Iterable[str], section: str) -> Set[str]:
    return set(names) - documented(section)


def fields_of(record) -> Set[str]:
    return {f.name for f in dataclasses.fields(record)} - {"extra"}


def test_every_field_of_the_typed_records_is_documented():
    assert undocumented(fields_of(RankMeta), RUN_META) == set()
    for record in (IndexLine, SeqEntry, FileRef):
        assert undocumented(fields_of(record), INDEX) == set(), record


def test_a_field_added_without_documentation_is_caught():
    grown = dataclasses.make_dataclass("Grown", [("shard_group", int, 0)], bases=(RankMeta,))
    assert undocumented(fields_of(grown), RUN_META) == {"shard_group"}


def test_every_key_a_real_server_wrote_is_documented(served_dump):
    (run,) = run_dirs(served_dump["dir"])
    for tag in rank_tags(run):
        meta = json.load(open(rank_meta_path(run, tag)))
        nested = [k for key in ("stats", "parallel", "server_modes", "capture_stopped") for k in meta.get(key) or {}]
        assert undocumented(list(meta) + nested, RUN_META) == set()
        assert meta["schema"] == SCHEMA_LOSSLESS  # a lossless run stays schema 1
        with open(index_path(run, tag)) as f:
            lines = [json.loads(x) for x in f]
        keys = {k for x in lines for k in x} | {k for x in lines for s in x["seqs"] for k in s} | {
            k for x in lines for f in x.get("files", {}).values() for k in f}
        assert undocumented(keys, INDEX) == set()


def test_the_versions_the_code_writes_are_the_documented_ones(tmp_path):
    text = open(os.path.join(REPO, "FORMAT.md")).read()
    assert f"| schema {SCHEMA_LOSSLESS} and {SCHEMA_VERSION} |" in text
    assert f"`.hst` tensor file (version {hst.FORMAT_VERSION})" in text
    from hs_capture.offline.formats import native

    os.makedirs(tmp_path / native.SHARD_DIR)
    native.write_index(str(tmp_path), [2, 3], 8, False)
    index = json.load(open(tmp_path / "index.json"))
    assert undocumented(index, NATIVE) == set() and f"version {index['version']})" in sections()[NATIVE]
