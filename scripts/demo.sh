#!/usr/bin/env bash
# The main job: two CPU ranks generate with a DiT in ring mode, against the serial loop.
# Arguments go to `python -m tokpipe_compiler.demo` (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m tokpipe_compiler.demo "$@"
