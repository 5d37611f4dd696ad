"""README.md stays true: its quickstart runs (on CPU tensors here, on the kernels on a GPU machine), and every
repository path it names exists in a clone."""
from __future__ import annotations

import re
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_quickstart_runs():
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert blocks, "README.md has no python block"
    ns = {"__name__": "readme_quickstart"}
    exec(compile(blocks[0], "README.md (quickstart)", "exec"), ns)
    T, HQ, D = ns["T"], ns["HQ"], ns["D"]
    for name in ("out", "out2"):
        out = ns[name]
        assert out.shape == (T, HQ, D) and out.dtype == torch.bfloat16, (name, out.shape, out.dtype)
        assert torch.isfinite(out.float()).all(), name
    # the budget the quickstart's comment states
    cfg = ns["InfLLMv2Config"](topk=16, local_blocks=4, dense_len=0)
    assert "K = topk + local_blocks = 20" in blocks[0] and cfg.topk + cfg.local_blocks == 20
    # the decode block continues the quickstart's names, and says so in its first line
    assert "DecodeCache" in blocks[1] and blocks[1].startswith("# continues the Quickstart block above")
    exec(compile(blocks[1], "README.md (decode)", "exec"), ns)
    assert ns["o"].shape == (1, HQ, D) and torch.isfinite(ns["o"].float()).all()
    assert ns["cache"].lengths() == [T + 4]


def test_every_python_block_is_run():
    """README.md's python blocks: the quickstart and decode (above) and the transformers block
    (tests/integrations/test_transformers.py); a new block needs a test."""
    assert len(re.findall(r"```python\n", README)) == 3


def test_transformers_block_runs_without_warnings():
    """The transformers block (run for its results by tests/integrations/test_transformers.py) warns
    nothing: its cache keyword is the one the installed transformers names (`cache` from 5.24 on,
    `past_key_values` before; the old name warns on the new versions)."""
    import warnings

    import pytest

    pytest.importorskip("transformers")
    section = README.split("## Using with transformers / MiniCPM4", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, re.S)
    ns = {"__name__": "readme_transformers"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(compile(block, "README.md (transformers)", "exec"), ns)
    assert ns["out"].shape == (1, 528)


def test_paths_it_names_exist_in_a_clone():
    assert "../" not in README, "README.md points outside the repository"
    named = set(re.findall(r"`((?:[\w.-]+/)*[\w.-]+\.(?:md|py|sh|ipynb|cu|cuh|toml))[`\s]", README))
    named |= set(re.findall(r"`((?:[\w.-]+/)+)`", README))             # folders
    missing = []
    for p in sorted(named):
        if (REPO / p).exists():
            continue
        # files are often named relative to their folder (`compress/naive.py`, `select_sm90.cu`, `stage1.md`)
        roots = ("infllm_cupy", "kernels_cu", "benchmarks", "tools", "docs")
        if any((REPO / root / p).exists() or any((REPO / root).rglob(p)) for root in roots):
            continue
        missing.append(p)
    assert not missing, f"README.md names files a clone does not have: {missing}"
    assert (REPO / "LICENSE").read_text().lstrip().startswith("Apache License")
