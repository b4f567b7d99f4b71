"""bin/setup_env.sh, the set-up the README and .ci/run share: on a disk too full for a venv it
stops in one line before pip starts, not with an OSError halfway through torch."""

import os
import shutil
import subprocess

import pytest

from tests.sglang_cpu.harness import REPO


@pytest.fixture
def tiny_fs(tmpfs):
    """A 1 MB tmpfs, mounted and unmounted by the test."""
    return tmpfs("1m")


@pytest.mark.parametrize("where", ["venv", "TMPDIR"])
def test_a_disk_too_full_for_the_venv_stops_in_one_line_and_builds_nothing(tiny_fs, tmp_path, where):
    if where == "TMPDIR" and shutil.disk_usage(tmp_path).free < 7 << 30:
        pytest.skip("the venv's own disk has under 7 GB free: its check would speak first")
    # a venv two folders below the tiny disk: the check reads the nearest folder that exists
    venv = os.path.join(tiny_fs, "new", "v") if where == "venv" else os.path.join(str(tmp_path), "v")
    env = {**os.environ, "VENV": venv, "TMPDIR": tiny_fs if where == "TMPDIR" else str(tmp_path)}
    r = subprocess.run(["bash", os.path.join(REPO, "bin", "setup_env.sh")], env=env, capture_output=True, text=True,
                       timeout=60)
    need = "7 GB" if where == "venv" else "2 GB"
    assert r.returncode == 1 and r.stderr.splitlines() == [f"bin/setup_env.sh: 0 GB free on {tiny_fs}; building the "
                                                           f"venv needs {need} there"], r.stderr
    assert not os.path.exists(venv)
