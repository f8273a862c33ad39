#!/usr/bin/env bash
# The test command: set up (idempotent), then run the whole suite against real SGLang servers.
# Extra arguments go to pytest. Exits non-zero if any test fails or if no test ran.
# PDD_TEST_WORKERS=N runs the suite on N parallel workers (default 2); a module's tests, and
# modules that share servers (tests/conftest.py SHARED), all run on one worker, so those servers
# start once. PDD_TEST_WORKERS=1 runs it serially.
set -euo pipefail
cd "$(dirname "$0")/.."
PDD_SKIP_SMOLLM2=1 bash launch/setup.sh
export PDD_TINY_MODEL="$PWD/models/tiny"
export PDD_WIDE_MODEL="$PWD/models/wide"
export PDD_MLA_MODEL="$PWD/models/mla"
# SGLang imports all of its ~260 model modules at every server start unless told which to skip;
# the suite's models need three of them (pdd/srt/model_archs.py). A value already set wins.
if [ -z "${SGLANG_DISABLED_MODEL_ARCHS:-}" ]; then
  SGLANG_DISABLED_MODEL_ARCHS=$(.venv/bin/python -m pdd.srt.model_archs \
    "$PDD_TINY_MODEL" "$PDD_WIDE_MODEL" "$PDD_MLA_MODEL")
  export SGLANG_DISABLED_MODEL_ARCHS
fi
workers=${PDD_TEST_WORKERS:-2}
parallel=()
if [ "$workers" != 1 ]; then
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
set +e
.venv/bin/python -m pytest "${parallel[@]}" "$@"
code=$?
set -e
if [ "$code" = 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
fi
exit "$code"
