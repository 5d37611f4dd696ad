"""CSR (vLLM), BSR (FlashInfer) and FlexAttention BlockMask in and out of BlockLayout: exact round
trips both ways, vLLM's CSR of the local-stride pattern, and FlexAttention computing what our op
computes with the BlockMask we build."""
import pytest
import torch

from infllm_cupy import BlockLayout, naive_block_sparse_attn_varlen
from infllm_cupy.patterns import (
    from_block_mask,
    from_bsr,
    from_csr,
    local_stride,
    to_block_mask,
    to_bsr,
    to_csr,
)
from infllm_cupy.testing import cu_seqlens_from_lengths

from test_local_stride import vllm_token_mask


def rand_layout(H, nqb, nkb, q_block=64, seed=0, p=0.4, batch=None):
    g = torch.Generator().manual_seed(seed)
    shape = (H, nqb, nkb) if batch is None else (batch, H, nqb, nkb)
    return BlockLayout(torch.rand(*shape, generator=g) < p, q_block)


def vllm_dense_to_crow_col(x):
    """Transcription of vLLM's `dense_to_crow_col` (row-major scan per head, -1 padding)."""
    crows, cols = [], []
    for xi in x:
        indptr, idx = [0], []
        for i in range(xi.shape[0]):
            for j in range(xi.shape[1]):
                if xi[i, j]:
                    idx.append(j)
            indptr.append(len(idx))
        crows.append(indptr)
        cols.append(idx)
    width = max(len(c) for c in cols)
    return (torch.tensor(crows, dtype=torch.int64),
            torch.tensor([c + [-1] * (width - len(c)) for c in cols], dtype=torch.int64))


# ------------------------------------------------------------------------------------------------ CSR

@pytest.mark.parametrize("H,nqb,nkb,qb,seed", [(1, 5, 7, 64, 0), (4, 9, 17, 64, 1), (3, 6, 12, 128, 2),
                                              (2, 1, 1, 128, 3)])
def test_csr_round_trip_from_layout(H, nqb, nkb, qb, seed):
    layout = rand_layout(H, nqb, nkb, qb, seed)
    crow, col = to_csr(layout)
    assert crow.shape == (H, nqb + 1) and crow.dtype == col.dtype == torch.int64
    back = from_csr(crow, col, q_block=qb, num_kv_blocks=nkb)
    assert back.q_block == qb and torch.equal(back.mask, layout.mask)
    assert torch.equal(crow, vllm_dense_to_crow_col(layout.mask)[0])
    assert torch.equal(col, vllm_dense_to_crow_col(layout.mask)[1])


def test_csr_round_trip_from_format_modulo_padding():
    g = torch.Generator().manual_seed(5)
    dense = torch.rand(3, 6, 8, generator=g) < 0.5
    crow, col = vllm_dense_to_crow_col(dense)
    col = torch.cat([col, torch.full((3, 4), -1)], 1)             # extra padding is ignored
    layout = from_csr(crow, col, q_block=128, kv_block=128, num_kv_blocks=8)
    assert layout.q_block == 128 and layout.mask.shape == (3, 6, 16)
    crow2, col2 = to_csr(layout, kv_block=128)
    assert torch.equal(crow2, crow) and torch.equal(col2, col[:, :col2.shape[1]])
    # one head given 1-D, as vLLM's homogeneous single head
    one = from_csr(crow[0], col[0], q_block=64, num_kv_blocks=8)
    assert torch.equal(one.mask[0], dense[0])


@pytest.mark.parametrize("H,L,B,local,stride,homo", [(4, 601, 64, 2, 3, False), (2, 1000, 128, 2, 5, False),
                                                     (4, 1100, 192, 2, 3, False), (2, 1300, 256, 3, 2, True)])
def test_local_stride_csr_is_vllms(H, L, B, local, stride, homo):
    """to_csr at vLLM's block size reproduces vLLM's (crow, col) of the same pattern."""
    layout = local_stride(H, L, block_size=B, local_blocks=local, vert_stride=stride, homo_head=homo)
    full, _ = vllm_token_mask(H, L, B, local, stride, homo)
    block = full[:, ::B, ::B]                                      # vLLM's block_mask_dense
    crow, col = to_csr(layout, q_block=B, kv_block=B)
    ref_crow, ref_col = vllm_dense_to_crow_col(block)
    assert torch.equal(crow, ref_crow) and torch.equal(col, ref_col)
    back = from_csr(crow, col, q_block=B, kv_block=B, num_kv_blocks=block.shape[-1])
    n = layout.mask.shape
    assert torch.equal(back.mask[:, :n[1], :n[2]], layout.mask)


def test_csr_rejects():
    layout = rand_layout(2, 4, 6, seed=7, p=0.5)
    with pytest.raises(ValueError, match="kv_block must be a positive multiple of 64"):
        to_csr(layout, kv_block=32)
    with pytest.raises(ValueError, match="finer than kv_block"):
        to_csr(layout, kv_block=128)
    with pytest.raises(ValueError, match="finer than q_block"):
        to_csr(layout, q_block=128)
    with pytest.raises(ValueError, match=r"per-sequence|shared by all sequences"):
        to_csr(rand_layout(2, 4, 6, batch=2))
    crow = torch.tensor([[0, 2, 1]])
    with pytest.raises(ValueError, match="never decrease"):
        from_csr(crow, torch.tensor([[0, 1]]), q_block=64)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        from_csr(torch.tensor([0, 1]), torch.tensor([5]), q_block=64, num_kv_blocks=3)


# ------------------------------------------------------------------------------------------------ BSR

@pytest.mark.parametrize("R,C", [(64, 64), (128, 64), (128, 128), (192, 256)])
def test_bsr_round_trips(R, C):
    g = torch.Generator().manual_seed(R + C)
    coarse = torch.rand(5, 7, generator=g) < 0.4
    indptr, indices = vllm_dense_to_crow_col(coarse[None])
    indptr, indices = indptr[0].int(), indices[0][:int(indptr[0, -1])].int()
    layout = from_bsr(indptr, indices, R=R, C=C, num_kv_blocks=7, num_heads=3)
    assert layout.mask.shape[0] == 3 and layout.mask.shape[-1] == 7 * C // 64
    assert torch.equal(layout.mask[0], layout.mask[2])
    ip2, ix2 = to_bsr(layout, R=R, C=C)
    assert ip2.dtype == ix2.dtype == torch.int32
    assert torch.equal(ip2, indptr) and torch.equal(ix2, indices)
    # layout -> BSR -> layout at the layout's own grid
    fine = rand_layout(1, 6, 9, 64, seed=R)
    ip3, ix3 = to_bsr(fine, R=64, C=64)
    assert torch.equal(from_bsr(ip3, ix3, R=64, C=64, num_kv_blocks=9).mask, fine.mask)


def test_bsr_rejects():
    layout = rand_layout(2, 4, 6, seed=3, p=0.5)
    with pytest.raises(ValueError, match="R must be a positive multiple of 64"):
        to_bsr(layout, R=96, C=64, head=0)
    with pytest.raises(ValueError, match="C must be a positive multiple of 64"):
        from_bsr(torch.tensor([0, 0], dtype=torch.int32), torch.zeros(0, dtype=torch.int32), R=64, C=32)
    with pytest.raises(ValueError, match="heads differ"):
        to_bsr(layout, R=64, C=64)
    assert to_bsr(layout, R=64, C=64, head=1)[0].shape == (5,)


# ------------------------------------------------------------------------------------------ BlockMask

def block_mask_token_mask(bm, lq, lk):
    """What FlexAttention computes with a BlockMask: full blocks whole, partial blocks through the
    mask_mod, everything else masked. [B, H, lq, lk]."""
    bq, bk = bm.BLOCK_SIZE
    B, H, nqb = bm.kv_num_blocks.shape
    out = torch.zeros(B, H, lq, lk, dtype=torch.bool)
    qi = torch.arange(lq)[:, None]
    ki = torch.arange(lk)[None, :]
    for b in range(B):
        for h in range(H):
            mm = bm.mask_mod(torch.tensor(b), torch.tensor(h), qi, ki)
            for i in range(nqb):
                rs = slice(i * bq, min(lq, (i + 1) * bq))
                for kind, num, idx in (("p", bm.kv_num_blocks, bm.kv_indices),
                                       ("f", bm.full_kv_num_blocks, bm.full_kv_indices)):
                    for j in idx[b, h, i, :int(num[b, h, i])].tolist():
                        cs = slice(j * bk, min(lk, (j + 1) * bk))
                        out[b, h, rs, cs] |= True if kind == "f" else mm[rs, cs]
    return out


def layout_token_mask_b(layout, lq, lk, causal):
    m = layout.mask if layout.per_sequence else layout.mask[None]
    t, s = torch.arange(lq), torch.arange(lk)
    out = m[:, :, t // layout.q_block][..., s // 64]
    return out & (s[None, :] <= t[:, None]) if causal else out


@pytest.mark.parametrize("qb,bs,causal,batch", [(64, (64, 64), False, None), (128, (128, 64), True, None),
                                                (64, 128, True, None), (128, 128, False, 2),
                                                (64, (128, 64), True, 2)])
def test_block_mask_is_exact(qb, bs, causal, batch):
    layout = rand_layout(2, 5, 9, qb, seed=qb, p=0.5, batch=batch)
    lq, lk = 5 * qb - 17, 9 * 64 - 5
    bm = to_block_mask(layout, seq_len_q=lq, seq_len_kv=lk, BLOCK_SIZE=bs, causal=causal)
    assert torch.equal(block_mask_token_mask(bm, lq, lk), layout_token_mask_b(layout, lq, lk, causal))
    # FlexAttention's own classification of the same token mask agrees (full vs partial blocks)
    from torch.nn.attention.flex_attention import create_block_mask
    ref = create_block_mask(bm.mask_mod, layout.mask.shape[0] if batch else 1, 2, lq, lk, device="cpu",
                            BLOCK_SIZE=bs)
    for a, b in ((bm.kv_num_blocks, ref.kv_num_blocks), (bm.full_kv_num_blocks, ref.full_kv_num_blocks)):
        assert torch.equal(a, b)
    for a, b, n in ((bm.kv_indices, ref.kv_indices, bm.kv_num_blocks),
                    (bm.full_kv_indices, ref.full_kv_indices, bm.full_kv_num_blocks)):
        listed = torch.arange(a.shape[-1]) < n[..., None]
        assert torch.equal(torch.where(listed, a, -1).sort(-1).values,
                           torch.where(listed, b, -1).sort(-1).values)


@pytest.mark.parametrize("qb,bs,batch", [(64, (64, 64), None), (128, (128, 64), None), (128, (128, 64), 3),
                                         (64, (64, 128), None)])
def test_block_mask_round_trips(qb, bs, batch):
    if bs[1] == 128:                       # a layout the coarser grid holds exactly
        coarse = rand_layout(2, 6, 4, 64, seed=9).mask
        layout = BlockLayout(coarse.repeat_interleave(2, -1), qb)
    else:
        layout = rand_layout(2, 6, 8, qb, seed=qb, batch=batch)
    bm = to_block_mask(layout, BLOCK_SIZE=bs)
    back = from_block_mask(bm)
    assert back.q_block == qb and torch.equal(back.mask, layout.mask)
    # BlockMask -> layout -> BlockMask: the same blocks, partial and full (modulo index padding)
    again = to_block_mask(back, BLOCK_SIZE=bs)
    for n1, i1, n2, i2 in ((bm.kv_num_blocks, bm.kv_indices, again.kv_num_blocks, again.kv_indices),
                           (bm.full_kv_num_blocks, bm.full_kv_indices, again.full_kv_num_blocks,
                            again.full_kv_indices)):
        assert torch.equal(n1, n2)
        listed = torch.arange(i1.shape[-1]) < n1[..., None]
        assert torch.equal(torch.where(listed, i1, -1), torch.where(listed, i2, -1))


def test_from_foreign_block_mask_and_gqa_heads():
    from torch.nn.attention.flex_attention import create_block_mask

    def sliding(b, h, q, kv):
        return (q - kv < 256) & (kv <= q)
    bm = create_block_mask(sliding, 1, 1, 1000, 1000, device="cpu")        # 128 x 128 blocks
    layout = from_block_mask(bm)
    assert layout.q_block == 128 and layout.mask.shape == (1, 8, 16)
    # every token pair the mask allows is covered by the layout (whole blocks)
    t = torch.arange(1000)
    allowed = sliding(0, 0, t[:, None], t[None, :])
    assert not (allowed & ~layout_token_mask_b(layout, 1000, 1000, True)[0, 0]).any()
    kv_layout = BlockLayout(torch.rand(2, 4, 8, generator=torch.Generator().manual_seed(1)) < 0.5, 128)
    bm4 = to_block_mask(kv_layout, num_q_heads=6)
    assert bm4.kv_num_blocks.shape == (1, 6, 4)
    with pytest.raises(ValueError, match="multiple of the layout's 2 KV heads"):
        to_block_mask(kv_layout, num_q_heads=3)
    with pytest.raises(TypeError, match="causal must be a bool"):
        to_block_mask(kv_layout, causal=1)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_matches_our_reference_with_the_converted_mask():
    """FlexAttention (eager, CPU) with to_block_mask(layout) == naive_block_sparse_attn_varlen(layout)."""
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(0)
    L, H, G, D = 300, 2, 2, 64
    layout = BlockLayout(torch.rand(H, 3, 5, generator=g) < 0.6, 128)
    layout.mask[:, :, 0] = True                                   # no query row left without keys
    q = torch.randn(L, H * G, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(L, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    cu = cu_seqlens_from_lengths([L])
    ref = naive_block_sparse_attn_varlen(q, k, v, cu, cu, layout, L, L, causal=True)
    bm = to_block_mask(layout, seq_len_q=L, seq_len_kv=L, causal=True, num_q_heads=H * G)
    out = flex_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                         block_mask=bm, enable_gqa=True)
    torch.testing.assert_close(out[0].transpose(0, 1), ref, rtol=1e-9, atol=1e-9)


@pytest.mark.gpu
def test_compiled_flex_attention_on_cuda_with_our_block_mask():
    """The BlockMask the benchmark hands to compiled FlexAttention (128 x 128 blocks over a 64-key
    layout, GQA, causal, a length off the block grid) computes the layout's attention."""
    from torch.nn.attention.flex_attention import flex_attention

    from infllm_cupy.testing import assert_close_to_ref

    g = torch.Generator().manual_seed(0)
    L, H, G, D = 1000, 2, 4, 128
    layout = BlockLayout(torch.rand(H, 16, 16, generator=g) < 0.5, 64)
    layout.mask[:, :, 0] = True
    q = torch.randn(L, H * G, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(L, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    cu = cu_seqlens_from_lengths([L])
    ref = naive_block_sparse_attn_varlen(q, k, v, cu, cu, layout, L, L, causal=True)
    lowp = naive_block_sparse_attn_varlen(*(x.bfloat16() for x in (q, k, v)), cu, cu, layout, L, L,
                                          causal=True)
    cuda_layout = BlockLayout(layout.mask.cuda(), layout.q_block)
    bm = to_block_mask(cuda_layout, seq_len_q=L, seq_len_kv=L, causal=True, num_q_heads=H * G)
    qc, kc, vc = (x.cuda().bfloat16().transpose(0, 1)[None] for x in (q, k, v))
    out = torch.compile(flex_attention)(qc, kc, vc, block_mask=bm, enable_gqa=True)
    assert_close_to_ref("flex_attention", out[0].transpose(0, 1).float().cpu(), ref, lowp)
