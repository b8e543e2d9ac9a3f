#!/usr/bin/env bash
# Installs the package and what the tests and the main job need. PyTorch comes first, pinned
# to its CPU build: a bare torch requirement on a machine without torch pulls a CUDA build of
# several GB. Safe to run again: installed packages are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
if ! "$PY" -c "import tokpipe_compiler, diffusers, hypothesis, pytest, PIL" 2>/dev/null; then
  "$PY" -m pip install -q -e ".[test]"
fi
