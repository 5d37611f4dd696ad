"""The user-facing benchmark scripts run on CPU: each is started as a user starts it
(`python benchmarks/<script>.py ...` from the repository root) and checked through its printed
output and its `--json` rows. Tests never import `benchmarks/`."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGE2_IMPLS = ("ours", "sdpa_cudnn", "sdpa_flash", "flex_same", "flex_union", "nsa")


def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{script} exited with {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def json_rows(path: Path) -> list[dict]:
    payload = json.loads(path.read_text())
    assert payload["env"]["commit"] and payload["env"]["torch"]     # every run names its commit and versions
    return payload["rows"]


@pytest.mark.slow
def test_bench_stage2_runs_on_cpu(tmp_path):
    out = tmp_path / "stage2.json"
    r = run_script("bench_stage2.py", "--device", "cpu", "--configs", "256x1", "--K", "4", "--hq", "4", "--h",
                   "1", "--d", "32", "--warmup", "0", "--rep", "1", "--skip-check", "--budget-s", "0",
                   "--impls", ",".join(STAGE2_IMPLS), "--json", str(out))
    rows = json_rows(out)
    assert {row["impl"] for row in rows} == set(STAGE2_IMPLS)
    assert {row["config"] for row in rows} == {"B1-T256-HQ4-H1-D32"}      # "256x1": T = 256 tokens, B = 1
    flex = [row for row in rows if row["impl"].startswith("flex")]
    assert flex and all(row["ms"] is not None and row["tflops"] is not None for row in flex)
    assert all(row["note"] for row in rows if row["ms"] is None)         # failures are recorded, not raised
    assert "ms per implementation (median)" in r.stdout and "anchor ms / ours ms" in r.stdout


@pytest.mark.slow
def test_bench_cpu_runs(tmp_path):
    """The CPU benchmark: the matmul floor, stage 2 and the oracle on two lengths, each row with its
    selected work, rate, floor and memory; the goal line appears only with a 32k row."""
    out = tmp_path / "cpu.json"
    r = run_script("bench_cpu.py", "--lengths", "512,1k", "--selections", "demo,b", "--hq", "4", "--h", "2",
                   "--d", "64", "--warmup", "0", "--rep", "1", "--oracle-max", "512", "--json", str(out))
    assert "check PASSED" in r.stdout and "fp32 matmul:" in r.stdout and "goal:" not in r.stdout
    rows = json_rows(out)
    floor = [row for row in rows if row["impl"] == "matmul_fp32"]
    assert [row["config"] for row in floor] == ["1024^3", "2048^3"]
    assert all(row["gflops"] > 0 for row in floor)
    timed = [row for row in rows if row["impl"] != "matmul_fp32" and row["ms"] is not None]
    assert {(row["impl"], row["config"], row["selection"]) for row in timed} == {
        ("stage2", f"T{T}-HQ4-H2-D64", sel) for T in (512, 1024) for sel in ("demo", "b")} | {
        ("oracle", "T512-HQ4-H2-D64", sel) for sel in ("demo", "b")}
    for row in timed:
        assert row["gflop"] > 0 and row["gflops"] > 0 and row["floor_ms"] > 0
        assert row["over_floor"] == pytest.approx(row["ms"] / row["floor_ms"])
    skipped = [row for row in rows if row["ms"] is None and row["impl"] == "oracle"]
    assert skipped and all(row["note"].startswith("skipped: T > --oracle-max") for row in skipped)


# On CPU "auto" runs stage 1's CPU implementation, which has no separate steps; the reference has them.
@pytest.mark.parametrize("script,backend,impls", [
    ("bench_pipeline.py", "auto", "selection,stage2,pipeline,sdpa_cudnn"),
    ("bench_stage1.py", "auto", "compress_fine,stage1_select,selection,sdpa_cudnn"),
    ("bench_stage1.py", "reference", "compress_fine,stage1_select,scores,pool,topk,selection"),
])
def test_bench_pipeline_and_stage1_help_and_cpu_run(script, backend, impls, tmp_path):
    assert "--max-configs" in run_script(script, "--help").stdout
    out = tmp_path / "rows.json"
    r = run_script(script, "--device", "cpu", "--backend", backend, "--configs", "300x2,256x1",
                   "--max-configs", "1", "--topk", "2",
                   "--local-blocks", "1", "--hq", "4", "--h", "2", "--d", "64", "--warmup", "0", "--rep", "1",
                   "--budget-s", "0", "--impls", impls, "--json", str(out))
    assert "check PASSED" in r.stdout
    rows = json_rows(out)
    assert {row["impl"] for row in rows} == set(impls.split(","))
    assert {row["config"] for row in rows} == {"B2-T300-HQ4-H2-D64"}     # --max-configs 1: the first only
    assert all(row["ms"] is not None and row["ms"] > 0 for row in rows), [(row["impl"],
                                                                           row["note"]) for row in rows]


def test_bench_cpu_stage1_runs(tmp_path):
    out = tmp_path / "cpu_stage1.json"
    r = run_script("bench_cpu_stage1.py", "--tokens", "300,1k", "--hq", "4", "--h", "2", "--d", "32",
                   "--rep", "1", "--oracle", "--threads", "2", "--json", str(out))
    assert "fp32 GEMM floor (torch.matmul, 2048^2, 2 threads)" in r.stdout, r.stdout
    payload = json.loads(out.read_text())
    assert payload["env"]["commit"] and payload["floor_gflops"] > 0
    rows = payload["rows"]
    impls = ("compress", "stage1", "oracle_compress", "oracle_stage1")
    assert {(row["impl"], row["T"]) for row in rows} == {(i, T) for i in impls for T in (300, 1024)}
    stage1 = [row for row in rows if row["impl"] == "stage1"]
    assert all(row["s"] > 0 and row["gflops"] > 0 and row["of_floor"] > 0 for row in stage1)
    assert stage1[1]["growth_T2"] == (1024 / 300) ** 2


DECODE_IMPLS = ("ours_sparse", "ours_step", "ours_dense", "ours_sparse_kvh", "ours_step_kvh",
                "ours_dense_kvh",
                "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math", "flex", "eager_grouped",
                "eager_hf", "flashinfer")


def test_bench_decode_runs_on_cpu(tmp_path):
    out = tmp_path / "decode.json"
    r = run_script("bench_decode.py", "--device", "cpu", "--configs", "2x1k", "--hq", "4", "--h", "2", "--d",
                   "64",
                   "--topk", "4", "--local-blocks", "2", "--warmup", "0", "--rep", "1", "--budget-s", "0",
                   "--check", "--json", str(out))
    payload = json.loads(out.read_text())
    rows = json_rows(out)
    assert {row["impl"] for row in rows} == {"copy", *DECODE_IMPLS}
    assert {row["config"] for row in rows} == {"-", "2x1k"}
    ours = [row for row in rows if row["impl"].startswith("ours")]
    # every ours row with and without weights (the per-KV-head rows with weights only); on CPU they run the
    # references and must time
    assert sorted((row["impl"], row["weights"]) for row in ours) == sorted(
        [(i, w) for i in ("ours_sparse", "ours_step", "ours_dense") for w in (False, True)]
        + [(i + "_kvh", True) for i in ("ours_sparse", "ours_step", "ours_dense")])
    assert all(row["us"] > 0 and row["bytes"] > 0 and row["gbps"] > 0 for row in ours)
    # bytes: sparse reads K = 6 blocks of 64 keys x 2 KV heads x D 64 x (K, V) x 2 bytes per sequence, + q and
    # out; dense reads all 1024 keys; weights add fp32 [B, HQ, L]
    qo = 2 * 2 * 4 * 64 * 2
    by = {(row["impl"], row["weights"]): row["bytes"] for row in ours}
    assert by[("ours_sparse", False)] == 2 * 2 * 2 * 6 * 64 * 64 * 2 + qo
    assert by[("ours_dense", False)] == 2 * 2 * 1024 * 2 * 64 * 2 + qo
    assert by[("ours_dense", True)] - by[("ours_dense", False)] == 2 * 4 * 1024 * 4
    for i in ("ours_sparse", "ours_step", "ours_dense"):                    # per KV head: fp32 [B, H, L]
        assert by[(i + "_kvh", True)] - by[(i, False)] == 2 * 2 * 1024 * 4
    assert by[("ours_step", False)] > by[("ours_sparse", False)]             # + the compressed keys
    flashinfer = next(row for row in rows if row["impl"] == "flashinfer")
    assert flashinfer["us"] is not None or flashinfer["note"].startswith("not run")
    assert all(row["note"] for row in rows if row["us"] is None)           # failures are recorded, not raised
    goals = {g["goal"] for g in payload["goals"]}
    assert "ours_dense with weights / without (eager)" in goals
    assert "ours dense / fastest dense anchor (eager)" in goals
    assert "ours_dense with weights / without, per KV head (eager)" in goals
    assert payload["check"] and all(" ok " in c for c in payload["check"]), payload["check"]
    assert "### Goals (decode kernels)" in r.stdout and "| config | impl |" in r.stdout
    # host time per call: every eager row of ours and of the SDPA anchors that timed, no other row
    for row in rows:
        host = row["us"] is not None and row["mode"] == "eager" and (
            row["impl"].startswith("ours") or row["impl"].startswith("sdpa"))
        assert (row["host_us"] is not None and row["host_us"] > 0) == host, row
    assert "| us | host us |" in r.stdout
    g38 = {(g["goal"], g["config"]): g for g in payload["goals_38"]}
    step = next(row for row in ours if row["impl"] == "ours_step" and not row["weights"])
    assert g38[("host us per eager ours_step", "2x1k")]["value"] == round(step["host_us"], 1)
    assert g38[("host us per eager ours_step", "2x1k")]["target"] == "<= 60"
    assert "### Goals (eager calls)" in r.stdout
    assert "goals: eager calls at 1x128k, 8x32k, 8x128k, 64x32k: " in r.stdout
    assert "not run: 1x128k, 8x32k, 8x128k, 64x32k" in payload["goals_38_summary"]


PATTERNS = ("local_stride", "local_stride_sliding", "per_head", "sliding_tile", "sparge")


def test_bench_patterns_runs_on_cpu(tmp_path):
    out = tmp_path / "patterns.json"
    r = run_script("bench_patterns.py", "--device", "cpu", "--warmup", "0", "--rep", "1", "--budget-s", "0",
                   "--json", str(out))
    payload = json.loads(out.read_text())
    rows = json_rows(out)
    assert {row["config"] for row in rows} == {"B1-T2K-HQ4-H2-D32"}       # CPU default: 2048x1, small heads
    assert {row["selection"] for row in rows if row["impl"] in ("ours", "flex")} == set(PATTERNS)
    assert {row["mode"] for row in rows} == {"fwd", "fwdbwd"}
    built = {row["selection"] for row in rows if row["impl"] == "ours" and "not built yet" not in row["note"]}
    assert built == set(PATTERNS)
    predict = [row for row in rows if row["impl"] == "predict"]
    assert len(predict) == 1 and predict[0]["ms"] > 0 and predict[0]["selection"] == "sparge"
    for row in rows:
        if row["impl"] == "ours" and row["selection"] in built:
            # on CPU ours runs the reference, forward and backward; density and FLOP come with every row
            assert row["ms"] > 0 and row["tflops"] > 0 and 0 < row["density"] <= 1, row
        if row["ms"] is None:
            assert row["note"], row                                        # failures are recorded, not raised
    ours = {(row["selection"], row["mode"]): row for row in rows if row["impl"] == "ours"}
    # head-sliding strides differ inside a KV head's group: ours runs with K/V repeated per query head
    assert "KV repeated" in ours[("local_stride_sliding", "fwd")]["note"]
    assert "KV repeated" not in ours[("local_stride", "fwd")]["note"]
    assert ours[("per_head", "fwd")]["density"] < 1
    dense = [row for row in rows if row["impl"] == "dense"]
    assert dense and all(row["ms"] > 0 and row["density"] == 1.0 for row in dense)
    # every built pattern's BlockMask makes FlexAttention compute exactly ours' (query, key) pairs
    assert payload["check"].startswith("check (T=2048) PASSED"), payload["check"]
    assert all(f"{p}: ok (0 pairs differ" in payload["check"] for p in PATTERNS), payload["check"]
    goals = {(g["pattern"], g["mode"]): g for g in payload["goals"]}
    fwd = goals[("local_stride", "fwd")]
    assert fwd["ours/(dens*dense)"] == pytest.approx(fwd["ours_ms"] / (fwd["density"] * fwd["dense_ms"]))
    assert fwd["flex/ours"] == pytest.approx(fwd["flex_ms"] / fwd["ours_ms"])
    assert fwd["goals"] == "n/a (cpu)"                                      # no verdict from references
    assert "| config | pattern | mode | density |" in r.stdout and "goals: flex/ours >= 1.2" in r.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_patterns.py"), "--device", "cpu",
                          "--patterns", "local_stride,nope"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--patterns: unknown ['nope']" in bad.stderr


@pytest.mark.gpu
def test_bench_patterns_quick_on_gpu(tmp_path):
    """The CUDA path: compiled FlexAttention with our BlockMasks, cuDNN SDPA and our kernels, every pattern,
    forward and forward+backward, at the --quick size (8kx2, README heads)."""
    out = tmp_path / "patterns.json"
    run_script("bench_patterns.py", "--quick", "--budget-s", "0", "--json", str(out))
    payload = json.loads(out.read_text())
    rows = json_rows(out)
    assert payload["check"].startswith("check (T=2048) PASSED"), payload["check"]
    timed = [row for row in rows if row["impl"] in ("ours", "flex", "dense")]
    assert {row["selection"] for row in timed if row["impl"] == "ours"} == set(PATTERNS)
    assert all(row["ms"] and row["ms"] > 0 for row in timed), \
        [(row["impl"], row["selection"], row["mode"], row["note"]) for row in timed if not row["ms"]]
    assert {g["goals"] for g in payload["goals"]} <= {"met", "MISSED"} and len(payload["goals"]) == 10


def test_bench_model_runs_on_cpu_at_a_tiny_size(tmp_path):
    """bench_model.py: time to first token, decode ms/step and its byte floor, and the prefill split by
    kernel family, for SDPA + StaticCache and our 16-bit and 8-bit plans (the 8-bit one runs its
    reference on CPU tensors)."""
    out = tmp_path / "model.json"
    r = run_script("bench_model.py", "--device", "cpu", "--dtype", "float32", "--context", "400",
                   "--layers", "1", "--hidden", "128", "--intermediate", "256", "--hq", "8", "--h", "2",
                   "--d", "64", "--vocab", "128", "--dense-len", "256", "--topk", "2", "--window", "64",
                   "--new-tokens", "2", "--rep", "1", "--warmup-steps", "1", "--json", str(out))
    assert "prefill time by kernel family (ms)" in r.stdout
    payload = json.loads(out.read_text())
    assert payload["env"]["commit"] and payload["env"]["torch"]
    rows = {row["impl"]: row for row in payload["rows"]}
    assert set(rows) == {"sdpa_static", "ours:16bit", "ours:int8-fp8"}
    for row in rows.values():
        assert row["ttft_ms"] > 0 and row["decode_ms_per_step"] > 0 and row["floor_ms_per_step"] > 0, row
        assert set(row["split_ms"]) == {"GEMM", "compression", "stage 1", "stage 2", "dense attention",
                                        "elementwise", "other"}
    assert rows["sdpa_static"]["split_ms"]["dense attention"] > 0
    for impl in ("ours:16bit", "ours:int8-fp8"):                   # 400 tokens >= dense_len: sparse
        assert rows[impl]["split_ms"]["stage 1"] > 0 and rows[impl]["split_ms"]["stage 2"] > 0, rows[impl]
    assert rows["ours:int8-fp8"]["ttft_vs_ours16"] > 0
