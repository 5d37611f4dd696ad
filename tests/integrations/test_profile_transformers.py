"""tools/profile_transformers.py on CPU at a tiny size: both phases run and print a table per
implementation."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--dtype", "float32", "--context", "320", "--layers", "1", "--hidden", "64",
        "--intermediate", "128", "--hq", "4", "--h", "2", "--d", "16", "--vocab", "64", "--dense-len", "256",
        "--topk", "4", "--window", "128", "--top", "5"]


def _tool():
    spec = importlib.util.spec_from_file_location("profile_transformers",
                                                  ROOT / "tools" / "profile_transformers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_profile_transformers_runs_on_cpu(capsys):
    tool = _tool()
    for phase, impls in (("prefill", "sdpa_static,ours"), ("decode", "ours_dynamic")):
        results = tool.main([*TINY, "--phase", phase, "--steps", "2", "--impls", impls])
        out = capsys.readouterr().out
        assert [r["impl"] for r in results] == impls.split(",")
        for r in results:
            assert r["wall_ms"] > 0 and r["kernels"], r["impl"]
            assert all(calls >= 1 and us > 0 for _, calls, us in r["kernels"])
            head = f"== {r['impl']}: {phase}, {320 if phase == 'prefill' else 2} token(s) =="
            block = out[out.index(head):].split("\n\n")[0].splitlines()
            assert len(block) < 40 and any("aten::" in line for line in block), block
    with pytest.raises(SystemExit):
        tool.main([*TINY, "--steps", "0"])
