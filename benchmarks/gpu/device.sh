#!/usr/bin/env bash
# The GPU runner's two device calls (the device tool; README "GPU runner"), in the repo root
# on the device machine. The bundle (bin/gpu_bundle.sh) is two xz chunks that do not fit one
# call, so:
#   call 1, carry [".gpu-bundle/b2"]:  bash benchmarks/gpu/device.sh stage
#            unpacks chunk 2 and makes the model and datasets in the background (setsid:
#            it outlives the call while the machine stays warm)
#   call 2, carry [".gpu-bundle/b1"], made at once (a machine goes back 30 s after a call):
#            bash benchmarks/gpu/device.sh run [benchmarks/gpu/server.py options]
# The offline benchmarks (no sglang) need one call, carry [".gpu-bundle/b3"] (hs_capture's own
# wheels, bin/gpu_bundle.sh):  bash benchmarks/gpu/device.sh offline python3 benchmarks/...
set -euo pipefail
ROOT=${HSCAP_GPU_ROOT:-/root/hscap-gpu}
SITE=$ROOT/site
cmd=${1:-}
shift || true
case "$cmd" in
stage)
  mkdir -p "$ROOT/bundle" "$SITE"
  cp .gpu-bundle/b2/cutlass_ir.tar.xz "$ROOT/bundle/"
  cp benchmarks/gpu/model.py "$ROOT/model.py"
  rm -f "$ROOT"/*.done
  setsid nohup bash -c "
    (xz -dc '$ROOT/bundle/cutlass_ir.tar.xz' | tar x -C '$SITE' && touch '$ROOT/b2.done') &
    python3 '$ROOT/model.py' '$ROOT/model' '$ROOT/data' ${HSCAP_GPU_TIMED:+--timed $HSCAP_GPU_TIMED} && touch '$ROOT/model.done'
    wait" > "$ROOT/stage.log" 2>&1 < /dev/null &
  echo "staging in the background: $ROOT/stage.log"
  ;;
run)
  if [ ! -e "$ROOT/stage.log" ]; then
    echo "nothing staged on this machine (it went back?): make the 'stage' call first" >&2; exit 3
  fi
  if [ ! -e "$ROOT/b1.done" ]; then
    xz -dc .gpu-bundle/b1/site.tar.xz | tar x -C "$SITE" && touch "$ROOT/b1.done"
  fi
  for i in $(seq 300); do
    [ -e "$ROOT/b2.done" ] && [ -e "$ROOT/model.done" ] && break
    sleep 1
  done
  cat "$ROOT/stage.log"
  [ -e "$ROOT/b2.done" ] && [ -e "$ROOT/model.done" ] || { echo "staging did not finish" >&2; exit 3; }
  export PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/python_packages:$PWD" PYTHONUNBUFFERED=1
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 NCCL_NVLS_ENABLE=0
  export TRITON_CACHE_DIR=$ROOT/cache/triton TVM_FFI_CACHE_DIR=$ROOT/cache/tvm FLASHINFER_WORKSPACE_BASE=$ROOT/cache
  python3 benchmarks/gpu/server.py --root "$ROOT" "$@"
  ;;
offline)
  mkdir -p "$ROOT/offline"
  for w in .gpu-bundle/b3/*.whl; do
    case "$w" in *numpy-*) python3 -c "import numpy" 2>/dev/null && continue;; esac
    python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$w" "$ROOT/offline"
  done
  export PYTHONPATH="$ROOT/offline:$PWD" PYTHONUNBUFFERED=1
  "$@"
  ;;
*)
  echo "usage: $0 stage | run [server.py options] | offline COMMAND..." >&2; exit 2
  ;;
esac
