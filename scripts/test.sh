#!/usr/bin/env bash
# The test suite, slow tests (Inductor compiles, multi-process runs) included.
# Arguments go to pytest: `bash scripts/test.sh -m "not slow"` skips the slow ones.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider "$@"
