# Sourced by scripts/demo.sh and scripts/test.sh: use the active virtualenv or create .venv, and
# install the package with the extras given as "$1" (e.g. "test"), adding `gpu` (CuPy, NVRTC and
# the CUDA headers, ~330 MB) only where nvidia-smi finds a GPU. On a machine without one, torch
# comes from PyTorch's CPU wheel index when it is not installed yet (PyPI's default torch is a
# multi-GB CUDA build).
if [ -z "${VIRTUAL_ENV:-}" ]; then
    [ -d .venv ] || python3 -m venv .venv
    . .venv/bin/activate
fi
infllm_has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; }
infllm_install() {
    local extras="$1"
    if infllm_has_gpu; then
        extras="gpu${extras:+,$extras}"
    elif ! python -c "import torch" >/dev/null 2>&1; then
        echo "installing torch (CPU wheel, about 200 MB; a few minutes the first time)..." >&2
        python -m pip install -q --disable-pip-version-check torch --index-url https://download.pytorch.org/whl/cpu
    fi
    echo "installing infllm-cupy${extras:+ with [$extras]} and its dependencies (quiet; minutes the first time)..." >&2
    python -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
}
