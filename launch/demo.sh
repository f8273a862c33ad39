#!/usr/bin/env bash
# The main job: set up this machine (idempotent), then run the local demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
exec .venv/bin/python -m pdd.launch.demo --model models/smollm2 "$@"
