"""Context parallelism (infllm_cupy/distributed, docs/context_parallel.md): each rank's shard of the
output and of dq, dk, dv against the same rows of the single-process result on the concatenated
sequences. The ranks run in a subprocess (tests/distributed/cp_worker.py, torch.multiprocessing
over gloo on CPU, NCCL on GPUs), as torchrun would start them; its JSON holds every rank's numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import HAS_GPU

WORKER = Path(__file__).resolve().parent / "cp_worker.py"
ROOT = Path(__file__).resolve().parents[2]


def run_suite(tmp_path_factory, suite: str, world: int) -> dict:
    out = tmp_path_factory.mktemp(f"cp_{suite}") / "r.json"
    r = subprocess.run(
        [sys.executable, str(WORKER), "--world", str(world), "--suite", suite, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (
        r.returncode == 0 and out.exists()
    ), f"worker exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def cpu2(tmp_path_factory):
    return run_suite(tmp_path_factory, "cpu", 2)


def ranks(results: dict, case: str) -> list[dict]:
    per_rank = results[case]
    for r, d in enumerate(per_rank):
        assert "error" not in d, f"{case} rank {r}: {d['error']}\n{d.get('tb', '')}"
    return per_rank


# float64 references on both sides: the same math in another order
EXACT = 1e-12


@pytest.mark.parametrize(
    "case",
    [
        "case_token_b1",
        "case_token_varlen_gqa",
        "case_token_plain_random_ties",
        "case_token_exact_stage1",
        "case_layout_shared",
        "case_layout_per_sequence_q128",
        "case_dense_fallback",
    ],
)
def test_cp_gloo_matches_single_process(cpu2, case):
    for r, d in enumerate(ranks(cpu2, case)):
        assert not d["nan"], f"{case} rank {r}: NaN"
        for name in ("out", "dq", "dk", "dv"):
            assert (
                d[f"err_{name}"] <= EXACT
            ), f"{case} rank {r}: max |{name} - single process| = {d[f'err_{name}']:.2e}"


def test_cp_gloo_backward_in_query_pieces(cpu2):
    # every slot in 3 query pieces (forced; long slots choose it): the same float64 results
    for r, d in enumerate(ranks(cpu2, "case_token_bwd_pieces")):
        assert d["bwd_calls"] == 2 * 3, (r, d)
        assert not d["nan"], (r, d)
        for name in ("out", "dq", "dk", "dv"):
            assert d[f"err_{name}"] <= EXACT, (r, name, d[f"err_{name}"])


def test_second_backward_raises_a_clear_error(cpu2):
    for r, d in enumerate(ranks(cpu2, "case_second_backward_raises")):
        assert d["raised"] == "RuntimeError" and "second time" in d["msg"], (r, d)


def test_bwd_piece_count_splits_only_long_slots():
    from infllm_cupy.distributed.cp import BWD_MAX_PIECES, bwd_piece_count

    # README head config (H 2, HQ 32, D 128, bf16) on 2 ranks, rank 0's wide slot: L / 4 queries over
    # L keys; masks H x L/4 x L/2048 x 4 B against dq L/4 x 8 KiB
    def count(L):
        n_q = L // 4
        return bwd_piece_count(2 * n_q * -(-L // 2048) * 4, n_q * 32 * 128 * 2)

    assert count(262144) == 1 and count(524288) == 1  # the timed rows: the kernels as before
    assert count(1 << 21) == 2 and count(3_000_000) == 3
    assert count(1 << 30) == BWD_MAX_PIECES


def test_cp_gloo_fp32_gradient_reduce(cpu2):
    # float64 inputs, dK / dV summed over ranks in float32: float32 rounding, no more
    for r, d in enumerate(ranks(cpu2, "case_token_fp32_reduce")):
        assert d["err_out"] <= EXACT and d["err_dq"] <= EXACT, (r, d)
        assert 0 < d["err_dk"] <= 1e-5 and 0 < d["err_dv"] <= 1e-5, (
            r,
            d,
        )  # > 0: the reduce really ran in fp32


def test_zigzag_shard_unshard(cpu2):
    for r, d in enumerate(ranks(cpu2, "case_shard_roundtrip")):
        assert d == {"roundtrip": True, "local_rows_ok": True, "grad_ok": True}, (r, d)


def test_module_form_equals_the_function(cpu2):
    for r, d in enumerate(ranks(cpu2, "case_module_equals_function")):
        assert d == {"equal": True, "repr_ok": True}, (r, d)


def test_ranks_that_disagree_raise_on_every_rank(cpu2):
    for case, field in (
        ("case_ranks_disagree_lengths", "lengths hash"),
        ("case_ranks_disagree_dtype", "dtype"),
    ):
        for r, d in enumerate(ranks(cpu2, case)):
            assert d["raised"] == "ValueError" and "disagree" in d["msg"] and field in d["msg"], (case, r, d)


def test_one_rank_bad_input_stops_every_rank(cpu2):
    d0, d1 = ranks(cpu2, "case_one_rank_bad_input")
    assert d0["raised"] == "ValueError" and "v must have the shape of k" in d0["msg"], d0
    assert d1["raised"] == "ValueError" and "rank(s) [0]" in d1["msg"], d1


def test_lengths_the_layout_cannot_split_raise(cpu2):
    for d in ranks(cpu2, "case_bad_length_every_rank"):
        assert d["raised"] == "ValueError" and "multiple of 256" in d["msg"], d


def test_block_size_and_backend_checks_raise_on_every_rank(cpu2):
    for d in ranks(cpu2, "case_block_size_and_backend_every_rank"):
        bs, kern = d["block_128"], d["kernels_on_cpu"]
        assert bs["raised"] == "ValueError", d
        assert "config.block_size must be 64 with context parallelism" in bs["msg"], d
        assert kern["raised"] == "ValueError", d
        assert "q must be a CUDA tensor for backend='kernels'" in kern["msg"], d
        q8 = d["int8_fp8"]
        assert q8["raised"] == "ValueError", d
        assert "config.precision must be '16bit' with context parallelism" in q8["msg"], d


def test_dry_run_of_the_8_rank_launch(tmp_path_factory):
    """Issue #28's 8-rank zigzag launch on CPU (gloo), small sequences: outputs and gradients of every
    rank against the single-process result, and the disagreement check at 8 ranks."""
    res = run_suite(tmp_path_factory, "dryrun8", 8)
    per_rank = ranks(res, "case_dryrun8")
    assert len(per_rank) == 8
    for r, d in enumerate(per_rank):
        assert not d["nan"] and all(d[f"err_{n}"] <= EXACT for n in ("out", "dq", "dk", "dv")), (r, d)
    assert all(d["raised"] == "ValueError" for d in ranks(res, "case_ranks_disagree_lengths"))


@pytest.mark.gpu
@pytest.mark.skipif(HAS_GPU and torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_cp_nccl_two_gpus_flash_attention_rule(tmp_path_factory):
    """bf16 kernels on 2 GPUs: each rank's shard of out, dq, dk, dv within FlashAttention's rule
    (2x / 3x the error of PyTorch in bf16) of the float64 stage-2 reference over the single-GPU
    selection; the single-GPU kernel result is held to the same bound, for comparison."""
    res = run_suite(tmp_path_factory, "gpu", 2)
    assert all(d["bwd_calls"] == 2 * 2 for d in ranks(res, "case_gpu_bwd_pieces"))
    for case in (
        "case_gpu_bwd_pieces",
        "case_gpu_token_b1",
        "case_gpu_token_varlen",
        "case_gpu_token_d64_g1",
        "case_gpu_layout",
        "case_gpu_readme_k96",
    ):
        for r, d in enumerate(ranks(res, case)):
            assert not d["nan"], (case, r)
            for name, mult in (("out", 2), ("dq", 3), ("dk", 3), ("dv", 3)):
                bound = mult * d[f"base_{name}"] + 1e-6
                assert d[f"err_{name}"] <= bound, (
                    f"{case} rank {r}: {name} error {d[f'err_{name}']:.3e} > "
                    f"{bound:.3e} (single GPU: {d[f'one_{name}']:.3e}); rows whose "
                    f"selection differs from the single GPU's: "
                    f"{d.get('selection_mismatch_rows', '-')}"
                )
    for case in ("case_ranks_disagree_lengths", "case_one_rank_bad_input"):
        assert all(d["raised"] == "ValueError" for d in ranks(res, case)), case


def test_bench_cp_runs_on_cpu_under_torchrun(tmp_path):
    """benchmarks/bench_cp.py as a user starts it (torchrun, 2 processes), on CPU with gloo: every row
    timed, the sampled-block check passes, the JSON carries the rows."""
    out = tmp_path / "cp.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            str(ROOT / "benchmarks" / "bench_cp.py"),
            "--device",
            "cpu",
            "--lengths",
            "512,1024",
            "--q-heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--topk",
            "4",
            "--local-blocks",
            "2",
            "--no-search",
            "--rep",
            "1",
            "--check-blocks",
            "4",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"bench_cp exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert r.stdout.count("within FlashAttention's rule: PASSED") == 2, r.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(row["L"], row["mode"]) for row in rows] == [
        (512, "fwd"),
        (512, "fwdbwd"),
        (1024, "fwd"),
        (1024, "fwdbwd"),
    ]
    assert all(row["cp_ms"] > 0 and row["single_ms"] > 0 and row["bytes_per_rank"] > 0 for row in rows)
    # all-gather of K and V: (W - 1) / W of 1024 rows x 2 heads x 16 dims x 4 bytes, twice
    assert rows[2]["bytes_per_rank"] == 2 * 512 * 2 * 16 * 4


# the CPU smoke configuration of bench_cp (README-like heads, scaled down)
_BENCH_SMALL = ["--device", "cpu", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "16", "--topk", "4"]
_BENCH_SMALL += ["--local-blocks", "2", "--rep", "1"]


@pytest.mark.parametrize(
    "rank, where",
    [(0, "layer"), (1, "layer"), (1, "guard"), (0, "single")],
)
def test_bench_cp_search_survives_one_rank_failing_a_probe(tmp_path, rank, where):
    """`--search` with one rank raising an (injected) OOM in the first probe: inside the 2-rank layer
    after its K/V all-gathers (the peer goes on to the backward's reduce-scatters), in the guard
    before the layer, or in the 1-GPU probe. The run must finish (a rank that skipped a collective
    would hang NCCL; gloo aborts on the mismatched sizes) with that length reported as failed and the
    bisection going on below it. Search over (1024, 2048] in steps of 256: 1536, then 1280 or 1792."""
    out = tmp_path / "cp.json"
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        + [str(ROOT / "benchmarks" / "bench_cp.py"), *_BENCH_SMALL, "--lengths", "512,1024"]
        + ["--search-max", "2048", "--inject-probe-failure-rank", str(rank)]
        + ["--inject-probe-failure-at", where, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, f"bench_cp exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    search = json.loads(out.read_text())["search"]
    hit, clean = (search["single"], search["cp"]) if where == "single" else (search["cp"], search["single"])
    first = hit["probes"][0]
    assert first[:2] == [1536, False], hit
    assert f"rank {rank}: OutOfMemoryError" in first[2], hit
    assert f"injected by --inject-probe-failure-rank, at {where}" in first[2], hit
    assert f"rank {1 - rank}:" not in first[2], hit  # the peer did not fail
    assert [p[:2] for p in hit["probes"][1:]] == [[1280, True]], hit
    assert (hit["longest_ran"], hit["shortest_failed"], hit["stopped"]) == (1280, 1536, ""), hit
    # the other search, after the failure, ran every probe
    assert [p[:2] for p in clean["probes"]] == [[1536, True], [1792, True]], clean
    assert (clean["longest_ran"], clean["shortest_failed"], clean["cap"]) == (1792, None, 2048), clean
    assert f"probe L=1536: rank {rank}: OutOfMemoryError" in r.stdout, r.stdout
