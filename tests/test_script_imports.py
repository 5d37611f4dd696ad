"""Benchmark scripts share code only through `benchmarks/_harness.py`, and tools never import a
benchmark script (they may import `_harness`). `tools/` is not a package and the scripts add folders to
sys.path, so import-linter cannot see these imports: this test reads every file's imports with `ast`.

KNOWN lists the imports that break the rule today (issue #41, item 5): what they take is still to move
into `_harness.py`. A new one fails, and so does an entry that no longer occurs (remove it).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

KNOWN = {
    ("benchmarks/bench_stage1.py", "benchmarks.bench_pipeline"),
    ("tools/ab_bwd_plans.py", "bench_patterns"),
    ("tools/cp_memory.py", "benchmarks.bench_cp"),
    ("tools/profile_transformers.py", "benchmarks.bench_transformers"),
}


def script_imports(source: str) -> set[str]:
    """The benchmark scripts a file imports, anywhere in it: `benchmarks.<script>` (not `_harness`),
    `from benchmarks import <script>`, or a bare `bench_*` module (a script's folder on sys.path)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "benchmarks":
                names += [f"benchmarks.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "benchmarks" and len(parts) > 1 and parts[1] != "_harness":
                found.add(".".join(parts[:2]))
            elif parts[0].startswith("bench_"):
                found.add(parts[0])
    return found


def test_checker_finds_each_form():
    src = ("import benchmarks._harness\nfrom benchmarks._harness import Row\nimport benchmarks.bench_cp\n"
           "from benchmarks.bench_stage2 import _short\nfrom benchmarks import bench_decode as bd, _harness\n"
           "def f():\n    import bench_patterns\n")
    assert script_imports(src) == {"benchmarks.bench_cp", "benchmarks.bench_stage2",
                                   "benchmarks.bench_decode", "bench_patterns"}


@pytest.mark.parametrize("folder", ["benchmarks", "tools"])
def test_scripts_share_code_only_through_harness(folder):
    files = sorted((ROOT / folder).glob("*.py"))
    assert files, f"no scripts under {folder}/"
    found = {(p.relative_to(ROOT).as_posix(), m) for p in files if p.name != "_harness.py"
             for m in script_imports(p.read_text())}
    known = {k for k in KNOWN if k[0].startswith(folder + "/")}
    assert not found - known, (f"{sorted(found - known)}: import shared code from benchmarks/_harness.py "
                               "(move it there), not from a benchmark script")
    assert not known - found, f"{sorted(known - found)} no longer occur: remove them from KNOWN"
