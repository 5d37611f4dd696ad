#!/usr/bin/env bash
# Run the demo: the whole InfLLM-v2 pipeline on a synthetic long sequence (GPU when there is one,
# otherwise the CPU reference at a smaller size). Sets itself up like scripts/test.sh; arguments go
# to `python -m infllm_cupy demo` (--help lists them, without installing anything).
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
    if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then
        if [ -z "${VIRTUAL_ENV:-}" ] && [ -d .venv ]; then . .venv/bin/activate; fi
        # the checkout's package, installed or not; only torch must be importable
        if PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" python -m infllm_cupy demo --help 2>/dev/null; then exit 0; fi
        echo "usage: scripts/demo.sh [demo options]"
        echo "Creates .venv (or uses the active virtualenv), installs the package, and runs"
        echo "'python -m infllm_cupy demo'. The options are listed once torch is installed: run it once,"
        echo "or see README.md."
        exit 0
    fi
done
. scripts/_setup.sh
infllm_install ""
python -m infllm_cupy demo "$@"
