#!/usr/bin/env bash
# The test suite, slow tests (Inductor compiles, multi-process runs) included.
set -euo pipefail
cd "$(dirname "$0")/.."
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
python -m pytest -q -p no:cacheprovider "$@"
