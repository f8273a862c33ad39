#!/usr/bin/env bash
# Runs the test command N times in a row (fresh servers each time) and counts the passing runs:
#   bash tests/repeat.sh 3 tests/test_router_paths.py [more pytest args]
# Exits non-zero unless every run passed; each run's output is in runs/repeat/run-K.log.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:?usage: tests/repeat.sh N [pytest args...]}
shift
mkdir -p runs/repeat
passed=0
for k in $(seq 1 "$n"); do
  start=$(date +%s)
  if bash tests/run.sh "$@" > "runs/repeat/run-$k.log" 2>&1; then
    passed=$((passed + 1)); result=passed
  else
    result=FAILED
  fi
  echo "run $k/$n: $result in $(( $(date +%s) - start ))s ($(tail -1 "runs/repeat/run-$k.log"))"
done
echo "$passed of $n runs passed"
[ "$passed" = "$n" ]
