"""benchmarks/bench_transformers.py runs as a user starts it (`python benchmarks/bench_transformers.py ...` from
the repository root): a tiny CPU run through the sparse regime, and the `--quick` CUDA run (GPU-marked)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
IMPLS = {"sdpa", "ours", "ours_dynamic"}


def run_bench(*args: str) -> tuple[subprocess.CompletedProcess, dict]:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_transformers.py"), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"exited with {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def check_rows(payload: dict, contexts: set[int]) -> None:
    rows = payload["rows"]
    assert payload["env"]["commit"] and payload["env"]["torch"] and payload["env"]["transformers"]
    assert {(row["impl"], row["context"]) for row in rows} == {(i, c) for i in IMPLS for c in contexts}
    for row in rows:
        assert "note" not in row, row
        assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0, row
    ratios = payload["ratios"]
    assert {(x["context"], x["impl"]) for x in ratios} == {(c, f"{i} / sdpa") for c in contexts
                                                           for i in ("ours", "ours_dynamic")}
    assert all(x["prefill"] > 0 and x["decode"] > 0 for x in ratios)


@pytest.mark.slow
def test_bench_transformers_runs_on_cpu(tmp_path):
    out = tmp_path / "hf.json"
    r = run_bench("--device", "cpu", "--dtype", "float32", "--contexts", "320", "--layers", "1", "--hidden", "128",
                  "--intermediate", "256", "--hq", "8", "--h", "2", "--d", "64", "--vocab", "64", "--dense-len", "256",
                  "--topk", "2", "--window", "64", "--new-tokens", "2", "--warmup-steps", "1", "--rep", "1",
                  "--json", str(out))
    payload = json.loads(out.read_text())
    check_rows(payload, {320})
    firsts = {row["first_token"] for row in payload["rows"] if row["impl"] != "sdpa"}
    assert len(firsts) == 1, payload["rows"]          # ours and ours_dynamic prefill identically
    assert "### ratios of tokens/s" in r.stdout


def test_bench_transformers_rejects_bad_arguments():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_transformers.py"), "--impls", "ours,flash"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--impls: unknown ['flash']" in r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_transformers.py"), "--hq", "6", "--h", "4"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--hq (6) must be a multiple of --h (4)" in r.stderr


@pytest.mark.gpu
def test_bench_transformers_quick_on_gpu(tmp_path):
    """The CUDA path at the --quick size (12k prompt: past dense_len 8192, so prefill and decode are sparse)."""
    out = tmp_path / "hf.json"
    run_bench("--quick", "--json", str(out))
    check_rows(json.loads(out.read_text()), {12 * 1024})
