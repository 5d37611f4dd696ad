#!/usr/bin/env bash
# Run the demo: the whole InfLLM-v2 pipeline on a synthetic long sequence (GPU when there is one,
# otherwise the CPU reference at a smaller size). Sets itself up like scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
    [ -d .venv ] || python3 -m venv .venv
    . .venv/bin/activate
fi
python -m pip install -q --disable-pip-version-check -e .
python -m infllm_cupy demo "$@"
