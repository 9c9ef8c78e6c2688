#!/usr/bin/env bash
# Build, on a machine without a GPU, the Triton kernel cache a GPU session's warm step unpacks
# (bench/warm_kernel_cache.py --pack; bench/KERNELS.md, "2026-12-03, third CPU session"). Triton's cache key hashes
# triton's own files, its compiled library among them, so the cache is built with the GPU image's Python and
# triton: Python 3.12 and triton 3.6.0 (torch 2.11's pin), in a virtual environment of their own ($VENV). About 14
# minutes of compiles on two cores; the environment is ~4.6 GB (torch's CUDA build: what pip offers).
#   bash bench/build_kernel_cache.sh            # writes runs/kernel-cache/sm90.tar.gz; carry runs/kernel-cache
#   VENV=/tmp/v PYTHON312=/usr/bin/python3.12 OUT_FILE=runs/kernel-cache/sm90.tar.gz bash bench/build_kernel_cache.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-runs/kernel-cache-venv}
OUT_FILE=${OUT_FILE:-runs/kernel-cache/sm90.tar.gz}
python312() {  # the first candidate that runs as Python 3.12 (a pyenv shim may exist and not run)
  local candidate
  for candidate in "${PYTHON312:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
    if [ -n "$candidate" ] && "$candidate" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null; then
      echo "$candidate"
      return
    fi
  done
}
if [ ! -x "$VENV/bin/python" ]; then
  PYTHON=$(python312)
  if [ -z "$PYTHON" ]; then
    echo "no Python 3.12 (the GPU image's) found: set PYTHON312 to one" >&2
    exit 2
  fi
  "$PYTHON" -m venv "$VENV"
  # the GPU image's versions (bench/results/*-h100*/env.txt); pytest for the kernel cases' module
  "$VENV/bin/pip" install --quiet --no-compile torch==2.11.0 triton==3.6.0 transformers==5.17.0 pytest
fi
"$VENV/bin/python" -c "import sys, triton; assert sys.version_info[:2] == (3, 12) and triton.__version__ == '3.6.0', \
  (sys.version, triton.__version__)"
# Triton's cache folder and the step's log beside the file's folder, not in it: a call carries that folder (64 MiB)
# every plan, so the pack serves both of a session's calls
TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-runs/kernel-cache-build/triton} KERNEL_CACHE_PACK=$OUT_FILE \
  WARM_PLANS=${WARM_PLANS:-check attention pending decode ws} \
  PY="$VENV/bin/python" OUT=${OUT:-runs/kernel-cache-build/log} bash bench/gpu_session.sh warm
