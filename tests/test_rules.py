"""The small rules of ARCHITECTURE.md §1 stay written once: no module of the package outside `_rules.py`
checks a block size against the key block itself (`!= KV_BLOCK` or `!= 64`: the kernels' rule,
`_rules.check_kernel_block`; `% KV_BLOCK` or `% 64`: the layouts' rule, `_rules.check_block_multiple`)
and raises. The scan runs on the source (`ast`), and catches a copy planted in a copy of the package."""
from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the names a block size goes by: block_size, config.block_size, block_k, kv_block, BLOCK_N, ...
BLOCK_NAME = re.compile(r"(block_size|block_k|kv_block|block_n)$", re.IGNORECASE)

# (file under infllm_cupy/, rule, name) -> why that check is not the rule of `_rules.py`
ALLOWED = {
    ("distributed/cp.py", "!=", "block_size"):
        "context parallelism needs 64-key blocks on every path, the references' too (the zigzag chunks "
        "are whole 64-key blocks); the kernels' rule leaves the references any block size",
    ("patterns/sparge.py", "!=", "block_k"):
        "SpargeAttn's BLKK: the key block of the predicted layout (BlockLayout's columns) on every path, "
        "the torch predictor's too; not a kernel's block",
}

FIX = {"!=": "_rules.check_kernel_block", "%": "_rules.check_block_multiple"}


def _block_name(node: ast.AST) -> str | None:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name if name and BLOCK_NAME.search(name) else None


def _is_key_block(node: ast.AST) -> bool:
    """`KV_BLOCK` (or `_rules.KV_BLOCK`) or the literal 64."""
    if isinstance(node, ast.Constant):
        return node.value == 64 and not isinstance(node.value, bool)
    return (isinstance(node, ast.Name) and node.id == "KV_BLOCK") or \
        (isinstance(node, ast.Attribute) and node.attr == "KV_BLOCK")


def _block_checks(test: ast.AST) -> list[tuple[str, str]]:
    """`(rule, name)` of every `name != KV_BLOCK` (either order) and `name % KV_BLOCK` in an `if` test."""
    found = []
    for node in ast.walk(test):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for op, a, b in zip(node.ops, sides, sides[1:]):
                if isinstance(op, ast.NotEq):
                    for x, y in ((a, b), (b, a)):
                        if _block_name(x) and _is_key_block(y):
                            found.append(("!=", _block_name(x)))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and _block_name(node.left) \
                and _is_key_block(node.right):
            found.append(("%", _block_name(node.left)))
    return found


def block_size_copies(package: Path, exclude: tuple[str, ...] = ()) -> list[str]:
    """`file:line: ...` of every block-size check against the key block that raises, in the modules of
    `package` other than `_rules.py` (and `exclude`, paths relative to `package`), less `ALLOWED`."""
    bad = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel == "_rules.py" or rel.startswith(exclude):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.If) or not any(isinstance(n, ast.Raise)
                                                       for s in node.body for n in ast.walk(s)):
                continue
            for rule, name in _block_checks(node.test):
                if (rel, rule, name) not in ALLOWED:
                    bad.append(f"{package.name}/{rel}:{node.lineno}: `{name} {rule} KV_BLOCK` raises: "
                               f"call {FIX[rule]} (or allow it in tests/test_rules.py's ALLOWED, with why)")
    return bad


def test_the_block_size_rules_are_written_once():
    bad = block_size_copies(ROOT / "infllm_cupy")
    assert not bad, "block-size rules written outside _rules.py:\n" + "\n".join(bad)


def test_every_allowed_block_check_still_exists():
    """An entry of ALLOWED whose check is gone is dropped, not kept as a blind spot."""
    present = set()
    for rel, _, _ in ALLOWED:
        tree = ast.parse((ROOT / "infllm_cupy" / rel).read_text())
        present |= {(rel, rule, name) for node in ast.walk(tree) if isinstance(node, ast.If)
                    for rule, name in _block_checks(node.test)}
    assert set(ALLOWED) <= present, set(ALLOWED) - present


def test_the_block_size_scan_catches_a_planted_copy(tmp_path):
    """The scan fails on each rule copied into a module, naming the file and line, and on nothing else."""
    shutil.copytree(ROOT / "infllm_cupy", tmp_path / "infllm_cupy",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    attention = tmp_path / "infllm_cupy" / "stage2" / "attention.py"
    source = attention.read_text()
    first = source.count("\n") + 3
    attention.write_text(source + (
        "\n\ndef _planted(cfg, kv_block):\n"
        "    if cfg.block_size != 64:  # planted\n"
        "        raise ValueError('config.block_size must be 64')\n"
        "    if isinstance(kv_block, bool) or kv_block % KV_BLOCK:  # planted\n"
        "        raise ValueError('kv_block must be a positive multiple of 64')\n"
        "    if cfg.block_size != 64:  # no raise: not a check\n"
        "        return None\n"))
    bad = block_size_copies(tmp_path / "infllm_cupy")
    planted = [b for b in bad if b.startswith("infllm_cupy/stage2/attention.py:")]
    assert planted == [
        f"infllm_cupy/stage2/attention.py:{first + 1}: `block_size != KV_BLOCK` raises: call "
        "_rules.check_kernel_block (or allow it in tests/test_rules.py's ALLOWED, with why)",
        f"infllm_cupy/stage2/attention.py:{first + 3}: `kv_block % KV_BLOCK` raises: call "
        "_rules.check_block_multiple (or allow it in tests/test_rules.py's ALLOWED, with why)",
    ], bad
