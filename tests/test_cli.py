"""The command line (`python -m infllm_cupy`): conventions, the demo's option checks, scripts/demo.sh --help,
the install hint when the gpu extra is missing, and the test suite's closing line on a CPU."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import infllm_cupy
from infllm_cupy.__main__ import build_parser, main

REPO = Path(__file__).resolve().parents[1]


def small_args(head_dim: int = 32) -> list[str]:
    """Small enough to run in about a second on a CPU, with a budget (K = 6 of 32 blocks) that leaves the
    selection a choice, so that retrieval can show. The CUDA kernels take head dims 64 and 128 only
    (`_rules.HEAD_DIMS`): a CUDA run passes 64."""
    return ["--tokens", "2048", "--heads", "4", "--kv-heads", "2", "--head-dim", str(head_dim), "--topk", "4",
            "--local-blocks", "2"]


SMALL = small_args()


def run_cli(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "infllm_cupy", *args], cwd=cwd or REPO, capture_output=True,
                          text=True, env=env, timeout=300)


def test_help_version_and_no_arguments():
    r = run_cli("--help")
    assert r.returncode == 0 and "usage: python -m infllm_cupy" in r.stdout and "demo" in r.stdout, r
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"infllm-cupy {infllm_cupy.__version__}", r
    r = run_cli()      # no command: the help, and a failure status (nothing was done)
    assert r.returncode == 2 and "usage: python -m infllm_cupy" in r.stderr and "demo" in r.stderr, r
    r = run_cli("frobnicate")
    assert r.returncode == 2 and "invalid choice: 'frobnicate'" in r.stderr and "Traceback" not in r.stderr, r


def test_demo_help_shows_every_option_with_help_and_default(capsys):
    parser = build_parser(has_gpu=False)
    demo = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["demo"]
    options = [a for a in demo._actions if a.option_strings and a.dest != "help"]
    assert {a.option_strings[0] for a in options} >= {"--tokens", "--device", "--heads", "--kv-heads",
                                                      "--head-dim",
                                                     "--needles", "--topk", "--local-blocks", "--png"}
    for a in options:
        assert a.help and len(a.help) > 10, f"{a.option_strings[0]} has no help"
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())     # help lines wrap with the terminal width
    assert "(default: 32768)" in out, out
    assert "(default: infllm_selection.png)" in out and "K = topk + local-blocks" in out, out


def _demo_error(capsys, *args) -> str:
    """Run the demo in-process with a bad option: argparse's exit status 2 and its one-line message."""
    with pytest.raises(SystemExit) as e:
        main(["demo", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "usage: python -m infllm_cupy demo" in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("args, message", [
    (["--tokens", "0"], "argument --tokens: must be at least 256, got 0"),
    (["--tokens", "-5"], "argument --tokens: must be at least 256, got -5"),
    (["--tokens", "4k"], "argument --tokens: expected an integer, got '4k'"),
    (["--tokens", "300"], "argument --tokens: at least 1024 tokens for 4 needle(s)"),
    (["--tokens", "500", "--needles", "2"], "argument --tokens: at least 512 tokens for 2 needle(s)"),
    (["--needles", "-1"], "argument --needles: must be at least 1, got -1"),
    (["--needles", "0"], "argument --needles: must be at least 1, got 0: with no needle there is nothing to "
                         "retrieve"),
    (["--needles", "0", "--control"], "argument --needles: must be at least 1, got 0"),
    (["--heads", "3"], "argument --heads: 3 query heads is not a multiple of --kv-heads 2"),
    (["--kv-heads", "0"], "argument --kv-heads: must be at least 1, got 0"),
    (["--head-dim", "0"], "argument --head-dim: must be at least 1, got 0"),
    (["--topk", "1"], "argument --topk: must be at least 2, got 1"),
    (["--tokens", "99999999999"], "lower --tokens or --heads"),
    (["--heads", "100000000", "--kv-heads", "1"], "lower --tokens or --heads"),
    (["--local-blocks", "-1"], "argument --local-blocks: must be at least 0, got -1"),
    (["--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (["--device", "mps"], "argument --device: expected cpu, cuda or cuda:N, got 'mps'"),
    (["--png", ""], "argument --png: empty path"),
    (["--png", "/nonexistent-dir/x.png"], "argument --png: the directory '/nonexistent-dir' does not exist"),
])
def test_demo_rejects_bad_options_naming_them(capsys, args, message):
    assert message in _demo_error(capsys, *args)


def test_demo_png_that_is_a_directory(capsys, tmp_path):
    assert f"argument --png: '{tmp_path}' is a directory" in _demo_error(capsys, "--png", str(tmp_path))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a CUDA GPU")
def test_demo_device_cuda_without_a_gpu(capsys):
    err = _demo_error(capsys, "--device", "cuda")
    assert "argument --device: 'cuda', but torch sees no CUDA GPU here" in err and "--device cpu" in err, err


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs a path whose parent exists but takes no files")
def test_demo_png_write_failure_after_the_run_is_a_message(tmp_path):
    r = run_cli("demo", *SMALL, "--needles", "1", "--png", "/proc/infllm_selection.png", cwd=tmp_path)
    assert r.returncode == 2, r
    assert "error: argument --png: cannot write '/proc/infllm_selection.png'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_demo_runs_on_cpu_and_writes_the_png(tmp_path):
    png = tmp_path / "sel.png"
    r = run_cli("demo", *SMALL, "--device", "cpu", "--png", str(png), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    # the header states the budget as the config defines it: forced blocks inside K
    assert ("K = topk 4 + local_blocks 2 = 6 blocks of 64 keys per token: 1 init + 3 local (the query's own "
            "block and the 2 before it) forced, 2 by score") in r.stdout, r.stdout
    assert "stage timings (ms, one run of each, every stage on its CPU implementation)" in r.stdout, r.stdout
    assert "stage 2 sparse attention [cpu]" in r.stdout, r.stdout
    gains = [float(x) for x in re.findall(r"gain (\d\.\d\d) of \d+ pairs", r.stdout)]
    assert len(gains) == 4 and min(gains) >= 0.5, r.stdout
    assert "retrieved: every needle's block is selected in at least" in r.stdout, r.stdout
    assert png.stat().st_size > 1000
    # output is not a terminal: no progress bar in either stream
    assert "stage/s" not in r.stderr and "it/s" not in r.stderr and "\r" not in r.stdout + r.stderr, r.stderr


def _demo_retrieval(device, *extra, cwd, args=None):
    args = small_args(32 if device == "cpu" else 64) if args is None else args
    r = run_cli("demo", *args, "--device", device, "--no-png", *extra, cwd=cwd)
    gains = [float(x) for x in re.findall(r"gain (\d\.\d\d) of \d+ pairs", r.stdout)]
    return r, gains


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_demo_fails_its_control_and_passes_the_real_sequence(tmp_path, device):
    # the same keys, the needle blocks included; only the queries that look for them differ
    real, real_gains = _demo_retrieval(device, cwd=tmp_path)
    ctrl, ctrl_gains = _demo_retrieval(device, "--control", cwd=tmp_path)
    assert real.returncode == 0 and len(real_gains) == 4 and min(real_gains) >= 0.5, real.stdout + real.stderr
    assert ctrl.returncode == 1, ctrl.stdout + ctrl.stderr
    assert ctrl_gains == [0.0] * 4, ctrl.stdout            # the control's gain is 0 by construction
    assert "control: the needle keys are planted, the queries that look for them are not" in ctrl.stdout
    assert "no retrieval: the needle(s) in key block(s)" in ctrl.stderr, ctrl.stderr
    assert "(--control: expected)" in ctrl.stderr, ctrl.stderr
    assert "Traceback" not in ctrl.stderr and "retrieved" not in ctrl.stdout


@pytest.mark.parametrize("extra, status, says", [
    # the settings: a window that forces the needle blocks passed the control; 2048 tokens and
    # --topk 16 failed the real run, whose needles were all found
    (["--control", "--topk", "2", "--local-blocks", "42"], 1, "forced for every query of its run"),
    (["--control", "--topk", "4", "--local-blocks", "42"], 1, "(--control: expected)"),
    (["--topk", "4", "--local-blocks", "42"], 1, "lower --local-blocks or raise --tokens"),
    (["--topk", "2"], 1, "no slot by score: raise --topk"),
    (["--tokens", "2048"], 0, "retrieved: every needle's block"),
    (["--topk", "16"], 0, "retrieved: every needle's block"),
    (["--control", "--topk", "16"], 1, "(--control: expected)"),
])
def test_demo_retrieval_check_cannot_be_fooled(tmp_path, extra, status, says):
    args = ["--tokens", "4096", "--heads", "4", "--kv-heads", "2", "--head-dim", "32"]   # the CPU budget
    r, gains = _demo_retrieval("cpu", *extra, cwd=tmp_path, args=args)
    assert r.returncode == status and says in r.stdout + r.stderr, r.stdout + r.stderr
    if status == 0:
        assert len(gains) == 4 and min(gains) >= 0.5, r.stdout
    if "--control" in extra:
        assert all(g == 0.0 for g in gains), r.stdout


def test_demo_without_room_to_choose_fails_with_a_hint(tmp_path):
    # K = 12 slots of 16 blocks: every query picks nearly every block, so no lift can show
    r = run_cli("demo", "--tokens", "1024", "--heads", "4", "--head-dim", "32", "--topk", "8",
                "--local-blocks", "4", "--no-png", cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no retrieval" in r.stderr and "lower --topk or raise --tokens" in r.stderr, r.stderr


def test_installed_script_names_itself(tmp_path):
    script = Path(sys.executable).with_name("infllm-cupy")
    if not script.exists():
        pytest.skip("the infllm-cupy script is not installed next to this Python")
    r = subprocess.run([str(script), "demo", "--help"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("usage: infllm-cupy demo"), r.stdout[:200]


def test_demo_no_png(tmp_path):
    r = run_cli("demo", *SMALL, "--needles", "1", "--no-png", cwd=tmp_path)
    assert r.returncode == 0 and "wrote" not in r.stdout and not list(tmp_path.iterdir()), r


def test_demo_sh_help_does_not_install(tmp_path):
    """scripts/demo.sh --help prints the demo's help without running pip (a shim records every python
    call)."""
    shim = tmp_path / "bin"
    shim.mkdir()
    log = tmp_path / "calls.log"
    (shim / "python").write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec {sys.executable} "$@"\n')
    (shim / "python").chmod(0o755)
    env = dict(os.environ, PATH=f"{shim}:{os.environ['PATH']}", VIRTUAL_ENV=sys.prefix)
    r = subprocess.run(["bash", str(REPO / "scripts" / "demo.sh"), "--help"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and "usage: python -m infllm_cupy demo" in r.stdout, r
    calls = log.read_text().splitlines()
    assert calls and not any("pip" in c for c in calls), calls


def test_missing_cupy_names_the_gpu_extra():
    """A CUDA tensor on an install without the gpu extra: ImportError naming the extra, not a bare
    ModuleNotFoundError (run in a child whose `import cupy` fails)."""
    probe = ("import sys; sys.modules['cupy'] = None; sys.modules['cupy_backends'] = None\n"
             "from infllm_cupy._cupy import import_cupy, import_nvrtc, has_nvrtc\n"
             "assert not has_nvrtc()\nfor f in (import_cupy, import_nvrtc):\n"
             "    try:\n        f()\n    except ImportError as e:\n"
             "        print(e)\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2, r
    assert all('pip install "infllm-cupy[gpu]"' in line for line in lines), lines


def test_share_in_words():
    from conftest import share_in_words

    assert share_in_words(1572, 2363) == "about two in three"
    assert [share_in_words(n, 100) for n in (0, 5, 20, 50, 75, 80, 95, 100)] == [
        "none", "fewer than one in ten", "about one in five", "about half", "about three in four",
        "about four in five", "nearly all", "all"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run here: no skip line")
def test_suite_skip_line_counts_the_gpu_tests(tmp_path):
    """On a CPU the suite's closing line says how many of the tests that were collected are GPU tests
    (skipped), as a count and in words, and how many ran; its numbers are pytest's own."""
    from conftest import share_in_words

    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_env.py",
                          "tests/patterns/test_formats.py"],
                         cwd=REPO, capture_output=True, text=True).stdout
    line = re.search(r"^(\d+) of the (\d+) tests \((.+?)\) (?:are GPU tests|is a GPU test), skipped: "
                     r".*; the (\d+) tests that ran passed$", out, re.M)
    final = re.search(r"^(\d+) passed, (\d+) skipped", out, re.M)
    assert line and final, out[-2000:]
    n_gpu, n_all, words, n_ran = int(line[1]), int(line[2]), line[3], int(line[4])
    assert (n_ran, n_gpu) == (int(final[1]), int(final[2])) and n_all == n_ran + n_gpu, out[-2000:]
    assert words == share_in_words(n_gpu, n_all) and n_gpu > 0
