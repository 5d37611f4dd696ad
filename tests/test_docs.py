"""The design documents and the code agree on names (CPU, no GPU needed).

1. Every `docs/<x>.md` cite in the code, README.md and ARCHITECTURE.md names an existing doc and,
   where it cites a section (a quoted title, `N. Title`, `§N`, `section N`), an existing section.
2. Every repository path named in README.md, ARCHITECTURE.md, the design docs and tools/README.md
   exists (docs/perf_log.md is a chronological record of paths as they were, so it is left out).
3. Code comments cite design-document sections, never the chronological log's headings.
4. The package reads the environment in one place: `INFLLM_CUPY_*` names only the four kept
   variables, and only `infllm_cupy/_env.py` touches `os.environ`.

Each failure names file:line, so a broken cite is a one-line fix.
"""
from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ["infllm_cupy", "kernels_cu", "tests", "benchmarks", "tools", "scripts", "notebooks"]
CODE_SUFFIXES = {".py", ".cu", ".cuh", ".sh", ".md", ".ipynb", ".toml"}
DESIGN_DOCS = ["README.md", "ARCHITECTURE.md", "tools/README.md"] + sorted(
    f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md") if p.name != "perf_log.md")
KEPT_ENV = {"INFLLM_CUPY_KERNELS_DIR", "INFLLM_CUPY_VALIDATE", "INFLLM_CUPY_POISON", "INFLLM_CUPY_LINEINFO"}


def _files(*dirs: str, suffixes=CODE_SUFFIXES) -> list[str]:
    """Tracked and untracked (not ignored) files under `dirs`, repository-relative."""
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", *dirs],
                         capture_output=True, text=True, check=True).stdout.split()
    return sorted({f for f in out if Path(f).suffix in suffixes and (ROOT / f).is_file()})


@cache
def _sections(doc: str) -> list[tuple[int | None, str]]:
    """`(number or None, title)` of each `## ` heading of `doc`."""
    out = []
    for m in re.finditer(r"^## (.+)$", (ROOT / doc).read_text(), re.M):
        head = m.group(1).strip()
        n = re.match(r"(\d+)\.\s+(.*)", head)
        out.append((int(n.group(1)), n.group(2).strip()) if n else (None, head))
    return out


# ------------------------------------------------------------------------------------------ 1. cites

# What may follow `docs/x.md` to name sections: `, "Title"`, ` ("A", "B")`, `, 6. Title`,
# ` (3. A, 4. B)`, ` §6`, `, section 3`.
_ITEM = re.compile(r'"(?P<title>[^"]+)"|§\s*(?P<sec>\d+)|section (?P<sec2>\d+)|'
                   r"(?P<num>\d+)\.\s+(?P<ntitle>[^,;\n\"]+?(?:\([^)\n]*\))?)(?=\)|,|;|$|\.\s|\.$)")
_SEP = re.compile(r"\s*(?:,|\band\b)\s*")


def _join_comment_lines(lines: list[str], i: int, n: int = 3) -> str:
    """Line i and the next n - 1 with their comment markers stripped, joined by spaces (a cite's
    title may wrap onto the next comment line)."""
    parts = [lines[i]] + [re.sub(r"^\s*(#|//|\*)?\s*", "", x) for x in lines[i + 1:i + n]]
    return " ".join(p.rstrip() for p in parts)


def _cited_sections(text: str):
    """Yield ("title", str) / ("num", (n, title)) / ("sec", n) for the section references at the
    start of `text` (what follows a `docs/x.md`)."""
    m = re.match(r"`?\s*(?:[,:]\s*|\s*\(\s*|\s+(?=§|section ))", text)
    if not m:
        return
    pos = m.end()
    while True:
        item = _ITEM.match(text, pos)
        if not item:
            return
        if item.group("title"):
            yield "title", item.group("title").strip()
        elif item.group("sec") or item.group("sec2"):
            yield "sec", int(item.group("sec") or item.group("sec2"))
        else:
            yield "num", (int(item.group("num")), item.group("ntitle").strip())
        sep = _SEP.match(text, item.end())
        if not sep or not sep.group(0).strip():
            return
        pos = sep.end()


def _check_cite(doc: str, kind: str, value) -> str | None:
    secs = _sections(doc)
    if kind == "title":
        if value not in {t for _, t in secs}:
            return f'{doc} has no section "{value}"'
    elif kind == "sec":
        if value not in {n for n, _ in secs}:
            return f"{doc} has no section {value}"
    else:
        n, title = value
        titles = [t for k, t in secs if k == n]
        if not titles:
            return f"{doc} has no section {n}"
        if not any(t.startswith(title) or title.startswith(t) for t in titles):
            return f'{doc} section {n} is "{titles[0]}", not "{title}"'
    return None


def _cite_problems() -> tuple[list[str], int]:
    problems, n_cites = [], 0
    for f in _files(*CODE_DIRS, "README.md", "ARCHITECTURE.md"):
        if f == "tests/test_docs.py":
            continue
        lines = (ROOT / f).read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            for m in re.finditer(r"docs/([\w-]+\.md)", line):
                doc = f"docs/{m.group(1)}"
                if doc == "docs/perf_log.md":
                    continue
                if not (ROOT / doc).exists():
                    problems.append(f"{f}:{i + 1}: {doc} does not exist")
                    continue
                joined = _join_comment_lines(lines, i)
                start = joined.index(m.group(0), m.start()) + len(m.group(0))
                for kind, value in _cited_sections(joined[start:]):
                    n_cites += 1
                    bad = _check_cite(doc, kind, value)
                    if bad:
                        problems.append(f"{f}:{i + 1}: {bad}")
    return problems, n_cites


def test_doc_cites_name_existing_docs_and_sections():
    problems, n_cites = _cite_problems()
    assert n_cites > 20, f"the cite parser found only {n_cites} section cites: is it still reading them?"
    assert not problems, "broken docs/ cites:\n" + "\n".join(problems)


@pytest.mark.parametrize("text,want", [
    (', 6. Key-range passes): one pass', [("num", (6, "Key-range passes"))]),
    (' ("The decode step", "Chunked prefill").',
     [("title", "The decode step"), ("title", "Chunked prefill")]),
    (' (3. The sm_90a kernel, 4. Top-K on a prefix, 5. Memory plan).',
     [("num", (3, "The sm_90a kernel")), ("num", (4, "Top-K on a prefix")), ("num", (5, "Memory plan"))]),
    (', 7. Fixed tiles vs gathered tokens (auto)) is',
     [("num", (7, "Fixed tiles vs gathered tokens (auto)"))]),
    ('` §6, `docs/stage2_fwd.md`', [("sec", 6)]),
    (', section 3) and', [("sec", 3)]),
    (', "CTA order").', [("title", "CTA order")]),
    ('.', []),
])
def test_cite_parser(text, want):
    assert list(_cited_sections(text)) == want


def test_cite_check_catches_a_wrong_section():
    assert _check_cite("docs/stage2_fwd.md", "num", (6, "Key-range passes")) is None
    assert _check_cite("docs/stage2_fwd.md", "num", (6, "Memory plan")) is not None
    assert _check_cite("docs/stage2_fwd.md", "sec", 99) is not None
    assert _check_cite("docs/stage2_fwd.md", "title", "No such section") is not None


# ------------------------------------------------------------------------------------------ 2. paths

_PATH = re.compile(r"(?<![\w./-])((?:infllm_cupy|kernels_cu|tests|benchmarks|tools|docs|notebooks|scripts)"
                   r"/[\w./-]*[\w/])")


def _path_problems(doc: str) -> list[str]:
    problems = []
    heading = ""
    for i, line in enumerate((ROOT / doc).read_text().splitlines()):
        if line.startswith("#"):
            heading = line
        # A section listing what is not built yet names files that do not exist on purpose.
        if "not built yet" in heading.lower():
            continue
        for m in _PATH.finditer(line):
            p = m.group(1).rstrip(".")
            tail = line[m.end():m.end() + 1]
            if tail in "<{*" and tail:      # a pattern (`kernels_cu/<family>/`, `bench_*.py`), not a path
                continue
            if not (ROOT / p).exists():
                problems.append(f"{doc}:{i + 1}: {p} does not exist")
    return problems


@pytest.mark.parametrize("doc", DESIGN_DOCS)
def test_paths_named_in_docs_exist(doc):
    problems = _path_problems(doc)
    assert not problems, "\n".join(problems)


def test_path_pattern_finds_the_docs_paths():
    found = sum(len(_PATH.findall(line)) for d in DESIGN_DOCS for line in (ROOT / d).read_text().splitlines())
    assert found > 100, \
        f"only {found} repository paths found in {DESIGN_DOCS}: is the pattern still matching?"
    assert _PATH.findall("see `kernels_cu/stage2/sparse_fwd.cu` and infllm_cupy/stage2/plan.py.") == \
        ["kernels_cu/stage2/sparse_fwd.cu", "infllm_cupy/stage2/plan.py"]


# ---------------------------------------------------------------------------- 3. chronological cites

_CHRONO = re.compile(r"NOTES\.md|\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|"
                     r"eleventh|twelfth) session|\b(forward|backward) v\d+\b", re.I)


def test_no_comment_cites_the_chronological_log():
    problems = []
    for f in _files("infllm_cupy", "kernels_cu", "tests", "benchmarks", "tools"):
        if f == "tests/test_docs.py":
            continue
        for i, line in enumerate((ROOT / f).read_text(errors="replace").splitlines()):
            m = _CHRONO.search(line)
            if m:
                problems.append(f"{f}:{i + 1}: cites {m.group(0)!r} (state the reason or cite a docs/ "
                                "section)")
    assert not problems, "\n".join(problems)


def test_chronological_pattern_matches_what_it_should():
    for s in ("see NOTES.md", "the tenth session", "forward v7", "Backward v12"):
        assert _CHRONO.search(s), s
    for s in ("InfLLM-v2", "sessions of a CUDA graph", "v2 of the API"):
        assert not _CHRONO.search(s), s


# --------------------------------------------------------------- 3b. no history, no outside paths
# The docs, code and tools describe the code; how the work went (issue numbers, sessions, lent machines,
# first attempts, what we tried) belongs in the chronological log (docs/perf_log.md) alone, and no path
# points outside the repository (a program's install location, such as compute-sanitizer's under
# /usr/local/cuda, and the scratch folders of the tools' usage lines are not document paths).
_HISTORY = re.compile(r"\bissues? ?#\d+|#\d+'s\b|\bsessions?\b|\blent\b|\bfirst attempt\b|\bwe tried\b", re.I)
_OUTSIDE = re.compile(r"(?<![\w.])/(?:work|home|root|mnt|opt)/|\.\./shared\b")


def test_docs_and_code_narrate_no_history_and_point_nowhere_outside():
    problems = []
    for f in _files("docs", "infllm_cupy", "kernels_cu", "tools", "benchmarks", "scripts") + ["README.md",
                                                                                              "ARCHITECTURE.md"]:
        if f == "docs/perf_log.md":
            continue
        for i, line in enumerate((ROOT / f).read_text(errors="replace").splitlines()):
            for pat, what in ((_HISTORY, "narrates the work"), (_OUTSIDE, "points outside the repository")):
                m = pat.search(line)
                if m:
                    problems.append(f"{f}:{i + 1}: {what}: {m.group(0)!r}")
    assert not problems, "\n".join(problems)


def test_history_patterns_match_what_they_should():
    for s in ("issue #38", "Issue #26's goals", "a1ebb00's session", "#22's bar", "see /work/shared/x.md",
              "../shared/spec", "on one lent H100", "The first attempt ran out of memory",
              "We tried L2 hints"):
        assert _HISTORY.search(s) or _OUTSIDE.search(s), s
    for s in ("issue slots 60% busy", "InfLLM-v2", "/usr/local/cuda/bin", "docs/perf_log.md", "a/b/tmp/x",
              "silently", "the first attempt_count", "a lent_ variable"):
        assert not (_HISTORY.search(s) or _OUTSIDE.search(s)), s


# ------------------------------------------------------------------------------------------ 4. env

def test_environment_read_in_one_place():
    problems = []
    for f in _files("infllm_cupy", "kernels_cu", suffixes={".py", ".cu", ".cuh"}):
        for i, line in enumerate((ROOT / f).read_text().splitlines()):
            for name in re.findall(r"INFLLM_CUPY_\w+", line):
                if name not in KEPT_ENV:
                    problems.append(f"{f}:{i + 1}: {name} is not one of {sorted(KEPT_ENV)}")
            if f != "infllm_cupy/_env.py" and re.search(r"os\.environ|\bgetenv\b|\benviron\b", line):
                problems.append(f"{f}:{i + 1}: reads the environment (only infllm_cupy/_env.py may)")
    assert not problems, "\n".join(problems)


def test_no_test_name_defined_twice():
    """One test file per op family and no test name twice across tests/ (pytest -k stays unambiguous)."""
    import ast

    seen: dict[str, str] = {}
    dups = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                if node.name in seen:
                    dups.append(f"{node.name}: {seen[node.name]} and {where}")
                seen.setdefault(node.name, where)
    assert seen, "no tests found: the scan is broken"
    assert not dups, "\n".join(dups)
