"""Notebooks run in smoke mode on CPU and write their figures; each `.ipynb` is the stripped twin of its
`.py`; and the package functions the notebooks narrate (synthetic data, attention mass captured)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from infllm_cupy import viz
from infllm_cupy.config import InfLLMv2Config
from infllm_cupy.pipeline import naive_infllmv2_attention
from infllm_cupy.synthetic import (
    Needle,
    needle_recall,
    structured_sequence,
    synthetic_sequence,
)
from infllm_cupy.testing import cu_seqlens_from_lengths
from infllm_cupy.viz import CapturedMass, attention_mass_captured, per_query_block, summarize_mass, topk_sweep

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9]*.py"))
# figures each notebook must write (any other notebook must write at least one)
FIGURES = {
    "01_infllmv2_selection": ["01_selection_maps.png", "01_block_scores.png", "01_mass_by_query_block.png",
                              "01_mass_vs_topk.png", "01_mass_per_head.png"],
    "02_decode": ["02_selection_over_time.png", "02_h2o_vs_infllm.png", "02_mass_captured.png"],
    # 03_timing.png only on a GPU
    "03_pattern_gallery": ["03_local_stride.png", "03_per_head.png", "03_formats.png", "03_sliding_tile.png",
                           "03_infllm_vs_sparge.png", "03_mass_vs_density.png"],
}


def test_notebooks_exist():
    assert NOTEBOOKS, f"no notebooks/*.py found in {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_in_smoke_mode(path, tmp_path, monkeypatch):
    jupytext = pytest.importorskip("jupytext")
    nbclient = pytest.importorskip("nbclient")
    # the kernel inherits the environment: smoke sizes, no display, CPU even on a GPU machine
    monkeypatch.setenv("NB_SMOKE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("NB_FIG_DIR", str(tmp_path))
    nb = jupytext.read(path)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    # no progress bar in a saved notebook: a widget or text bar is stored as its last frame ("0% 0/4")
    texts = [str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", ""))
             for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    bars = [t for t in texts if "%|" in t or "HBox" in t or "it/s]" in t]
    assert not bars, f"{path.name} saves progress bars: {bars[:2]}"
    written = sorted(p.name for p in tmp_path.glob("*.png"))
    assert written, f"{path.name} wrote no figure"
    missing = set(FIGURES.get(path.stem, [])) - set(written)
    assert not missing, f"{path.name} did not write {sorted(missing)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_paired_ipynb_is_stripped_twin(path):
    jupytext = pytest.importorskip("jupytext")
    nbformat = pytest.importorskip("nbformat")
    ipynb = path.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} missing: run `jupytext --to ipynb {path.name}`"
    src = jupytext.read(path)
    twin = nbformat.read(ipynb, as_version=4)
    assert [(c.cell_type, c.source) for c in twin.cells] == [(c.cell_type, c.source) for c in src.cells], (
        f"{ipynb.name} is out of date: run `jupytext --sync {path.name}`")
    # the committed notebook carries no outputs; one that a user ran and saved in place may (a saved run
    # must not fail the suite), so the check reads the file as committed
    rel = ipynb.relative_to(ROOT).as_posix()
    blob = subprocess.run(["git", "-C", str(ROOT), "show", f"HEAD:{rel}"], capture_output=True, text=True)
    if blob.returncode != 0:
        pytest.skip(f"{rel} is not committed in a git checkout here: the outputs check reads the committed "
                    "file")
    committed = nbformat.reads(blob.stdout, as_version=4)
    for c in committed.cells:
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None, \
                f"{rel} was committed with outputs: strip them"


# ------------------------------------------------------------------------------ synthetic sequences


def test_structured_sequence_shapes_needles_and_seed():
    a = structured_sequence(1024, 8, 2, 32, seed=3)
    b = structured_sequence(1024, 8, 2, 32, seed=3, dtype=torch.float32)
    assert a.q.shape == (1024, 8, 32) and a.k.shape == a.v.shape == (1024, 2, 32)
    assert a.q.dtype == torch.bfloat16 and a.cu_seqlens.tolist() == [0, 1024]
    assert torch.equal(a.k, b.k.to(torch.bfloat16))               # data do not depend on dtype or device
    assert [n.kv_head for n in a.needles] == [0, 1, 0, 1]
    assert all(1 <= n.key_block < 1024 // 64 // 4 + 1 and n.query_start >= 512 for n in a.needles)
    assert a.needles[0].query_blocks == (a.needles[0].query_start // 64,
                                         (a.needles[0].query_start + 63) // 64)
    # the sink: every query's logit to key 0 is far above its mean logit
    logits = torch.einsum("thd,jhd->thj", a.q.float().view(1024, 2, 4, 32).mean(2), a.k.float()) / 32 ** 0.5
    assert (logits[:, :, 0] - logits.mean(-1)).mean() > 4
    with pytest.raises(ValueError, match=r"\bHQ\b"):
        structured_sequence(1024, 6, 4, 32)
    with pytest.raises(TypeError, match=r"\bT\b"):
        structured_sequence(1024.0, 8, 2, 32)
    with pytest.raises(ValueError, match=r"\bT\b"):
        structured_sequence(200, 8, 2, 32)


def test_synthetic_sequence_is_the_demo_one():
    q, k, v, needles = synthetic_sequence(2048, 4, 2, 64, 3, torch.float32, "cpu", seed=1)
    assert q.shape == (2048, 4, 64) and k.shape == v.shape == (2048, 2, 64)
    assert len(needles) == 3 and all(len(n) == 2 for n in needles)
    kb, qs = needles[0]
    # queries of the run point along the keys of their block
    align = torch.einsum("hd,jhd->j", q[qs + 5, :2], k[:, :]) / 64
    assert int(align.argmax()) // 64 == kb


def test_synthetic_sequence_control_keeps_the_keys_and_drops_the_needle_queries():
    real = synthetic_sequence(2048, 4, 2, 64, 3, torch.float32, "cpu", seed=1)
    ctrl = synthetic_sequence(2048, 4, 2, 64, 3, torch.float32, "cpu", seed=1, needle_logit=0.0)
    assert torch.equal(real[1], ctrl[1]) and torch.equal(real[2], ctrl[2]) and real[3] == ctrl[3]
    qs = real[3][0][1]
    run = slice(qs, qs + 64)
    assert not torch.equal(real[0][run], ctrl[0][run])
    mask = torch.ones(2048, dtype=torch.bool)
    for _, s in real[3]:
        mask[s:s + 64] = False
    assert torch.equal(real[0][mask], ctrl[0][mask])          # only the needle queries differ
    # every key block carries a direction of the same norm: no compressed key stands out on its own
    block_means = real[1].view(32, 64, 2, 64).mean(1).norm(dim=-1)
    assert float(block_means.max() / block_means.min()) < 1.5
    with pytest.raises(ValueError, match="needle_logit"):
        synthetic_sequence(2048, 4, 2, 64, 3, torch.float32, "cpu", needle_logit=float("nan"))


def test_needle_recall():
    idx = torch.full((2, 300, 3), -1, dtype=torch.int32)
    idx[0, 100:164, 0] = 1                      # head 0: every query of the run selects block 1
    idx[1, 100:132, 1] = 1                      # head 1: half of them
    assert needle_recall(idx, [Needle(1, 100, 0), Needle(1, 100, 1), Needle(1, 100, None), (2, 100)]) == \
        [1.0, 0.5, 0.75, 0.0]


# ----------------------------------------------------------------------------------- mass captured


def brute_force_mass(q, k, cu_q, cu_k, idx, bs):
    """Per (query head, token): dense causal softmax summed over the selected blocks, float64, loops."""
    HQ, H = q.shape[1], k.shape[1]
    G = HQ // H
    mass = torch.full((HQ, q.shape[0]), float("nan"), dtype=torch.float64)
    keys = torch.full((H, q.shape[0]), float("nan"), dtype=torch.float64)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        Lq, Lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        for r in range(Lq):
            t = cq[b] + r
            last = r + Lk - Lq
            kk = k[ck[b]:ck[b] + last + 1].double()
            for h in range(H):
                sel = {int(x) for x in idx[h, t] if 0 <= x < -(-Lk // bs)}
                inside = torch.tensor([j // bs in sel for j in range(last + 1)])
                keys[h, t] = inside.double().mean()
                for g in range(G):
                    p = torch.softmax(kk[:, h] @ q[t, h * G + g].double() / q.shape[2] ** 0.5, 0)
                    mass[h * G + g, t] = p[inside].sum()
    return mass, keys


def test_attention_mass_captured_matches_brute_force():
    lq, lk = [150, 40], [150, 100]                       # one chunked-prefill sequence
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lq), 4, 8, generator=g, dtype=torch.float64)
    k = 3 * torch.randn(sum(lk), 2, 8, generator=g, dtype=torch.float64)
    cuq, cuk = cu_seqlens_from_lengths(lq), cu_seqlens_from_lengths(lk)
    idx = torch.randint(-1, 4, (2, sum(lq), 3), generator=g, dtype=torch.int32)
    idx[..., 2] = idx[..., 1]                            # duplicates count once
    got = attention_mass_captured(q, k, cuq, idx, cu_seqlens_k=cuk, block_size=32, chunk_elems=500)
    want_mass, want_keys = brute_force_mass(q, k, cuq, cuk, idx, 32)
    assert isinstance(got, CapturedMass) and got.mass.dtype == torch.float32
    torch.testing.assert_close(got.mass.double(), want_mass, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.key_fraction.double(), want_keys, atol=1e-6, rtol=0)
    # all causal blocks selected -> everything captured; several selections share one pass
    every = torch.arange(5, dtype=torch.int32).expand(2, sum(lq), 5).contiguous()
    both = attention_mass_captured(q, k, cuq, {"some": idx, "all": every}, cu_seqlens_k=cuk, block_size=32)
    torch.testing.assert_close(both["some"].mass, got.mass)
    assert torch.allclose(both["all"].mass, torch.ones(1, dtype=torch.float32))
    assert torch.allclose(both["all"].key_fraction, torch.ones(1, dtype=torch.float32))
    with pytest.raises(TypeError, match=r"\btopk_idx\b"):
        attention_mass_captured(q, k, cuq, [idx], cu_seqlens_k=cuk)
    with pytest.raises(ValueError, match=r"\btopk_idx\b"):
        attention_mass_captured(q, k, cuq, idx[:1], cu_seqlens_k=cuk)


def test_sweep_summaries_and_plots(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = structured_sequence(1024, 4, 2, 32, local_len=64, topic_len=128, dtype=torch.float32)
    cfg = InfLLMv2Config(topk=2, local_blocks=2, dense_len=0)
    _, aux = naive_infllmv2_attention(data.q, data.k, data.v, data.cu_seqlens, data.cu_seqlens, 1024, 1024,
                                      cfg, return_aux=True)
    sweep = topk_sweep(aux["block_scores"], data.cu_seqlens, 1024, [2, 4, 8], cfg)
    assert torch.equal(sweep[2], aux["topk_idx"]) and sweep[8].shape[-1] == 10
    # topk = init_blocks + 1 = 2 keeps exactly the forced blocks: block 0 and the 3 ending at the query's
    qb = torch.arange(1024) // 64
    want = torch.stack([torch.zeros_like(qb), qb - 2, qb - 1, qb], -1)[qb >= 4]
    assert torch.equal(sweep[2][0, qb >= 4].long(), want) and torch.equal(sweep[2][1, qb >= 4].long(), want)
    with pytest.raises(ValueError, match=r"topks\[1\] must be at least init_blocks \+ 1 = 2, got 0"):
        topk_sweep(aux["block_scores"], data.cu_seqlens, 1024, [2, 0], cfg)
    cm = attention_mass_captured(data.q, data.k, data.cu_seqlens, sweep)
    sums = [summarize_mass(cm[t], data.cu_seqlens, from_position=512) for t in (2, 4, 8)]
    assert [s["tokens"] for s in sums] == [512] * 3
    masses = [s["mass"] for s in sums]
    assert masses == sorted(masses) and 0 < masses[0] < masses[-1] <= 1     # more budget keeps more mass
    assert sums[1]["mass_per_head"].shape == (4,) and sums[1]["mass_per_kv_head"].shape == (2,)
    per_block = per_query_block(cm[2].mass, data.cu_seqlens)
    assert per_block.shape == (4, 16) and torch.allclose(per_block[:, :3], torch.ones(4, 3))
    figs = [viz.plot_selection_maps(aux["topk_idx"], data.cu_seqlens, needles=data.needles),
            viz.plot_block_score_maps(aux["block_scores"], data.cu_seqlens, needles=data.needles),
            viz.plot_mass_by_query_block({"topk 2": per_block.mean(0)}).figure,
            viz.plot_mass_vs_topk([2, 4, 8], sums).figure, viz.plot_mass_per_head(sums[1]).figure]
    for i, f in enumerate(figs):
        f.savefig(tmp_path / f"{i}.png", dpi=40)
        plt.close(f)
    assert len(list(tmp_path.glob("*.png"))) == 5
    with pytest.raises(ValueError, match=r"\btopks\b"):
        viz.plot_mass_vs_topk([2, 4], sums)


# ------------------------------------------------------------------------------------ size choice


@pytest.mark.parametrize("notebook", ["01_infllmv2_selection", "02_decode", "03_pattern_gallery"])
@pytest.mark.parametrize("nb_smoke, smoke, why", [(None, True, "no CUDA GPU"), ("0", False, "NB_SMOKE=0"),
                                                  ("1", True, "NB_SMOKE=1")])
def test_notebook_picks_its_size(notebook, nb_smoke, smoke, why, tmp_path):
    """Without a GPU notebooks 02 and 03 take the small size by itself and say why, notebook 01 the full
    one (its CPU implementations run 32k tokens in about a minute); NB_SMOKE forces either."""
    if notebook == "01_infllmv2_selection" and nb_smoke is None:
        smoke = False
    import os
    import sys

    jupytext = pytest.importorskip("jupytext")
    nb = jupytext.read(NOTEBOOK_DIR / f"{notebook}.py")
    setup = next(c.source for c in nb.cells if c.cell_type == "code")     # the first cell: sizes only
    env = {k: v for k, v in os.environ.items() if k != "NB_SMOKE"}
    env.update(CUDA_VISIBLE_DEVICES="", NB_FIG_DIR=str(tmp_path),
               **({"NB_SMOKE": nb_smoke} if nb_smoke else {}))
    out = subprocess.run([sys.executable, "-c", setup + "\nprint('SMOKE', SMOKE, T)"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    assert f"SMOKE {smoke} {2048 if smoke else 32768}" in out, out
    assert f"{'small' if smoke else 'full'} size ({why})" in out, out
    assert ("NB_SMOKE=0 forces the full" in out) == (nb_smoke is None and smoke), out
