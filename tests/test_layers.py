"""The import rules of ARCHITECTURE.md §4, written as import-linter contracts in pyproject.toml
([tool.importlinter]), hold on this tree and fail on a planted violation; and the rules a contract
cannot state (what is imported at package import time) hold too.

The contracts run in a subprocess on a copy of the package with one import added: the copy comes first
on PYTHONPATH, so import-linter reads it and not the installed tree.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

needs_import_linter = pytest.mark.skipif(
    importlib.util.find_spec("importlinter") is None,
    reason='import-linter not installed (the test extra: pip install -e ".[test]")')

LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def _lint(tree: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on the package under `tree` with the contracts of `tree/pyproject.toml`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]),
               COLUMNS="200")
    return subprocess.run([sys.executable, "-c", LINT, "--no-cache"], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def _copy(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(ROOT / "infllm_cupy", tmp_path / "infllm_cupy",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return tmp_path


@needs_import_linter
def test_this_tree_keeps_every_import_contract():
    res = _lint(ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout, res.stdout


# (file under infllm_cupy/, the import planted at its end, a line of the report that names the violation)
PLANTED = {
    "stage2 takes stage 1's reference": (
        "stage2/naive.py", "from ..stage1.naive import naive_stage1_select",
        "infllm_cupy.stage2 is not allowed to import infllm_cupy.stage1"),
    "compression imports the pipeline": (
        "compress/mean_pool.py", "from .. import pipeline",
        "infllm_cupy.compress is not allowed to import infllm_cupy.pipeline"),
    "a stage-2 op in the pattern zoo": (
        "stage2/attention.py", "from ..patterns import local_stride",
        "infllm_cupy.stage2 is not allowed to import infllm_cupy.patterns"),
    "the pipeline imports decode": (
        "pipeline.py", "from .decode import naive",
        "infllm_cupy.pipeline is not allowed to import infllm_cupy.decode"),
    "decode imports the pipeline": (
        "decode/step.py", "from .. import pipeline",
        "infllm_cupy.decode is not allowed to import infllm_cupy.pipeline"),
    "the core imports the pipeline": (
        "prefill.py", "from . import pipeline",
        "infllm_cupy.prefill is not allowed to import infllm_cupy.pipeline"),
    "a stage imports the core": (
        "stage2/attention.py", "from .. import prefill",
        "infllm_cupy.stage2 is not allowed to import infllm_cupy.prefill"),
    "the loader knows a stage": (
        "_jit.py", "from .stage2 import plan",
        "infllm_cupy._jit is not allowed to import infllm_cupy.stage2"),
    "plotting on the hot path": (
        "stage1/select.py", "from .. import viz",
        "infllm_cupy.stage1 is not allowed to import infllm_cupy.viz"),
    "test helpers on the hot path": (
        "pipeline.py", "from . import testing",
        "infllm_cupy.pipeline is not allowed to import infllm_cupy.testing"),
    "the forward imports the backward": (
        "stage2/sparse_fwd.py", "from . import sparse_bwd",
        "infllm_cupy.stage2.sparse_fwd is not allowed to import infllm_cupy.stage2.sparse_bwd"),
    "a reference imports a plan": (
        "stage1/naive.py", "from .plan import Stage1Plan",
        "infllm_cupy.stage1.naive is not allowed to import infllm_cupy.stage1.plan"),
    "a reference reaches a launcher": (
        "compress/naive.py", "from .. import _launch",
        "infllm_cupy.compress.naive is not allowed to import infllm_cupy._launch"),
    "the CPU implementation reaches the loader": (
        "stage2/cpu.py", "from .. import _launch",
        "infllm_cupy.stage2.cpu is not allowed to import infllm_cupy._launch"),
    "the decode reference imports a launcher": (
        "decode/naive.py", "from . import sparse_decode",
        "infllm_cupy.decode.naive is not allowed to import infllm_cupy.decode.sparse_decode"),
    "decode takes a stage-1 internal": (
        "decode/step.py", "from ..stage1.select import launch_select",
        "infllm_cupy.decode is not allowed to import infllm_cupy.stage1.select"),
    "the pattern zoo takes a decode internal": (
        "patterns/decode.py", "from ..decode.naive import cache_tensors",
        "infllm_cupy.patterns is not allowed to import infllm_cupy.decode.naive"),
    "compat takes a stage-1 internal": (
        "compat/infllm_v2.py", "from ..stage1.pool import pool_blocks",
        "infllm_cupy.compat is not allowed to import infllm_cupy.stage1.pool"),
    "compat takes a decode internal": (
        "compat/infllm_v2.py", "from ..decode.sparse_decode import MAX_GROUP",
        "infllm_cupy.compat is not allowed to import infllm_cupy.decode.sparse_decode"),
    "the package imports a benchmark": (
        "stage2/layout.py", "import benchmarks._harness",
        "infllm_cupy is not allowed to import benchmarks"),
}


@needs_import_linter
@pytest.mark.parametrize("case", sorted(PLANTED))
def test_a_planted_violation_breaks_a_contract(case, tmp_path):
    path, line, report = PLANTED[case]
    tree = _copy(tmp_path)
    with open(tree / "infllm_cupy" / path, "a") as f:
        f.write(f"\n{line}  # planted\n")
    res = _lint(tree)
    assert res.returncode != 0, f"{case}: no contract broken\n{res.stdout}"
    out = " ".join(res.stdout.split())
    assert " ".join(report.split()) in out, f"{case}: expected {report!r} in\n{res.stdout}{res.stderr}"


@needs_import_linter
def test_a_module_outside_the_layers_breaks_the_layer_contract(tmp_path):
    """Every module directly under infllm_cupy/ has a place in the layer picture (exhaustive layers)."""
    tree = _copy(tmp_path)
    (tree / "infllm_cupy" / "unplaced.py").write_text('"""A module in no layer."""\n')
    res = _lint(tree)
    assert res.returncode != 0
    assert "infllm_cupy.unplaced" in res.stdout + res.stderr, res.stdout + res.stderr


def test_importing_the_package_imports_no_gpu_plotting_or_model_stack():
    """CuPy (the gpu extra), matplotlib (viz.py's plot functions) and transformers (the integrations)
    are imported where they are used, not when any module of the package is imported."""
    code = ("import importlib, pkgutil, sys, infllm_cupy\n"
            "for m in pkgutil.walk_packages(infllm_cupy.__path__, 'infllm_cupy.'):\n"
            "    if not m.name.endswith('__main__'):\n"
            "        importlib.import_module(m.name)\n"
            "print(' '.join(sorted({n.split('.')[0] for n in sys.modules} & "
            "{'cupy', 'cupy_backends', 'matplotlib', 'transformers'})))\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "", f"imported at package import time: {res.stdout.strip()}"


def _package_modules():
    """`{dotted name: (path, is a package __init__)}` of every module of the package."""
    out = {}
    for path in (ROOT / "infllm_cupy").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        init = parts[-1] == "__init__"
        out[".".join(parts[:-1] if init else parts)] = (path, init)
    return out


def _defined_names(tree: ast.Module) -> set[str]:
    """Names a module defines at its top level (functions, classes, assignments), not ones it imports;
    `"*"` for a module with a module-level `__getattr__` (attributes made on first use)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add("*" if node.name == "__getattr__" else node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _facade_imports(modules, root=ROOT) -> list[tuple[str, int, str, str]]:
    """`(importer, line, source, name)` of every `from M import name` whose M is a module of the package
    (not a package: a package's `__init__` is its public surface) that does not define `name` itself:
    in the package (relative or absolute imports) and in tests/, benchmarks/, tools/ and notebooks/."""
    defined = {m: _defined_names(ast.parse(p.read_text())) for m, (p, _) in modules.items()}
    files = [(name, path, init) for name, (path, init) in modules.items()]
    files += [(None, p, False) for d in ("tests", "benchmarks", "tools", "notebooks")
              for p in (root / d).rglob("*.py")]
    bad = []
    for name, path, init in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or (node.level and name is None):
                continue
            source = node.module or ""
            if node.level:
                base = (name if init else name.rsplit(".", 1)[0]).split(".")
                source = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            if source in modules and not modules[source][1] and "*" not in defined[source]:
                bad += [(name or str(path.relative_to(root)), node.lineno, source, a.name) for a in node.names
                        if a.name not in defined[source] and f"{source}.{a.name}" not in modules]
    return bad


def test_every_name_is_imported_from_the_module_that_defines_it():
    """No facades: a name is imported from the module that defines it, never through a module that only
    imported it (a package's `__init__`, its public surface, may gather names)."""
    bad = _facade_imports(_package_modules())
    assert not bad, "\n".join(f"{i}:{line} imports {n} from {s}, which does not define it"
                               for i, line, s, n in bad)


def test_the_facade_rule_catches_a_re_export(tmp_path):
    """The rule above fails on a planted re-export: a module importing a name through another module."""
    shutil.copytree(ROOT / "infllm_cupy", tmp_path / "infllm_cupy")
    pipeline = tmp_path / "infllm_cupy" / "pipeline.py"
    pipeline.write_text(pipeline.read_text() + "\nfrom .prefill import KV_BLOCK  # planted\n")
    modules = {m: (tmp_path / p.relative_to(ROOT), i) for m, (p, i) in _package_modules().items()}
    bad = [(i, s, n) for i, _, s, n in _facade_imports(modules, tmp_path)]
    assert ("infllm_cupy.pipeline", "infllm_cupy.prefill", "KV_BLOCK") in bad


def _private_uses(modules) -> list[str]:
    """Where a package module uses another module's private name: `from M import _x` of a module M of
    the package (the package's `_`-prefixed modules themselves may be imported), or an attribute
    `obj._x` that no class or assignment of the same module defines (another class's private state,
    such as a `DecodeCache`'s, touched from outside decode/cache.py). Private names of other libraries
    (`cupy.cuda.compiler._...`) are not the package's to police."""
    bad = []
    for name, (path, init) in modules.items():
        tree = ast.parse(path.read_text())
        package = name if init else name.rsplit(".", 1)[0]
        owned = {n.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for n in c.body
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        owned |= {t.attr for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign))
                  for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                  if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
        foreign = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    base = package.split(".")
                    source = ".".join(base[:len(base) - node.level + 1] + [node.module or ""]).rstrip(".")
                if source.split(".")[0] != "infllm_cupy":
                    foreign |= {a.asname or a.name for a in node.names}
                    continue
                bad += [f"{name}:{node.lineno} imports {a.name} from {source}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")
                        and f"{source}.{a.name}" not in modules]
            elif isinstance(node, ast.Import):
                foreign |= {(a.asname or a.name).split(".")[0] for a in node.names}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.attr not in owned
                    and node.value.id not in foreign | {"self", "cls"}):
                bad.append(f"{name}:{node.lineno} uses {node.value.id}.{node.attr}")
    return bad


def test_no_private_name_or_state_crosses_modules():
    """A name starting with `_` stays in its module, and an object's private state (`cache._host_lens`,
    ...) is touched only by its own class: `DecodeCache`'s state only in decode/cache.py."""
    bad = _private_uses(_package_modules())
    assert not bad, "\n".join(bad)


def test_the_private_rule_catches_a_planted_use(tmp_path):
    shutil.copytree(ROOT / "infllm_cupy", tmp_path / "infllm_cupy")
    step = tmp_path / "infllm_cupy" / "decode" / "step.py"
    step.write_text(step.read_text() + "\n\ndef _planted(cache):\n    return cache._host_lens\n")
    modules = {m: (tmp_path / p.relative_to(ROOT), i) for m, (p, i) in _package_modules().items()}
    assert any("uses cache._host_lens" in b for b in _private_uses(modules))
