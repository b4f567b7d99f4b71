#!/usr/bin/env bash
# Build the venv the demo and the tests run in: the REAL sglang 0.5.23 on this CPU.
# Idempotent; VENV=... picks the folder (default .venv at the repo root).
#   torch 2.14.1: the build sglang 0.5.23 pins (a CUDA build; it runs on the CPU).
#   sglang --no-deps: its full list pulls CUDA kernels that cannot work on a CPU;
#   the light packages it imports are pinned in requirements/test-lock.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
# a fresh venv takes 6.8 GB (torch's CUDA build is most of it) and pip stages wheels in TMPDIR:
# a disk too full says so here, in one line, not as an OSError halfway through torch
needs_gb() {  # GB DIR (or the nearest folder above it that exists: venv makes the rest)
  local d=$2 free
  while [ ! -d "$d" ]; do d=$(dirname "$d"); done
  free=$(df -Pk "$d" | awk 'NR==2 {print int($4 / 1048576)}')
  [ "$free" -ge "$1" ] || { echo "bin/setup_env.sh: $free GB free on $d; building the venv needs $1 GB there" >&2; exit 1; }
}
if ! "$VENV/bin/python" -c 'import importlib.util as u; exit(not (u.find_spec("torch") and u.find_spec("sglang")))' 2>/dev/null; then
  needs_gb 7 "$(dirname "$VENV")"
  needs_gb 2 "${TMPDIR:-/tmp}"
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
LOG="$VENV/pip-resolver-notes.log"
: > "$LOG"
# pip's resolver lists the deps of the --no-deps packages that are deliberately not installed
# (sglang's CUDA kernels, the trainers' GPU stacks) as an "ERROR" after every later install:
# expected here, so kept in $LOG; any real failure still stops the script with pip's output.
pip() {  # in $VENV
  local err; err=$(mktemp)
  if ! "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2>"$err"; then
    cat "$err" >&2; rm -f "$err"; return 1
  fi
  cat "$err" >> "$LOG"; rm -f "$err"
}
pip install torch==2.14.1 torchvision==0.29.1
pip install --no-deps sglang==0.5.23 xgrammar==0.2.7
# the training frameworks (--no-deps: their GPU stacks are left out; what their own commands need
# to start is in requirements/test-lock.txt, docs/cpu.md "By hand on this CPU" says where each stops)
pip install --no-deps specforge==0.2.0 speculators==0.9.0 hs-connectors==0.9.0 nvidia-modelopt==0.47.0
pip install -r requirements/test-lock.txt
pip install --no-deps -e .
# ModelOpt's training step runs in an overlay of this venv (its draft needs transformers < 5.19):
# a venv that sees .venv's packages through a .pth, with requirements/modelopt-overlay.txt on top.
# Activated, the overlay's bin replaces .venv's on PATH, so what its commands need is installed
# in it even where .venv has it (--ignore-installed): accelerate (ModelOpt's launch_train.sh
# runs it) and hs_capture (`hscap train modelopt`; .venv's editable install is not seen there,
# since a .pth's path line does not run that directory's own .pth files)
MO=${MODELOPT_VENV:-.venvs/modelopt}
[ -x "$MO/bin/python" ] || "$PY" -m venv "$MO"
"$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
  > "$("$MO/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_suite_venv.pth"
VENV=$MO pip install --no-deps --ignore-installed -r requirements/modelopt-overlay.txt
VENV=$MO pip install --no-deps -e .
n=$(grep -c "which is not installed\|but you have" "$LOG" || true)
[ "$n" = 0 ] || echo "note: $n dependencies of the --no-deps packages are left out on purpose (sglang's CUDA kernels, and what the trainers' commands do not need to start on a CPU); pip's list: $LOG"
echo "venv ready: $VENV ($("$VENV/bin/python" -c 'import sglang, torch; print("sglang", sglang.__version__, "torch", torch.__version__)'))"
