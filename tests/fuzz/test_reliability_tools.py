"""The reliability tools on the CPU (docs/reliability.md): tools/big_run.py at small sizes against its
own fp32 references (the ops run their PyTorch references on CPU tensors), tools/sanitize.py's
driver on the references and its report parser on canned compute-sanitizer logs. Tools are run as
subprocesses, never imported (ARCHITECTURE.md, "4. Import rules")."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, timeout=300):
    p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def test_big_run_checks_pass_on_the_references_at_small_sizes():
    rc, out, err = _run("tools/big_run.py", "--tokens", "700", "--heads", "4", "--kv-heads", "2", "--topk",
                        "4", "--rows", "6", "--device", "cpu", "--cache-pages", "8", "--page-size", "64",
                        "--append-chunk", "100", "--chunk", "300", "--kernels", "auto")
    assert rc == 0, out + err
    lines = [json.loads(x) for x in out.splitlines()]
    checks = [x for x in lines if "check" in x]
    assert len(checks) >= 15 and all(c["ok"] for c in checks)
    assert any("dk keys of block 0" in c["check"] for c in checks)
    assert any("decode" in c["check"] and c["check"].endswith(": out") for c in checks)
    assert lines[-1] == {"verdict": "PASS", "failures": []}


def test_big_run_fails_loudly_on_a_wrong_tolerance():
    # a tolerance no bf16 result meets: every error check must fail and the exit status say so
    rc, out, err = _run("tools/big_run.py", "--tokens", "300", "--heads", "2", "--kv-heads", "1", "--topk",
                        "3",
                        "--rows", "2", "--device", "cpu", "--skip", "decode", "--kernels", "auto", "--tol",
                        "1e-12")
    assert rc == 1, out + err
    assert json.loads(out.splitlines()[-1])["verdict"] == "FAIL"


def test_sanitize_driver_runs_every_family_on_the_references():
    rc, out, err = _run("tools/sanitize.py", "--driver", "--device", "cpu")
    assert rc == 0, out + err
    for what in ("compress", "stage1", "stage2 fwd+bwd", "block layout", "decode cache append",
                 "sparse_decode", "infllmv2_decode", "local_stride", "pattern_decode"):
        assert f"driver: {what}" in out, what
    assert out.rstrip().endswith("driver: done")


def test_sanitize_lists_our_kernels():
    rc, out, err = _run("tools/sanitize.py", "--list")
    assert rc == 0, err
    names = out.split("our kernels:")[1].split(", ")
    for n in ("compress_mean_pool", "stage1_select", "stage2_fwd_sm90", "stage2_bwd_dkdv_sm90",
              "sparse_decode_split"):
        assert n in [x.strip() for x in names], n


CANNED = textwrap.dedent("""\
    ========= COMPUTE-SANITIZER
    driver: stage2 ok
    ========= Invalid __global__ read of size 16 bytes
    =========     at 0x1a70 in kernels_cu/stage2/sparse_fwd.cu:120:void stage2_fwd<__nv_bfloat16, 128, 4>(const T1 *)
    =========     by thread (3,0,0) in block (7,0,0)
    =========     Address 0x7f00 is out of bounds
    ========= Invalid __global__ read of size 16 bytes
    =========     at stage2_fwd<__nv_bfloat16, 128, 4>(const T1 *)+0x1a70 in sparse_fwd.cu:120
    ========= Error: Race reported between Write access at stage1_select_sm90<__half, 64>(int)+0x10
    =========     and Read access at stage1_select_sm90<__half, 64>(int)+0x20 [8 hazards]
    ========= Uninitialized __global__ memory read of size 4 bytes
    =========     at 0x40 in void at::native::vectorized_elementwise_kernel<4, float>(int)
    ========= Program hit cudaErrorInvalidValue (error 1) due to "invalid argument" on CUDA API call to cudaFoo.
    =========     Saved host backtrace up to driver entry point at error
    ========= ERROR SUMMARY: 4 errors
    """)  # noqa: E501 - compute-sanitizer output, verbatim


def test_sanitize_report_parser_on_a_canned_log(tmp_path):
    # the parser runs inside the tool (tests never import tools): feed it a canned log
    log = tmp_path / "log.txt"
    log.write_text(CANNED)
    code = ("import runpy, sys, json; m = runpy.run_path('tools/sanitize.py');"
            f"s, o, x = m['parse_findings'](open({str(log)!r}).read(), m['our_kernel_names']());"
            "print(json.dumps([s, sorted([k[1], n] for k, n in o.items()), sorted([k[1], n] for k, n in "
            "x.items())]))")
    rc, out, err = _run("-c", code)
    assert rc == 0, err
    summary, ours, others = json.loads(out)
    assert summary == 4
    assert ours == [["stage1_select_sm90", 1], ["stage2_fwd", 2]]
    assert others == [["vectorized_elementwise_kernel", 1]]


_FAKE_SANITIZER = """#!{python}
# a stand-in for compute-sanitizer: runs the wrapped driver on the CPU and reports what it is told
import subprocess, sys
args = sys.argv[1:]
tool = args[args.index("--tool") + 1]
cmd = args[next(i for i, a in enumerate(args)
                if a.endswith("python") or "python3" in a or a == sys.executable):]
p = subprocess.run(cmd + ["--device", "cpu"], capture_output=True, text=True)
print("========= COMPUTE-SANITIZER")
print(p.stdout, end="")
print(p.stderr, end="", file=sys.stderr)
bad = {report!r}.get(tool)
if bad:
    print("========= " + bad[0])
    print("=========     at 0x10 in x.cu:1:" + bad[1] + "(int)")
print("========= ERROR SUMMARY: %d errors" % (1 if bad else 0))
print("filter:", "--kernel-regex" in args)
sys.exit(99 if bad else p.returncode)
"""


def _fake_sanitizer(tmp_path, report):
    exe = tmp_path / "compute-sanitizer"
    exe.write_text(_FAKE_SANITIZER.format(python=sys.executable, report=report))
    exe.chmod(0o755)
    return str(exe)


def test_sanitize_end_to_end_with_a_stand_in_sanitizer(tmp_path):
    exe = _fake_sanitizer(tmp_path,
                          {"racecheck": ("Error: Race reported between Write access", "stage2_fwd_sm90"),
                           "initcheck": ("Uninitialized __global__ memory read of size 4 bytes",
                                         "vectorized_elementwise_kernel")})
    rc, out, err = _run("tools/sanitize.py", "--sanitizer", exe, "--no-warmup", "--families", "compress",
                        "--tools", "memcheck,racecheck,initcheck", "--log-dir", str(tmp_path / "logs"))
    assert rc == 1, out + err
    lines = {ln.split(":")[0]: ln for ln in out.splitlines() if ln.split(":")[0] in
             ("memcheck", "racecheck", "initcheck")}
    assert "PASS: 0 findings in our kernels, 0 in others" in lines["memcheck"]
    assert "completed" in lines["memcheck"]
    assert "FAIL: 1 findings in our kernels" in lines["racecheck"]
    assert "    ours      1 x stage2_fwd_sm90: Error: Race reported between Write access" in out
    # torch's kernels do not fail it
    assert "PASS: 0 findings in our kernels, 1 in others" in lines["initcheck"]
    assert out.rstrip().endswith("sanitize: FAIL")
    assert "filter: True" in (tmp_path / "logs" / "racecheck.log").read_text()
    assert "filter: False" in (tmp_path / "logs" / "memcheck.log").read_text()
