import importlib.util
import os

import pytest
import torch

# Every kernel output is allocated NaN-filled, so an element a kernel never writes fails its test.
os.environ.setdefault("INFLLM_CUPY_POISON", "1")


def _why_no_gpu() -> str | None:
    """None when the GPU tests can run here, else why not (for the skip reason and the summary line)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    if importlib.util.find_spec("cupy") is None:
        return 'CuPy not installed (pip install -e ".[gpu]")'
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return None
    except Exception:  # noqa: BLE001 - a broken CuPy or driver is reported as no GPU
        pass
    return "CuPy sees no CUDA GPU"


def _has_nvrtc() -> bool:
    from infllm_cupy._cupy import has_nvrtc

    return has_nvrtc()


# Hypothesis profiles of the fuzz tests (tests/fuzz, docs/reliability.md): derandomized, so a run is
# reproducible; "fuzz-ci" (the default) is the CPU share's small budget, "fuzz-device" the GPU run's
# (pytest -m gpu tests/fuzz --hypothesis-profile=fuzz-device), "fuzz-smoke" a quick look.
try:
    from hypothesis import HealthCheck, settings

    _FUZZ = dict(derandomize=True, deadline=None, print_blob=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.filter_too_much])
    settings.register_profile("fuzz-ci", max_examples=40, **_FUZZ)
    settings.register_profile("fuzz-smoke", max_examples=3, **_FUZZ)
    settings.register_profile("fuzz-device", max_examples=500, **_FUZZ)
    settings.load_profile("fuzz-ci")
except ImportError:  # the fuzz tests skip themselves without hypothesis
    pass

WHY_NO_GPU = _why_no_gpu()
HAS_GPU = WHY_NO_GPU is None
# an H100 / H200: the sm_90a kernels (wgmma, TMA) run, and the plans choose them
HOPPER = HAS_GPU and torch.cuda.get_device_capability() == (9, 0)
HAS_NVRTC = _has_nvrtc()
GPU_SKIP = "needs a CUDA GPU and CuPy"
NVRTC_SKIP = "needs NVRTC and the CUDA headers (the gpu extra; no GPU)"
# tests/test_jit.py's tests that compile with NVRTC (on CPU, without a GPU): skipped where the gpu
# extra is not installed; a test marked `nvrtc` anywhere is treated the same way
NVRTC_TESTS = {"test_every_kernel_compiles_without_a_gpu",
               "test_compile_error_names_the_kernel_and_shows_the_log",
               "test_installed_wheel_finds_and_compiles_its_kernels",
               "test_wgmma_rates_tool_compiles_without_a_gpu"}

# Stage-2 kernel cases, forward and backward: (lengths_q, lengths_k, HQ, H, D). Ragged batches,
# lengths not multiples of 64, one-token sequences, G from 1 to 32 (a non-power of two among them),
# queries shorter than keys (bottom-right causal alignment) and a sequence past 2048 tokens.
STAGE2_CASES = [
    ([1000], [1000], 32, 2, 128),
    ([1, 63, 64, 65, 300], [1, 63, 64, 65, 300], 16, 1, 64),
    ([513, 1], [513, 1], 8, 2, 128),
    ([200, 777], [200, 777], 32, 1, 128),
    ([333, 17], [333, 17], 2, 2, 64),
    ([129, 70], [129, 70], 4, 2, 64),
    ([129, 70], [129, 70], 1, 1, 128),
    ([260], [260], 24, 2, 128),
    ([100, 37, 5], [700, 37, 64], 16, 1, 128),
    ([2100, 90], [2100, 90], 4, 2, 64),
]
STAGE2_IDS = [f"Lq{'-'.join(map(str, c[0]))}_Lk{'-'.join(map(str, c[1]))}_HQ{c[2]}_H{c[3]}_D{c[4]}"
              for c in STAGE2_CASES]


def pytest_collection_modifyitems(config, items):
    # skipif(True) put first, so that this reason wins over a test's own skipif (e.g. "needs sm_90a")
    skip_gpu = pytest.mark.skipif(True, reason=f"{GPU_SKIP}: {WHY_NO_GPU}")
    skip_nvrtc = pytest.mark.skipif(True, reason=NVRTC_SKIP)
    for item in items:
        if item.path.name == "test_jit.py" and getattr(item, "originalname", item.name) in NVRTC_TESTS:
            item.add_marker(pytest.mark.nvrtc)
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu, append=False)
        elif "nvrtc" in item.keywords and not HAS_NVRTC:
            item.add_marker(skip_nvrtc, append=False)


_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def share_in_words(n: int, total: int) -> str:
    """`n` of `total` as the nearest simple fraction in words: "about two in three", "about half", "all"
    (denominators up to 5; below one in ten "fewer than one in ten", above nine in ten "nearly all")."""
    if total <= 0 or n <= 0:
        return "none"
    if n >= total:
        return "all"
    share = n / total
    if share < 0.1:
        return "fewer than one in ten"
    if share > 0.9:
        return "nearly all"
    p, q = min(((p, q) for q in range(2, 6) for p in range(1, q)),
               key=lambda f: (abs(share - f[0] / f[1]), f[1]))
    return "about half" if 2 * p == q else f"about {_WORDS[p]} in {_WORDS[q]}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line that says why tests were skipped, and whether everything that ran passed."""
    stats = terminalreporter.stats

    skips = stats.get("skipped", [])
    n_gpu = sum(1 for r in skips if "gpu" in r.keywords and not HAS_GPU)
    n_nvrtc = sum(1 for r in skips if "nvrtc" in r.keywords and "gpu" not in r.keywords and not HAS_NVRTC)
    n_other = len(skips) - n_gpu - n_nvrtc
    if not (n_gpu or n_nvrtc):
        return
    n_passed = len(stats.get("passed", []))
    n_bad = len(stats.get("failed", [])) + len(stats.get("error", []))
    n_all = sum(len(stats.get(k, [])) for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed"))
    parts = []
    if n_gpu:
        are = "is a GPU test" if n_gpu == 1 else "are GPU tests"
        parts.append(f"{n_gpu} of the {n_all} tests ({share_in_words(n_gpu, n_all)}) {are}, skipped: "
                     f"{WHY_NO_GPU} (pytest -m gpu runs them on a CUDA GPU)")
    if n_nvrtc:
        parts.append(f'{n_nvrtc} NVRTC compile tests skipped: CuPy/NVRTC not installed (pip install -e '
                     '".[gpu,test]" '
                     f"runs them, no GPU needed)")
    if n_other:
        parts.append(f"{n_other} skipped for other reasons (pytest -rs lists them)")
    verdict = (f"the {n_passed} tests that ran passed" if not n_bad and exitstatus == 0
               else f"{n_bad} failed or errored, see above")
    terminalreporter.write_line("; ".join(parts) + "; " + verdict, bold=True, green=not n_bad,
                                red=bool(n_bad))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
