#!/usr/bin/env bash
# Run the test suite. Sets itself up on a fresh machine: uses the active virtualenv, or creates
# .venv; installs the package with its test extras; runs pytest. GPU tests run when a CUDA GPU is
# present and are skipped otherwise. Extra arguments go to pytest (e.g. -m gpu, -k compress).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
    [ -d .venv ] || python3 -m venv .venv
    . .venv/bin/activate
fi
python -m pip install -q --disable-pip-version-check -e ".[test]"
set +e
python -m pytest -q "$@"
rc=$?
set -e
# pytest exits 5 when a selection collects no tests (e.g. -m gpu on a tree without GPU tests)
if [ "$rc" -eq 5 ]; then exit 0; fi
exit "$rc"
