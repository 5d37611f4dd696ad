"""Compare the machine code of every registered kernel instance between two kernels_cu/ trees.

For a refactor of kernel sources that must not change what runs: each instance the launchers
register (`_jit.registered()`) is compiled by NVRTC from both trees with the package's own options
(BASE_OPTIONS, CuPy's -ftz=true, the include folders; sm_90a for sm90a sets, else --arch), and
the tool prints per instance the ptxas resources (registers, spill bytes, stack frame, static
shared memory) of both, the SASS instruction counts, and whether the SASS is identical
(addresses, encodings, label names and the return-address constants of calls ignored: "yes"),
differs only in order and register assignment (the same multiset of instructions with register
numbers masked, NOP padding left out: "sched"), or differs ("NO -a/+b": a masked instructions only the old
code has, b only the new). Needs no GPU; SASS needs nvdisasm (the nvidia-cuda-nvdisasm wheel, or CUDA's bin/
on PATH); without it only the resources are compared.

    git archive <commit> kernels_cu | tar -x -C /tmp/old      # the tree before
    python tools/sass_diff.py /tmp/old/kernels_cu kernels_cu [--source stage2/] [--arch sm_80] [-j 2]
    python tools/sass_diff.py /tmp/old/kernels_cu kernels_cu --source stage1/ \
        --rename '(stage1_select)(_sm90)?<(.*), true>' '\1_range\2<\3>' --rename ', false>' '>'

A kernel that moved to another file is found in each tree by its name (the first .cu file of the
tree that defines it), so the registry may come from either side's package (PYTHONPATH=<a checkout
of the package> picks another one than this checkout's); `--rename` maps a name the change gave
an instance to the old tree's name; `--skip REGEX` leaves out instances the change added. Exit
status 1 when any instance differs in resources or SASS ("sched" included).
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# after PYTHONPATH: a registry may come from elsewhere
sys.path.append(str(Path(__file__).resolve().parents[1]))
import infllm_cupy  # noqa: F401  (imports every launcher, so the registry is complete)
from infllm_cupy import _jit


def nvdisasm_path() -> str | None:
    if p := shutil.which("nvdisasm"):
        return p
    try:
        import nvidia

        for root in map(Path, nvidia.__path__):
            for cand in root.glob("*/bin/nvdisasm"):
                return str(cand)
    except ImportError:
        pass
    return None


def base_name(expr: str) -> str:
    return expr.split("<", 1)[0].strip()


def find_source(tree: Path, source: str, names) -> str:
    """`source` if it exists in `tree` and defines the kernels, else the first .cu file that does."""
    pats = [re.compile(r"\b" + re.escape(base_name(n)) + r"\s*\(") for n in names]
    cand = tree / source
    if cand.is_file() and all(p.search(cand.read_text()) for p in pats):
        return source
    for f in sorted(tree.rglob("*.cu")):
        if all(p.search(f.read_text()) for p in pats):
            return f.relative_to(tree).as_posix()
    raise FileNotFoundError(f"no .cu file under {tree} defines {names}")


def compile_cubin(tree: Path, source: str, names, arch: str):
    """(cubin bytes, ptxas log, {lowered name: name expression}) of `names` from tree/source."""
    from cupy_backends.cuda.libs import nvrtc

    code = f'#line 1 "{source}"\n' + (tree / source).read_text()
    prog = nvrtc.createProgram(code, source, [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        opts = list(_jit.BASE_OPTIONS + _jit.CUPY_ADDED_OPTIONS) + [f"-I{tree}"]
        if (inc := _jit.cuda_include_dir()) is not None:
            opts.append(f"-I{inc}")
        opts += [f"--gpu-architecture={arch}", "--ptxas-options=-v"]
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError:
            raise _jit.KernelCompileError(f"{tree}/{source} for "
                                          f"{arch}:\n{nvrtc.getProgramLog(prog)}") from None
        log = nvrtc.getProgramLog(prog)
        lowered = {nvrtc.getLoweredName(prog, n): n for n in names}
        cubin = _get_cubin(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return cubin, log, lowered


def _get_cubin(prog: int) -> bytes:
    # CuPy's nvrtc.getCUBIN drops the cubin's last byte (it reads it as a C string), which nvdisasm
    # rejects: ask the NVRTC library that CuPy loaded for it directly
    import ctypes

    lib = None
    for cand in ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"):
        try:
            lib = ctypes.CDLL(cand)
            break
        except OSError:
            continue
    if lib is None:
        import nvidia

        for root in map(Path, nvidia.__path__):
            for so in root.glob("*/lib/libnvrtc.so*"):
                lib = ctypes.CDLL(str(so))
                break
    size = ctypes.c_size_t()
    if lib.nvrtcGetCUBINSize(ctypes.c_void_p(prog), ctypes.byref(size)) != 0:
        raise RuntimeError("nvrtcGetCUBINSize failed")
    buf = ctypes.create_string_buffer(size.value)
    if lib.nvrtcGetCUBIN(ctypes.c_void_p(prog), buf) != 0:
        raise RuntimeError("nvrtcGetCUBIN failed")
    return buf.raw


_FUNC = re.compile(r"^\s*\.text\.(\S+):")
_INSN = re.compile(r"^\s*(?:/\*([0-9a-f]{4,})\*/)\s*(.*?)\s*;?\s*(?:/\*.*\*/)?\s*$")
_MOV_IMM = re.compile(r"^(MOV R\d+, )0x([0-9a-f]+)$")
_SPACES = re.compile(r"\s+")
_LABEL_REF = re.compile(r"\.L_x_\d+")


def sass_by_function(nvdisasm: str, cubin: bytes) -> dict[str, list[str]]:
    """{mangled kernel name: its instructions}, addresses and encodings dropped, labels renamed in
    order of first appearance (so that equal code gives equal text), return addresses (a `MOV R,
    imm` of the address after a CALL.REL: they move with any change of code size before them)
    written as `<ret>`, the function's own name as `<self>`, and runs of white space as one space."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm, "-c", f.name], check=True, capture_output=True, text=True).stdout
    raw: dict[str, list[tuple[int, str]]] = {}
    cur = None
    for line in text.splitlines():
        if m := _FUNC.match(line):
            cur = raw.setdefault(m.group(1), [])
            continue
        if cur is None:
            continue
        if m := _INSN.match(line):
            ins = m.group(2).strip()
            if ins:
                cur.append((int(m.group(1), 16), ins))
    out: dict[str, list[str]] = {}
    for name, insns in raw.items():
        rets = {insns[i + 1][0] for i, (_, ins) in enumerate(insns[:-1]) if "CALL.REL" in ins}
        labels: dict[str, str] = {}
        code = []
        for _, ins in insns:
            if (m := _MOV_IMM.match(ins)) and int(m.group(2), 16) in rets:
                ins = m.group(1) + "<ret>"
            # the function's own (mangled) name, a return's target, changes with a renamed kernel
            ins = _SPACES.sub(" ", ins.replace(name, "<self>"))
            code.append(_LABEL_REF.sub(lambda m: labels.setdefault(m.group(0), f"L{len(labels)}"), ins))
        out[name] = code
    return out


_REG = re.compile(r"\b(U?R|U?P|B)(\d+)\b")


def _opcode(insn: str) -> str:
    """An instruction with its register numbers masked (R12 -> R, UR4 -> UR, P3 -> P; RZ, PT kept)
    and without operand-reuse hints (.reuse follows the register assignment)."""
    return _REG.sub(lambda m: m.group(1), insn.replace(".reuse", ""))


def resources(log: str, lowered: dict[str, str]) -> dict[str, _jit.KernelResources]:
    return {k.name: k for k in _jit._parse_ptxas(log, lowered)}


def compare_set(old_tree: Path, new_tree: Path, source: str, names, arch: str, nvdisasm: str | None,
                old_names=None):
    """`old_names[i]`: the old tree's name expression of `names[i]` (default: the same)."""
    old_names = tuple(old_names or names)
    old_source, source = find_source(old_tree, source, old_names), find_source(new_tree, source, names)
    cub_o, log_o, low_o = compile_cubin(old_tree, old_source, old_names, arch)
    cub_n, log_n, low_n = compile_cubin(new_tree, source, names, arch)
    res_o, res_n = resources(log_o, low_o), resources(log_n, low_n)
    sass_o = sass_by_function(nvdisasm, cub_o) if nvdisasm else {}
    sass_n = sass_by_function(nvdisasm, cub_n) if nvdisasm else {}
    inv_o = {v: k for k, v in low_o.items()}
    inv_n = {v: k for k, v in low_n.items()}
    rows = []
    for n_old, n in zip(old_names, names):
        ro, rn = res_o[n_old], res_n[n]
        so, sn = sass_o.get(inv_o[n_old]), sass_n.get(inv_n[n])
        same, only = None, (0, 0)
        if so is not None and sn is not None:
            # identical, else the same instructions with registers and order ignored ("sched"): a
            # change of scheduling and register assignment only; else how many (masked, NOPs left
            # out) instructions only the old / only the new code has
            mo = collections.Counter(_opcode(i) for i in so if i != "NOP")
            mn = collections.Counter(_opcode(i) for i in sn if i != "NOP")
            only = (sum((mo - mn).values()), sum((mn - mo).values()))
            same = "yes" if so == sn else "sched" if only == (0, 0) else f"NO -{only[0]}/+{only[1]}"
        rows.append(dict(name=n, arch=arch, old_source=old_source, source=source, old=ro, new=rn,
                         n_old=len(so) if so is not None else None, n_new=len(sn) if sn is not None else None,
                         same=same))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path, help="the kernels_cu/ tree before")
    ap.add_argument("new", type=Path, help="the kernels_cu/ tree after")
    ap.add_argument("--source", default="", help="only sources whose path starts with this (e.g. stage2/)")
    ap.add_argument("--arch", default="sm_80", help="architecture of the non-sm90a sets (default sm_80)")
    ap.add_argument("-j", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    ap.add_argument("--rename", nargs=2, action="append", default=[], metavar=("REGEX", "REPL"),
                    help="the old tree's name of an instance: re.sub(REGEX, REPL, name) (repeatable, in "
                         "order), for a kernel renamed or re-templated by the change")
    ap.add_argument("--skip", action="append", default=[], metavar="REGEX",
                    help="leave out instances whose name matches (repeatable): kernels the change added")
    args = ap.parse_args(argv)
    nvdisasm = nvdisasm_path()
    if nvdisasm is None:
        print("nvdisasm not found: comparing ptxas resources only", file=sys.stderr)
    jobs = []
    for ks in _jit.registered():
        if not ks.source.startswith(args.source):
            continue
        arch = "sm_90a" if ks.sm90a else args.arch
        # one program per instance, so that the sets compile in parallel
        jobs += [(ks.source, (n,), arch) for n in ks.names if not any(re.search(p, n) for p in args.skip)]

    def old_name(n: str) -> str:
        for pat, repl in args.rename:
            n = re.sub(pat, repl, n)
        return n

    rows = []
    with cf.ProcessPoolExecutor(max_workers=args.j) as ex:
        futs = [ex.submit(compare_set, args.old.resolve(), args.new.resolve(), s, n, a, nvdisasm,
                          tuple(map(old_name, n))) for s, n, a in jobs]
        for f in futs:
            rows += f.result()
    bad = 0
    print(f"{'instance':52} {'arch':7} {'regs':>9} {'spill st/ld':>15} {'stack':>9} {'smem':>11} "
          f"{'SASS insns':>13} same")
    for r in rows:
        o, n = r["old"], r["new"]
        res_same = (o.registers, o.spill_stores, o.spill_loads, o.stack_frame, o.shared_static) == \
                   (n.registers, n.spill_stores, n.spill_loads, n.stack_frame, n.shared_static)
        same = res_same and r["same"] in ("yes", None)
        bad += not same
        sass = "-" if r["n_old"] is None else f"{r['n_old']}->{r['n_new']}"
        tag = (r["same"] or "n/a") if res_same else "NO (resources)"
        print(f"{r['name']:52} {r['arch']:7} {o.registers:>4}->{n.registers:<4} "
              f"{o.spill_stores:>3}/{o.spill_loads:<3}->{n.spill_stores:>3}/{n.spill_loads:<3} "
              f"{o.stack_frame:>4}->{n.stack_frame:<4} {o.shared_static:>5}->{n.shared_static:<5} {sass:>13} "
              f"{tag}")
    sched = sum(r["same"] == "sched" for r in rows)
    print(f"{len(rows) - bad} of {len(rows)} instances identical" + ("" if nvdisasm else " (resources only)")
          + (f"; {sched} differ in scheduling and register assignment only (the same instructions, registers"
             " masked)" if sched else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
