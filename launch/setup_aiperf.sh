#!/usr/bin/env bash
# aiperf, a benchmark client people use for PD serving, in its own virtual environment
# (.venv-aiperf): it pins pyzmq 26 while SGLang needs 27. Versions: requirements/aiperf.txt.
# Idempotent. Then: .venv-aiperf/bin/aiperf profile ... (README: "the usual benchmark clients").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-aiperf
stamp="$VENV/.pdd-setup-$(sha1sum requirements/aiperf.txt | cut -c1-12)"
if [ -f "$stamp" ]; then
  echo "[setup-aiperf] $VENV is up to date"
  exit 0
fi
"$PYTHON" -m venv "$VENV"
rc=0
out=$("$VENV/bin/pip" --disable-pip-version-check --no-cache-dir -q install \
  -r requirements/aiperf.txt 2>&1) || rc=$?
printf '%s\n' "$out" | grep -v "^WARNING: Location '" || true
[ "$rc" = 0 ] || { echo "[setup-aiperf] pip failed ($rc)" >&2; exit "$rc"; }
"$VENV/bin/aiperf" --version >/dev/null
touch "$stamp"
echo "[setup-aiperf] aiperf installed in $VENV"
