#!/usr/bin/env bash
# Run the test suite. Sets itself up on a fresh machine: uses the active virtualenv, or creates
# .venv; installs the package with its test extras (and the gpu extra where nvidia-smi finds a GPU);
# runs pytest. GPU tests run when a CUDA GPU is present and are skipped otherwise (the last lines
# say how many and why). Tests marked `slow` (the NVRTC compile of every kernel, the benchmark
# scripts on CPU) are left out unless the first argument is --all (CI passes it) or the arguments
# choose their own markers with -m. Other arguments go to pytest (e.g. -m gpu, -k compress).
set -euo pipefail
cd "$(dirname "$0")/.."
all=0
if [ "${1:-}" = "--all" ]; then all=1; shift; fi
markers=(-m "not slow")
if [ "$all" -eq 1 ] || printf '%s\n' "$@" | grep -qx -- '-m'; then markers=(); fi
. scripts/_setup.sh
infllm_install test
set +e
python -m pytest -q ${markers[@]+"${markers[@]}"} "$@"
rc=$?
set -e
# pytest exits 5 when a selection collects no tests (e.g. -m gpu on a tree without GPU tests)
if [ "$rc" -eq 5 ]; then exit 0; fi
exit "$rc"
