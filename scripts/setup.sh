#!/usr/bin/env bash
# Installs the package (editable, from this checkout) and what the tests and the main job
# need (the test and demo extras). PyTorch comes first, pinned to its CPU build: a bare torch
# requirement on a machine without torch pulls a CUDA build of several GB. Safe to run
# again: what is there is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
if ! "$PY" -c "import diffusers, hypothesis, pytest, PIL, matplotlib, sympy, ruff, triton, \
    sklearn, safetensors, tqdm, transformers, xdist, peft" 2>/dev/null; then
  "$PY" -m pip install -q -e ".[test,demo]"
fi
# The package must be this checkout's, not one installed from elsewhere. Asked from another
# folder (here, Python would find ./tokpipe_compiler first) and through a mapped subpackage.
here="$(pwd)/passes"
there="$(cd / && "$PY" -c 'import os, tokpipe_compiler.passes as p; print(os.path.dirname(p.__file__))' \
  2>/dev/null || true)"
# An install made before a module moved names a backend entry point that no longer loads.
entry_loads="$(cd / && "$PY" -c 'from importlib.metadata import entry_points
print([e.load() for e in entry_points(group="torch_dynamo_backends", name="tokpipe")] != [])' \
  2>/dev/null || true)"
if [ "$there" != "$here" ] || [ "$entry_loads" != "True" ]; then
  "$PY" -m pip install -q --no-deps -e .
fi
