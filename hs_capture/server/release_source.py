"""What an installed SGLang release declares, read from its source files without importing it.

`hscap serve` asks the server's release which flags it has before every start. Importing
sglang's server arguments to find out takes seconds (more beside CUDA's libraries), and
the server then imports them all again; the field declarations say the same far sooner. Where the files do not say (a layout this reader does not know, a
file this Python cannot parse), the caller asks the release itself.
"""

from __future__ import annotations

import ast
import glob
import os
import subprocess
from typing import Iterable, Optional, Set

# where releases declare ServerArgs' fields: server_args.py, and arg_groups/ from 0.5.2x
FIELD_FILES = ("server_args.py", os.path.join("arg_groups", "**", "*.py"))

# find_spec of a top-level package locates it without running its __init__
_LOCATE = ("import importlib.util as u; s = u.find_spec('sglang'); "
           "print(s.submodule_search_locations[0] if s and s.submodule_search_locations else '')")


def package_dir(python: str) -> Optional[str]:
    """The sglang package directory `python` would import, or None where it has none (or
    cannot be run)."""
    try:
        out = subprocess.run([python, "-c", _LOCATE], capture_output=True, text=True, timeout=60,
                             env={k: v for k, v in os.environ.items() if not k.startswith("HSCAP_")})
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()  # the last line: a startup hook may print before it
    path = lines[-1].strip() if lines else ""
    return path if out.returncode == 0 and os.path.isdir(path) else None


def declared_fields(package: str, names: Iterable[str]) -> Set[str]:
    """Those of `names` the release at `package` declares as fields of a class (`name: type`
    in a class body) in its server-argument files. A mention anywhere else (a function's
    parameter or body, a comment, a help text) is not a declaration."""
    wanted = set(names)
    found: Set[str] = set()
    srt = os.path.join(package, "srt")
    for pattern in FIELD_FILES:
        for path in sorted(glob.glob(os.path.join(srt, pattern), recursive=True)):
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                if not any(n in text for n in wanted):  # most files name none: not parsed
                    continue
                tree = ast.parse(text)
            except (OSError, SyntaxError, ValueError):
                continue
            for cls in ast.walk(tree):
                if isinstance(cls, ast.ClassDef):
                    found.update(s.target.id for s in cls.body if isinstance(s, ast.AnnAssign)
                                 and isinstance(s.target, ast.Name) and s.target.id in wanted)
    return found
