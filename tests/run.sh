#!/usr/bin/env bash
# The test command: set up (idempotent), then run the whole suite against real SGLang servers.
# Extra arguments go to pytest. Exits non-zero if any test fails or if no test ran.
set -euo pipefail
cd "$(dirname "$0")/.."
PDD_SKIP_SMOLLM2=1 bash launch/setup.sh
export PDD_TINY_MODEL="$PWD/models/tiny"
export PDD_WIDE_MODEL="$PWD/models/wide"
export PDD_MLA_MODEL="$PWD/models/mla"
set +e
.venv/bin/python -m pytest "$@"
code=$?
set -e
if [ "$code" = 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
fi
exit "$code"
