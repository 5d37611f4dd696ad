"""Multi-process driver of the context-parallel tests (not a test module: tests/distributed/test_cp.py
starts it as a subprocess, as a user starts torchrun, and reads its JSON).

    python tests/distributed/cp_worker.py --world 2 --suite cpu --out r.json      # gloo, CPU references
    python tests/distributed/cp_worker.py --world 2 --suite gpu --out r.json      # NCCL, one GPU per rank
    python tests/distributed/cp_worker.py --world 8 --suite dryrun8 --out r.json  # issue #28's launch, on CPU

Every rank runs every case of the suite; a case returns numbers (errors, flags, messages) per rank,
and rank 0 writes `{case: [rank 0's dict, rank 1's dict, ...]}`. The comparisons: this rank's shard of
the output and of dq, dk, dv against the same rows of the single-process result on the
concatenated sequences.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from infllm_cupy import (
    BlockLayout,
    InfLLMv2Config,
    infllmv2_attention,
)
from infllm_cupy.distributed import cp_infllmv2_attention, zigzag_shard, zigzag_unshard
from infllm_cupy.testing import cu_seqlens_from_lengths, max_abs_err, reference_sparse_grads


def _inputs(lengths, HQ, H, D, dtype, device, seed, structured=True):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, do = (torch.randn(T, HQ, D, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(T, H, D, generator=g).to(device, dtype) for _ in range(2))
    if structured:
        # keys with structure (a shared direction per 64-block), so stage 1's scores are far from ties
        k = k + 2.0 * torch.randn(T // 64, 1, H, D, generator=g).expand(T // 64, 64, H, D).reshape(
            T, H, D).to(device, dtype)
    return q, k, v, do, cu_seqlens_from_lengths(lengths, device)


def _single(q, k, v, do, cu, cfg, backend, layout=None):
    """The single-process result on the concatenated sequences: out and (dq, dk, dv)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if layout is None:
        out, aux = infllmv2_attention(*leaves, cu, config=cfg, backend=backend, return_aux=True)
        sel = aux["topk_idx"]
    else:
        from infllm_cupy import block_sparse_attn_varlen

        L = int((cu[1:] - cu[:-1]).max())
        out = block_sparse_attn_varlen(*leaves, cu, cu, layout, L, L, causal=True, backend=backend)
        sel = layout.to_topk_idx(cu.cpu()).to(q.device)
    grads = torch.autograd.grad(out, leaves, do)
    return out.detach(), grads, sel


def _cp(q, k, v, do, cu, cfg, backend, layout=None, **kw):
    """This rank's shards of out and (dq, dk, dv) through cp_infllmv2_attention."""
    leaves = [zigzag_shard(t, cu).requires_grad_() for t in (q, k, v)]
    out = cp_infllmv2_attention(*leaves, cu, cfg, layout=layout, backend=backend, **kw)
    grads = torch.autograd.grad(out, leaves, zigzag_shard(do, cu))
    return out.detach(), grads


def _errs(out, grads, ref_out, ref_grads, cu):
    names = ("out", "dq", "dk", "dv")
    return {
        f"err_{n}": max_abs_err(a, zigzag_shard(b, cu))
        for n, a, b in zip(names, (out,) + tuple(grads), (ref_out,) + tuple(ref_grads))
    } | {"nan": bool(any(torch.isnan(t).any() for t in (out,) + tuple(grads)))}


def _ref_case(lengths, HQ, H, D, cfg=None, layout=None, seed=0, structured=True, **kw):
    """CPU, float64 references: the context-parallel shards against the single-process pipeline."""
    q, k, v, do, cu = _inputs(lengths, HQ, H, D, torch.float64, "cpu", seed, structured)
    # rank 0 computes the single-process result once and sends it (ranks share CI's few cores)
    ref = (
        list(_single(q, k, v, do, cu, cfg, "reference", layout)[:2]) if dist.get_rank() == 0 else [None, None]
    )
    dist.broadcast_object_list(ref, src=0)
    ref_out, ref_grads = ref
    out, grads = _cp(q, k, v, do, cu, cfg, "reference", layout, **kw)
    return _errs(out, grads, ref_out, ref_grads, cu) | {"rows": out.shape[0]}


def _random_layout(lengths, H, q_block, per_sequence, seed):
    g = torch.Generator().manual_seed(seed)
    nqb = -(-max(lengths) // q_block)
    nkb = -(-max(lengths) // 64)
    shape = (len(lengths), H, nqb, nkb) if per_sequence else (H, nqb, nkb)
    m = torch.rand(shape, generator=g) < 0.3
    m[..., 0] = True
    return BlockLayout(m, q_block)


CFG_SMALL = dict(topk=4, local_blocks=2, init_blocks=1, dense_len=0, score_dtype=torch.float64)


def case_token_b1(W):
    return _ref_case([4 * 2 * W * 64], 4, 2, 16, InfLLMv2Config(**CFG_SMALL))


def case_token_varlen_gqa(W):
    g = 2 * W * 64
    return _ref_case([g, 3 * g, 2 * g], 6, 2, 16, InfLLMv2Config(**CFG_SMALL), seed=1)


def case_token_plain_random_ties(W):
    # unit-normal keys and bf16 block scores (the default): many tied scores, which the single-process
    # pipeline and every context-parallel slot must break the same way (to the lower block index)
    g = 2 * W * 64
    cfg = InfLLMv2Config(**(CFG_SMALL | dict(topk=6, score_dtype=torch.bfloat16)))
    return _ref_case([4 * g, 2 * g], 8, 2, 16, cfg, seed=5, structured=False)


def case_token_exact_stage1(W):
    g = 2 * W * 64
    return _ref_case([2 * g, g], 4, 1, 16, InfLLMv2Config(**CFG_SMALL, exact_stage1=True), seed=2)


def case_token_fp32_reduce(W):
    g = 2 * W * 64
    return _ref_case([3 * g], 4, 2, 16, InfLLMv2Config(**CFG_SMALL), seed=3, grad_reduce_dtype=torch.float32)


def case_layout_shared(W):
    lengths = [4 * 2 * W * 64, 2 * 2 * W * 64]
    return _ref_case(lengths, 4, 2, 16, layout=_random_layout(lengths, 2, 64, False, 4), seed=4)


def case_layout_per_sequence_q128(W):
    lengths = [2 * 2 * W * 128, 2 * W * 128]
    return _ref_case(lengths, 4, 2, 16, layout=_random_layout(lengths, 2, 128, True, 5), seed=5)


def case_dense_fallback(W):
    return _ref_case(
        [2 * 2 * W * 64], 4, 2, 16, InfLLMv2Config(topk=4, local_blocks=2, dense_len=1 << 20), seed=6
    )


class _ForcedPieces:
    """Every slot's backward in `n` query pieces (`cp.bwd_piece_count` picks more only for long
    slots), counting the stage-2 backward calls, so that short test sequences run the pieces."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def __enter__(self):
        from infllm_cupy.distributed import cp

        self.saved = cp.bwd_piece_count, cp._s2_bwd
        inner = cp._s2_bwd

        def counted(*a, **kw):
            self.calls += 1
            return inner(*a, **kw)

        cp.bwd_piece_count, cp._s2_bwd = (lambda mask_bytes, dq_bytes: self.n), counted
        return self

    def __exit__(self, *exc):
        from infllm_cupy.distributed import cp

        cp.bwd_piece_count, cp._s2_bwd = self.saved


def case_token_bwd_pieces(W):
    # chunks of 6 blocks: 3 pieces of 2 blocks in each slot, accumulated in float64 (exact)
    with _ForcedPieces(3) as f:
        res = _ref_case([6 * 2 * W * 64], 4, 2, 16, InfLLMv2Config(**CFG_SMALL), seed=7)
    return res | {"bwd_calls": f.calls}


def case_second_backward_raises(W):
    # the backward frees the gathered K, V and the selections (docs/context_parallel.md §9)
    q, k, v, do, cu = _inputs([2 * W * 64], 4, 2, 16, torch.float64, "cpu", 8)
    leaves = [zigzag_shard(t, cu).requires_grad_() for t in (q, k, v)]
    out = cp_infllmv2_attention(*leaves, cu, InfLLMv2Config(**CFG_SMALL), backend="reference")
    torch.autograd.backward(out, zigzag_shard(do, cu), retain_graph=True)
    try:
        torch.autograd.backward(out, zigzag_shard(do, cu))
    except RuntimeError as e:
        return {"raised": "RuntimeError", "msg": str(e)[:200]}
    return {"raised": None}


def case_shard_roundtrip(W):
    g = 2 * W * 64
    lengths = [g, 2 * g]
    cu = cu_seqlens_from_lengths(lengths)
    x = torch.arange(sum(lengths), dtype=torch.float64)[:, None, None].repeat(1, 2, 3)
    xl = zigzag_shard(x, cu).requires_grad_()
    full = zigzag_unshard(xl, cu)
    (full * torch.arange(full.numel(), dtype=torch.float64).view_as(full)).sum().backward()
    r, c = dist.get_rank(), [L // (2 * W) for L in lengths]
    want = torch.cat(
        [
            torch.cat(
                [
                    torch.arange(S + r * cc, S + (r + 1) * cc),
                    torch.arange(S + (2 * W - 1 - r) * cc, S + (2 * W - r) * cc),
                ]
            )
            for S, cc in zip((0, g), c)
        ]
    )
    grad_want = W * torch.arange(full.numel(), dtype=torch.float64).view_as(full)[want]
    return {
        "roundtrip": bool(torch.equal(full, x)),
        "local_rows_ok": bool(torch.equal(xl.detach()[:, 0, 0].long(), want)),
        "grad_ok": bool(torch.equal(xl.grad, grad_want)),
    }


def case_module_equals_function(W):
    """`ContextParallelInfLLMv2` (module form, explicit group) gives the function's output bit for bit."""
    from infllm_cupy.distributed import ContextParallelInfLLMv2

    g = 2 * W * 64
    q, k, v, _, cu = _inputs([2 * g], 4, 2, 16, torch.float64, "cpu", 7)
    shards = [zigzag_shard(t, cu) for t in (q, k, v)]
    cfg = InfLLMv2Config(**CFG_SMALL)
    mod = ContextParallelInfLLMv2(cfg, group=dist.group.WORLD, backend="reference")
    a = mod(*shards, cu)
    b = cp_infllmv2_attention(*shards, cu, cfg, backend="reference")
    return {"equal": bool(torch.equal(a, b)), "repr_ok": "backend='reference'" in repr(mod)}


def _expect_raise(fn):
    try:
        fn()
    except (ValueError, TypeError) as e:
        return {"raised": type(e).__name__, "msg": str(e)}
    return {"raised": None, "msg": ""}


def case_ranks_disagree_lengths(W):
    """Rank 1 passes other global lengths (same total): every rank must raise, none hang."""
    g = 2 * W * 64
    lengths = [2 * g, 2 * g] if dist.get_rank() != 1 else [g, 3 * g]
    q, k, v, _, cu = _inputs(lengths, 4, 2, 16, torch.float64, "cpu", 0)
    return _expect_raise(
        lambda: cp_infllmv2_attention(
            *(zigzag_shard(t, cu) for t in (q, k, v)), cu, InfLLMv2Config(**CFG_SMALL), backend="reference"
        )
    )


def case_ranks_disagree_dtype(W):
    """Rank 1's tensors are float32 (the others float64), its config differs too."""
    lengths = [2 * W * 64]
    dt = torch.float32 if dist.get_rank() == 1 else torch.float64
    q, k, v, _, cu = _inputs(lengths, 4, 2, 16, dt, "cpu", 0)
    return _expect_raise(
        lambda: cp_infllmv2_attention(
            *(zigzag_shard(t, cu) for t in (q, k, v)), cu, InfLLMv2Config(**CFG_SMALL), backend="reference"
        )
    )


def case_one_rank_bad_input(W):
    """Only rank 0 passes a length that the layout cannot split: rank 0 names it, the others stop too."""
    g = 2 * W * 64
    q, k, v, _, cu = _inputs([g], 4, 2, 16, torch.float64, "cpu", 0)
    ql, kl, vl = (zigzag_shard(t, cu) for t in (q, k, v))
    if dist.get_rank() == 0:
        kl = kl[:, :, :8]  # a head dim that differs from q's
    return _expect_raise(
        lambda: cp_infllmv2_attention(ql, kl, vl, cu, InfLLMv2Config(**CFG_SMALL), backend="reference")
    )


def case_bad_length_every_rank(W):
    g = 2 * W * 64
    cu = cu_seqlens_from_lengths([g + 64 * W])
    q = torch.randn(int(cu[-1]) // W, 4, 16, dtype=torch.float64)
    k = torch.randn(int(cu[-1]) // W, 2, 16, dtype=torch.float64)
    return _expect_raise(
        lambda: cp_infllmv2_attention(q, k, k.clone(), cu, InfLLMv2Config(**CFG_SMALL), backend="reference")
    )


def case_block_size_and_backend_every_rank(W):
    """A block size other than 64 (on the reference path too), backend='kernels' on CPU tensors and the
    8-bit plan: every rank raises its own check's error, none hangs."""
    lengths = [2 * W * 64]
    q, k, v, _, cu = _inputs(lengths, 4, 2, 16, torch.float64, "cpu", 0)
    shards = [zigzag_shard(t, cu) for t in (q, k, v)]
    return {
        "block_128": _expect_raise(lambda: cp_infllmv2_attention(
            *shards, cu, InfLLMv2Config(**dict(CFG_SMALL, block_size=128)), backend="reference")),
        "kernels_on_cpu": _expect_raise(lambda: cp_infllmv2_attention(
            *shards, cu, InfLLMv2Config(**CFG_SMALL), backend="kernels")),
        "int8_fp8": _expect_raise(lambda: cp_infllmv2_attention(
            *shards, cu, InfLLMv2Config(**dict(CFG_SMALL, precision="int8-fp8")), backend="reference")),
    }


CPU_CASES = [
    case_token_b1,
    case_token_varlen_gqa,
    case_token_plain_random_ties,
    case_token_exact_stage1,
    case_token_fp32_reduce,
    case_layout_shared,
    case_layout_per_sequence_q128,
    case_dense_fallback,
    case_token_bwd_pieces,
    case_second_backward_raises,
    case_shard_roundtrip,
    case_module_equals_function,
    case_ranks_disagree_lengths,
    case_ranks_disagree_dtype,
    case_one_rank_bad_input,
    case_bad_length_every_rank,
    case_block_size_and_backend_every_rank,
]


def case_dryrun8(W):
    """Issue #28's launch shape on CPU (8 ranks, zigzag, GQA), scaled down to seconds: one sequence of
    2 x 8 chunks of 64 tokens."""
    return _ref_case([2 * W * 64], 8, 2, 16, InfLLMv2Config(**CFG_SMALL), seed=8)


# ------------------------------------------------------------------------------------------- GPU


def _gpu_case(lengths, HQ, H, D, cfg=None, layout=None, seed=0, **kw):
    """bf16 kernels: CP shards and the single-GPU kernel result, each against the float64 reference
    of stage 2 over the single-GPU selection, by FlashAttention's rule (2x out, 3x gradients)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    q, k, v, do, cu = _inputs(lengths, HQ, H, D, torch.bfloat16, dev, seed)
    one_out, one_grads, sel = _single(q, k, v, do, cu, cfg, "auto", layout)
    L = max(lengths)
    ref_out, _, ref_grads = reference_sparse_grads(q, k, v, do, cu, cu, sel, L, L, True, exact=True)
    low_out, _, low_grads = reference_sparse_grads(q, k, v, do, cu, cu, sel, L, L, True, exact=False)
    out, grads = _cp(q, k, v, do, cu, cfg, "auto", layout, **kw)
    res = _errs(out, grads, ref_out, ref_grads, cu)
    if layout is None:
        res["selection_mismatch_rows"] = _selection_mismatches(q, k, cu, cfg, sel, lengths)
    res |= {
        f"base_{n}": max_abs_err(zigzag_shard(a, cu), zigzag_shard(b, cu))
        for n, a, b in zip(
            ("out", "dq", "dk", "dv"), (low_out,) + tuple(low_grads), (ref_out,) + tuple(ref_grads)
        )
    }
    res |= {
        f"one_{n}": max_abs_err(zigzag_shard(a, cu), zigzag_shard(b, cu))
        for n, a, b in zip(
            ("out", "dq", "dk", "dv"), (one_out,) + tuple(one_grads), (ref_out,) + tuple(ref_grads)
        )
    }
    return res


def _selection_mismatches(q, k, cu, cfg, sel, lengths) -> int:
    """(KV head, token) rows of this rank whose selected block set differs from the single-GPU one: the
    context-parallel stage 1 on its chunks (`cp._select`) against the whole sequence's, for diagnosis."""
    from infllm_cupy._rules import runs_kernels
    from infllm_cupy.distributed.cp import _select
    from infllm_cupy.distributed.zigzag import zigzag_plan

    plan = zigzag_plan(lengths, dist.get_world_size(), dist.get_rank(), q.device)
    with torch.no_grad():
        sels = _select(plan, zigzag_shard(q, cu), k, cfg, runs_kernels(q, "auto"))
    bad = 0
    for slot, s_cp in zip(plan.slots, sels):
        rows = plan.local_rows[slot.rows]
        for a, b in ((sel[:, rows], s_cp),):
            nb = max(int(a.max()), int(b.max())) + 1
            ma = torch.zeros(*a.shape[:2], nb + 1, dtype=torch.bool, device=a.device)
            mb = torch.zeros_like(ma)
            ma.scatter_(2, a.long().clamp(min=-1) % (nb + 1), True)
            mb.scatter_(2, b.long().clamp(min=-1) % (nb + 1), True)
            bad += int((ma[..., :nb] != mb[..., :nb]).any(-1).sum())
    return bad


GPU_CFG = dict(topk=16, local_blocks=4, init_blocks=1, dense_len=0, score_dtype=torch.float32)


# Lengths: the float64 reference holds [HQ, T, T] scores (and autograd keeps copies), so 16k tokens at 16
# heads ran a GPU out of memory; these still select 20 of 64+ blocks (the sparse regime).
def case_gpu_token_b1(W):
    return _gpu_case([4096], 16, 2, 128, InfLLMv2Config(**GPU_CFG), seed=10)


def case_gpu_token_varlen(W):
    g = 2 * W * 64
    return _gpu_case([4 * g, 12 * g, 2 * g], 32, 2, 128, InfLLMv2Config(**GPU_CFG), seed=11)


def case_gpu_token_d64_g1(W):
    return _gpu_case([8192], 2, 2, 64, InfLLMv2Config(**GPU_CFG), seed=12, grad_reduce_dtype=torch.float32)


def case_gpu_layout(W):
    lengths = [4096, 2048]
    return _gpu_case(lengths, 16, 2, 128, layout=_random_layout(lengths, 2, 128, True, 13), seed=13)


def case_gpu_readme_k96(W):
    """The README head config with MiniCPM4's K = 96 (topk 64, local 32), bf16 scores as shipped."""
    return _gpu_case([8192], 32, 2, 128, InfLLMv2Config(dense_len=0), seed=14)


def case_gpu_bwd_pieces(W):
    """The README head config with every slot's backward in 2 query pieces (bf16 dK / dV partials
    summed per piece, docs/context_parallel.md §9)."""
    with _ForcedPieces(2) as f:
        res = _gpu_case([8192], 32, 2, 128, InfLLMv2Config(dense_len=0), seed=15)
    return res | {"bwd_calls": f.calls}


GPU_CASES = [
    case_gpu_bwd_pieces,
    case_gpu_token_b1,
    case_gpu_token_varlen,
    case_gpu_token_d64_g1,
    case_gpu_layout,
    case_gpu_readme_k96,
    case_ranks_disagree_lengths,
    case_one_rank_bad_input,
]
SUITES = {"cpu": CPU_CASES, "gpu": GPU_CASES, "dryrun8": [case_dryrun8, case_ranks_disagree_lengths]}


def _worker(rank, world, suite, out, port):
    gpu = suite == "gpu"
    os.environ.setdefault("INFLLM_CUPY_POISON", "1")  # kernel outputs start as NaN: unwritten rows show
    if gpu:
        torch.cuda.set_device(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group(
        "nccl" if gpu else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )  # no device_id (eager NCCL init): on the 2-GPU H100 host it failed with "no transport for send
    # peer"; benchmarks/bench_cp.py's lazy init ran there
    results = {}
    for case in SUITES[suite]:
        try:
            results[case.__name__] = case(world)
        except Exception as e:  # noqa: BLE001 - recorded, the test reports it
            results[case.__name__] = {
                "error": f"{type(e).__name__}: {e}",
                "tb": traceback.format_exc()[-2000:],
            }
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out).write_text(json.dumps({name: [g[name] for g in gathered] for name in results}, indent=1))
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--suite", choices=sorted(SUITES), default="cpu")
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, default=0, help="rendezvous port (default: a free one)")
    a = p.parse_args(argv)
    port = a.port
    if not port:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    mp.spawn(_worker, args=(a.world, a.suite, a.out, port), nprocs=a.world)


if __name__ == "__main__":
    main()
