"""Ctrl-C in `hscap merge` as a terminal sends it (SIGINT to the whole process group: merge, its
fork server and its workers), at several moments of a merge of the CPU server's dump: exit 130
with one line saying the finished files are kept and the same command resumes (or exit 0 when
it came after the work was done), never a traceback or click's "Aborted!", no process left
behind, and the re-run ends with the files of an uninterrupted merge. Also: a Ctrl-C while
`hscap` imports its commands is one line, and a finished command's exit still runs atexit."""

import os
import signal
import subprocess
import sys
import time

import pytest

from hs_capture.offline.merge.output_dir import MANIFEST
from tests.sglang_cpu.harness import SHIMS
from tests.test_merge import files_of

HSCAP = os.path.join(os.path.dirname(sys.executable), "hscap")  # the console script, as users run it


def _as_from_a_terminal() -> None:
    # a suite started in the background by a non-interactive shell inherits SIGINT ignored, and
    # Python keeps an ignored SIGINT ignored: the command then never saw the Ctrl-C
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(*args: str, env=None) -> subprocess.Popen:
    return subprocess.Popen([HSCAP, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env, preexec_fn=_as_from_a_terminal)


# each merged file 150 ms longer (tests/sglang_cpu/shims): on a fast machine a warm merge of the
# small dump ends within the few ms between its manifest and a Ctrl-C
SLOW_MERGE = {**os.environ, "PYTHONPATH": SHIMS, "HSCAP_TEST_SLOW_MERGE_MS": "150"}


def live_members(group: int) -> list:
    """Processes of a process group that are not zombies (a worker or fork server left running)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            found.append(int(pid))
    return found


def wait_for(path: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until merge has planned and recorded what it will write (its manifest appears)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_ctrl_c_in_merge_keeps_whole_files_says_a_rerun_resumes_and_the_rerun_completes(served_dump, tmp_path, jobs):
    def merge(out):
        return ("merge", served_dump["dir"], "-o", out, "--format", "specforge", "--dataset", served_dump["data"],
                "-j", jobs)

    clean = str(tmp_path / "clean")
    p = start(*merge(clean), env=SLOW_MERGE)
    wait_for(os.path.join(clean, MANIFEST), p)
    t0 = time.monotonic()
    _, err = p.communicate(timeout=600)
    work = time.monotonic() - t0  # from the plan to the exit: where a Ctrl-C lands below
    assert p.returncode == 0, err
    interrupted = 0
    for k, frac in enumerate((0.0, 0.3, 0.6)):
        out = str(tmp_path / f"out{k}")
        p = start(*merge(out), env=SLOW_MERGE)
        wait_for(os.path.join(out, MANIFEST), p)
        time.sleep(frac * work)
        try:
            os.killpg(p.pid, signal.SIGINT)
        except ProcessLookupError:  # already gone: finished
            pass
        _, err = p.communicate(timeout=600)
        assert "Traceback" not in err and "Aborted" not in err, err
        if p.returncode == 130:
            interrupted += 1
            last = err.strip().splitlines()[-1]
            assert last == (f"hscap merge: interrupted: the files finished so far are kept in {out} (each written "
                            "whole); the same command resumes"), err
        else:
            assert p.returncode == 0, err
        deadline = time.monotonic() + 10
        while live_members(p.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not live_members(p.pid), "a worker or the fork server outlived the interrupted merge"
        again = subprocess.run([HSCAP, *merge(out)], capture_output=True, text=True, timeout=600)
        assert again.returncode == 0, again.stderr
        assert files_of(out) == files_of(clean)
    assert interrupted >= 1  # a Ctrl-C landed while merge ran, not only after


def test_ctrl_c_while_hscap_imports_its_commands_is_one_line():
    code = """if True:
        import sys
        class Interrupt:  # a Ctrl-C arriving while the merge command's module is imported
            def find_spec(self, name, path=None, target=None):
                if name == "hs_capture.cli.merge_cmd":
                    raise KeyboardInterrupt
        sys.meta_path.insert(0, Interrupt())
        sys.argv = ["hscap", "merge", "--help"]
        from hs_capture.console import main
        main()"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 130 and p.stderr == "hscap: interrupted\n", p.stderr


def test_a_finished_command_exits_with_its_status_and_runs_atexit():
    code = """if True:
        import atexit, sys
        atexit.register(lambda: print("atexit ran", flush=True))
        sys.argv = ["hscap", "verify", "/no/such/dump"]
        from hs_capture.console import main
        main()"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "does not exist" in p.stderr and p.stdout == "atexit ran\n", (p.stdout, p.stderr)
