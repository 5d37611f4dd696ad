"""kernels_cu/README.md, the kernel index, agrees with the tree (CPU, no GPU needed).

1. Every `.cu` and `.cuh` file under kernels_cu/ has its row, and every file a row names exists.
2. Every `__global__` kernel of the `.cu` files and every kernel a launcher registers
   (`_jit.register_instances`, template arguments stripped) has exactly one row, under its area, with
   its source file and arch (sm_90a or not) as the registry holds them.
3. Every launcher module a row names imports, names the row's `.cu` file, and defines the named
   function, which launches kernels (`_jit.get_kernel` or `Launches.add`).
4. Every design cite names an existing `docs/` section by number and title.

Each check works on the index's text, so the last test plants stale rows and checks they are caught.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from functools import cache
from pathlib import Path

import pytest

from infllm_cupy import _jit

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "kernels_cu"
INDEX = KERNELS / "README.md"
AREAS = ("compress", "stage1", "stage2", "decode")
ARCHS = ("sm_80", "sm_90a")

_CODE = re.compile(r"`([^`]+)`")
_DESIGN = re.compile(r"`(docs/[\w-]+\.md)` §(\d+) (.+)")
_GLOBAL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)\s*)?(\w+)\s*\(")
_LAUNCHES = re.compile(r"\bget_kernel\(|\.add\(")


@dataclasses.dataclass(frozen=True)
class Row:
    line: int
    area: str
    kernel: str
    source: str
    arch: str
    module: str
    functions: tuple[str, ...]
    design: str


@dataclasses.dataclass
class Index:
    rows: list[Row]
    headers: dict[str, int]          # header path -> line
    problems: list[str]              # rows that do not parse


def _cell(text: str) -> str | None:
    m = _CODE.fullmatch(text)
    return m.group(1) if m else None


def parse_index(text: str) -> Index:
    idx = Index([], {}, [])
    section = area = ""
    for i, line in enumerate(text.splitlines(), 1):
        if line.startswith("## "):
            section, area = line[3:].strip(), ""
        elif line.startswith("### "):
            area = line[4:].strip()
        if not line.startswith("|") or re.fullmatch(r"\|[-|\s]+\|", line):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("Kernel", "Header"):
            continue
        if section == "Kernels":
            names = [_cell(cells[j]) for j in (0, 1, 3)] if len(cells) == 6 else [None]
            funcs = tuple(_CODE.findall(cells[4])) if len(cells) == 6 else ()
            if None in names or not funcs:
                idx.problems.append(f"README.md:{i}: not a row of six cells `kernel` | `source` | arch | "
                                    f"`module` | `function`, ... | design: {line}")
                continue
            idx.rows.append(Row(i, area, names[0], names[1], cells[2], names[2], funcs, cells[5]))
        elif section == "Shared headers":
            hdr = _cell(cells[0])
            if hdr is None or len(cells) != 2:
                idx.problems.append(f"README.md:{i}: not a row `header` | holds: {line}")
                continue
            idx.headers[hdr] = i
    return idx


# ------------------------------------------------------------------------------------- the tree

def _rel(p: Path) -> str:
    return p.relative_to(KERNELS).as_posix()


@cache
def _global_kernels() -> dict[str, str]:
    """kernel -> `.cu` file, from the `__global__` definitions (comments stripped)."""
    out: dict[str, str] = {}
    for path in sorted(KERNELS.rglob("*.cu")):
        code = re.sub(r"//[^\n]*|/\*.*?\*/", "", path.read_text(), flags=re.S)
        for name in _GLOBAL.findall(code):
            out[name] = _rel(path)
    return out


@cache
def _registry() -> dict[str, frozenset[tuple[str, bool]]]:
    """kernel -> {(source, sm90a)} of every instance a launcher registers. Imports every package module
    that calls `register_instances`, so a launcher no other module imports still counts."""
    for path in sorted((ROOT / "infllm_cupy").rglob("*.py")):
        if path.name != "_jit.py" and "register_instances(" in path.read_text():
            parts = path.relative_to(ROOT).with_suffix("").parts
            importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    out: dict[str, set[tuple[str, bool]]] = {}
    for ks in _jit.registered():
        for name in ks.names:
            out.setdefault(name.split("<", 1)[0].strip(), set()).add((ks.source, ks.sm90a))
    return {k: frozenset(v) for k, v in out.items()}


@cache
def _doc_sections(doc: str) -> dict[int, str]:
    text = (ROOT / doc).read_text()
    return {int(m.group(1)): m.group(2).strip() for m in re.finditer(r"^## (\d+)\.\s+(.+)$", text, re.M)}


# ------------------------------------------------------------------------------------ the checks

def file_problems(idx: Index) -> list[str]:
    problems = list(idx.problems)
    sources = {r.source for r in idx.rows}
    for path in sorted(KERNELS.rglob("*.cu")):
        if _rel(path) not in sources:
            problems.append(f"kernels_cu/{_rel(path)} has no row in the kernel tables")
    for path in sorted(KERNELS.rglob("*.cuh")):
        if _rel(path) not in idx.headers:
            problems.append(f"kernels_cu/{_rel(path)} has no row in the shared-header table")
    for r in idx.rows:
        if not (KERNELS / r.source).is_file() or not r.source.endswith(".cu"):
            problems.append(f"README.md:{r.line}: kernels_cu/{r.source} is not a .cu file")
    for hdr, line in idx.headers.items():
        if not (KERNELS / hdr).is_file() or not hdr.endswith(".cuh"):
            problems.append(f"README.md:{line}: kernels_cu/{hdr} is not a .cuh file")
    return problems


def kernel_problems(idx: Index) -> list[str]:
    problems = []
    rows: dict[str, Row] = {}
    for r in idx.rows:
        if r.kernel in rows:
            problems.append(f"README.md:{r.line}: {r.kernel} has a row already (line {rows[r.kernel].line})")
        rows.setdefault(r.kernel, r)
        if r.area not in AREAS or r.source.split("/")[0] != r.area:
            problems.append(f"README.md:{r.line}: {r.kernel} ({r.source}) is under '### {r.area}'")
        if r.arch not in ARCHS:
            problems.append(f"README.md:{r.line}: arch {r.arch!r} is not one of {ARCHS}")
    for name, src in _global_kernels().items():
        if name not in rows:
            problems.append(f"__global__ {name} (kernels_cu/{src}) has no row")
        elif rows[name].source != src:
            problems.append(f"README.md:{rows[name].line}: {name} is defined in {src}, "
                            f"not {rows[name].source}")
    for name, where in _registry().items():
        r = rows.get(name)
        if r is None:
            problems.append(f"registered kernel {name} ({sorted(where)}) has no row")
        elif where != {(r.source, r.arch == "sm_90a")}:
            problems.append(f"README.md:{r.line}: {name} is registered as {sorted(where)} (source, sm90a), "
                            f"the row says {r.source}, {r.arch}")
    for name, r in rows.items():
        if name not in _global_kernels() and name not in _registry():
            problems.append(f"README.md:{r.line}: {name} is neither a __global__ kernel nor registered")
    return problems


def launcher_problems(idx: Index) -> list[str]:
    problems = []
    for r in idx.rows:
        if not r.module.startswith("infllm_cupy."):
            problems.append(f"README.md:{r.line}: {r.module} is not a module of infllm_cupy")
            continue
        try:
            mod = importlib.import_module(r.module)
        except ImportError as e:
            problems.append(f"README.md:{r.line}: {r.module} does not import: {e}")
            continue
        if r.source not in inspect.getsource(mod):
            problems.append(f"README.md:{r.line}: {r.module} never names {r.source}")
        for fn in r.functions:
            obj = getattr(mod, fn, None)
            if not inspect.isfunction(obj) or obj.__module__ != r.module:
                problems.append(f"README.md:{r.line}: {r.module} defines no function {fn}")
            elif not _LAUNCHES.search(inspect.getsource(obj)):
                problems.append(f"README.md:{r.line}: {r.module}.{fn} launches nothing (no get_kernel or "
                                f"Launches.add)")
    return problems


def design_problems(idx: Index) -> list[str]:
    problems = []
    for r in idx.rows:
        m = _DESIGN.fullmatch(r.design)
        if not m:
            problems.append(f"README.md:{r.line}: design cell {r.design!r} is not a docs/ file in backticks, "
                            "§N and the section's title")
            continue
        doc, n, title = m.group(1), int(m.group(2)), m.group(3).strip()
        if not (ROOT / doc).is_file():
            problems.append(f"README.md:{r.line}: {doc} does not exist")
        elif _doc_sections(doc).get(n) != title:
            problems.append(f"README.md:{r.line}: {doc} §{n} is {_doc_sections(doc).get(n)!r}, not {title!r}")
    return problems


# ------------------------------------------------------------------------------------- the tests

@cache
def _index() -> Index:
    return parse_index(INDEX.read_text())


def test_kernel_index_parses():
    idx = _index()
    assert len(idx.rows) >= 20 and len(idx.headers) >= 10, (f"found {len(idx.rows)} kernel rows and "
                                                           f"{len(idx.headers)} header rows: is the parser "
                                                           "still reading them?")
    assert {r.area for r in idx.rows} == set(AREAS)


def test_kernel_index_lists_every_file():
    problems = file_problems(_index())
    assert not problems, "\n".join(problems)


def test_kernel_index_lists_every_kernel():
    assert len(_global_kernels()) >= 20 and len(_registry()) >= 20, "the kernel scans found too few kernels"
    problems = kernel_problems(_index())
    assert not problems, "\n".join(problems)


def test_kernel_index_launchers_exist():
    problems = launcher_problems(_index())
    assert not problems, "\n".join(problems)


def test_kernel_index_design_sections_exist():
    problems = design_problems(_index())
    assert not problems, "\n".join(problems)


def _drop_rows(text: str, needle: str) -> str:
    return "\n".join(line for line in text.splitlines() if not (line.startswith("|") and needle in line))


@pytest.mark.parametrize("edit,check", [
    (lambda t: _drop_rows(t, "`stage2_bwd_dkdv_parts`"), kernel_problems),      # a kernel's row removed
    (lambda t: _drop_rows(t, "`select_decode_topk`"), kernel_problems),
    (lambda t: _drop_rows(t, "`compress/mean_pool.cu`"), file_problems),         # a .cu file's rows removed
    (lambda t: _drop_rows(t, "`common/pdl.cuh`"), file_problems),               # a header's row removed
    (lambda t: t.replace("`stage1/merge_cand.cu` | sm_80", "`stage1/select.cu` | sm_80"), kernel_problems),
    (lambda t: t.replace("`stage2_fwd_sm90` | `stage2/sparse_fwd_sm90.cu` | sm_90a",
                         "`stage2_fwd_sm90` | `stage2/sparse_fwd_sm90.cu` | sm_80"), kernel_problems),
    (lambda t: t.replace("`compress_k`", "`compress_keys`"), launcher_problems),  # a function renamed
    (lambda t: t.replace("`infllm_cupy.decode.cache_append`", "`infllm_cupy.decode.append`"),
     launcher_problems),
    (lambda t: t.replace("`_merge_into_kernel`", "`_merge_into_torch`"), launcher_problems),
    (lambda t: t.replace("§12 SM80 path", "§13 SM80 path"), design_problems),
])
def test_kernel_index_checks_catch_stale_rows(edit, check):
    text = INDEX.read_text()
    stale = edit(text)
    assert stale != text, "the edit no longer matches the index: update this test"
    assert not check(parse_index(text))
    assert check(parse_index(stale))
