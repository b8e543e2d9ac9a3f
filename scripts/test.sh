#!/usr/bin/env bash
# The test suite, slow tests (Inductor compiles, multi-process runs) included; the
# exhaustive sets marked `full` (every released config and family, one process and two
# ranks) are left out. Arguments go to pytest and a later -m wins:
#   bash scripts/test.sh -m "not slow"    # the quick ones
#   bash scripts/test.sh -m full          # the exhaustive sets alone
#   bash scripts/test.sh -m ""            # everything
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
# --durations: the slowest tests, listed at the end, show where the suite's time goes.
# -n: pytest-xdist workers (TEST_WORKERS, default 2; 0 runs in this process). The tests that
# start gloo ranks all run on one worker (tests/conftest.py), the others share the rest.
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider --durations=15 -m "not full" \
    -n "${TEST_WORKERS:-2}" --dist loadgroup "$@"
