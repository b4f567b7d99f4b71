#!/usr/bin/env bash
# Build a venv serving another sglang release on this CPU, for the version matrix
# (tests/test_versions.py): .venvs/sglang-VERSION. Idempotent.
#   bash bin/setup_sglang_venv.sh 0.5.15
# Same recipe as bin/setup_env.sh: the local torch build (sglang is installed --no-deps, so
# its own torch pin is not pulled: the server code paths we use run on it), the light
# dependencies of requirements/test-lock.txt, then requirements/sglang-VERSION.txt for the
# pins that release needs instead (its transformers, mostly), and tests/sglang_cpu/compat/
# VERSION on its path where that release imports a CUDA-only package. hs_capture itself is not
# installed: the hook finds the checkout (the documented PYTHONPATH form).
set -euo pipefail
cd "$(dirname "$0")/.."
V=${1:?usage: setup_sglang_venv.sh SGLANG_VERSION}
VENV=${VENV:-.venvs/sglang-$V}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install torch==2.14.1 torchvision==0.29.1
pip install --no-deps "sglang==$V"
pip install -r requirements/test-lock.txt
if [ -f "requirements/sglang-$V.txt" ]; then pip install -r "requirements/sglang-$V.txt"; fi
# import-time stand-ins a release needs on a CPU (tests/sglang_cpu/compat/VERSION/README)
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -d "tests/sglang_cpu/compat/$V" ]; then
  echo "$PWD/tests/sglang_cpu/compat/$V" > "$SITE/hscap_test_compat.pth"
  if [ -f "tests/sglang_cpu/compat/$V/hscap_test_compat.py" ]; then  # a release without plugin entry points
    echo "import hscap_test_compat" >> "$SITE/hscap_test_compat.pth"
  fi
else
  rm -f "$SITE/hscap_test_compat.pth"
fi
echo "venv ready: $VENV ($("$VENV/bin/python" -c 'import sglang, torch, transformers; print("sglang", sglang.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'))"
