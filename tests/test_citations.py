"""Every document, section and file that a docstring, comment or document of the project cites
exists: `X.md`, `README "Section"` / `FORMAT.md "Section"` / `docs/capture.md "Section"`, and
repository paths such as `hs_capture/offline/merge/merge.py` or `benchmarks/gpu/server.py` (a stale
citation after a move fails here)."""

import os
import re
import subprocess

from tests.sglang_cpu.harness import REPO

DOC = re.compile(r"\b((?:[\w.-]+/)*[A-Z][A-Za-z_-]*\.md)\b")
SECTION = re.compile(r"\b(README|FORMAT|CONTRIBUTING|docs/[\w-]+)(?:\.md)?(?:'s)? \"([^\"\n]{3,60})\"")
PATH = re.compile(r"(?<![\w/.-])((?:hs_capture|tests|benchmarks|bin|requirements|sitecustomize)/[\w./-]*\w)")
PLACEHOLDER = re.compile(r"(?:^|[/-])(?:VERSION|X|N)(?:[/.-]|$)")


def tracked_text_files():
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True)
    for rel in out.stdout.split():
        if rel.endswith((".py", ".md", ".sh", ".cfg", ".txt")) or rel.startswith("bin/"):
            path = os.path.join(REPO, rel)
            if os.path.isfile(path):
                yield rel, open(path, errors="replace").read()


def headings(doc: str):
    path = os.path.join(REPO, doc if doc.endswith(".md") else doc + ".md")
    return [line.lstrip("#").strip() for line in open(path) if line.startswith("#")] if os.path.exists(path) else []


def test_every_cited_document_section_and_path_exists():
    bad = []
    for rel, text in tracked_text_files():
        if rel == "tests/test_citations.py":
            continue  # its own docstring shows the patterns
        here = os.path.dirname(rel)
        for doc in set(DOC.findall(text)):
            if not any(os.path.exists(os.path.join(REPO, d, doc)) for d in (here, "")):
                bad.append(f"{rel}: cites {doc}")
        for doc, section in set(SECTION.findall(text)) if rel != "CHANGELOG.md" else ():  # cites them as they were
            if not any(section.lower() in h.lower() for h in headings(doc)):
                bad.append(f"{rel}: cites {doc} \"{section}\"")
        for m in PATH.finditer(text):
            path, after = m.group(1).rstrip("."), text[m.end():m.end() + 1]
            if after in "-${<*" and after or PLACEHOLDER.search(path):
                continue  # a pattern (requirements/sglang-$V.txt, .../VERSION/...), not a file
            if not os.path.exists(os.path.join(REPO, path)):
                bad.append(f"{rel}: cites {path}")
    assert not bad, "\n".join(sorted(bad))
