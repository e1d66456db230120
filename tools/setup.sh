#!/usr/bin/env bash
# Create .venv and install flashinfer-lite with every extra. Idempotent: a second run only checks.
# torch is pinned and installed first: this version has a local CPU wheel; any other pulls GBs of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[train,dev,plot,serve]"
