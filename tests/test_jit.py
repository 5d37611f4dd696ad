"""The run-time compiler: finding kernels_cu/, fingerprints, NVRTC compiles with no GPU, the wheel."""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import infllm_cupy  # noqa: F401  (imports every launcher, so the registry is complete)
from infllm_cupy import _jit

REPO = Path(__file__).resolve().parents[1]
ALL_SOURCES = sorted(p.relative_to(REPO / "kernels_cu").as_posix()
                     for p in (REPO / "kernels_cu").rglob("*.cu"))


@pytest.fixture
def kernels_copy(tmp_path, monkeypatch):
    """A private copy of kernels_cu/ that the loader uses instead of the real one."""
    dst = tmp_path / "kernels_cu"
    shutil.copytree(REPO / "kernels_cu", dst)
    monkeypatch.setenv(_jit.KERNELS_DIR_ENV, str(dst))
    _jit.clear_cache()
    yield dst
    monkeypatch.delenv(_jit.KERNELS_DIR_ENV)
    _jit.clear_cache()


def test_kernels_dir_is_the_checkout():
    assert _jit.kernels_dir() == REPO / "kernels_cu"


def test_include_closure_follows_headers():
    closure = {p.relative_to(_jit.kernels_dir()).as_posix()
               for p in _jit.include_closure("compress/mean_pool.cu")}
    assert closure == {"compress/mean_pool.cu", "common/types.cuh", "common/params.cuh"}


def test_fingerprint_changes_with_an_included_header(kernels_copy):
    before = _jit.source_fingerprint("compress/mean_pool.cu")
    assert _jit.source_fingerprint("compress/mean_pool.cu") == before
    hdr = kernels_copy / "common" / "types.cuh"
    hdr.write_text(hdr.read_text() + "\n// edited\n")
    assert _jit.source_fingerprint("compress/mean_pool.cu") != before
    # and the fingerprint is what heads the compiled source text (CuPy's disk-cache key)
    assert _jit._code("compress/mean_pool.cu").startswith(
        f"// infllm_cupy fingerprint {_jit.source_fingerprint('compress/mean_pool.cu')}")


def test_missing_header_is_reported(kernels_copy):
    (kernels_copy / "compress" / "broken.cu").write_text('#include "common/nope.cuh"\n')
    with pytest.raises(FileNotFoundError, match=r"nope\.cuh"):
        _jit.source_fingerprint("compress/broken.cu")


def test_every_source_is_registered():
    registered = {ks.source for ks in _jit.registered()}
    assert set(ALL_SOURCES) <= registered, f"kernels nobody launches: {set(ALL_SOURCES) - registered}"


@pytest.mark.slow            # about 5 minutes on 2 CPUs: `./scripts/test.sh --all` (CI) runs it
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", ALL_SOURCES)
def test_every_kernel_compiles_without_a_gpu(source, arch):
    # sm_90a sets compile for sm_90a whatever `arch` says: once, in the sm_90 case
    sets = [k for k in _jit.registered() if k.source == source and (not k.sm90a or arch == "sm_90")]
    if not sets:
        pytest.skip(f"{source} holds sm_90a kernels only, compiled in the sm_90 case")
    for ks in sets:
        report = _jit.compile_report(ks.source, ks.names, "sm_90a" if ks.sm90a else arch)
        assert sorted(k.name for k in report.kernels) == sorted(ks.names), report.log
        for k in report.kernels:
            assert k.registers > 0, str(k)
            if ks.strict:
                assert k.spill_stores == 0 and k.spill_loads == 0, f"spills: {k}"
        if ks.sm90a:
            # ptxas C7511: it serialised the kernel's wgmmas (each waits for the one before), e.g.
            # for want of registers to keep a group in flight; the kernel still runs, at a fraction
            # of its speed (0.75x for the dk/dv kernel: docs/stage2_bwd.md, "Tried and not kept"), so it
            # is a failure here
            assert "C7511" not in report.log, report.log


def test_compile_error_names_the_kernel_and_shows_the_log(kernels_copy):
    (kernels_copy / "compress" / "broken.cu").write_text(textwrap.dedent("""
        template <typename T> __global__ void broken_kernel(T* x) { x[0] = undeclared_thing; }
    """))
    with pytest.raises(_jit.KernelCompileError, match=r"(?s)broken_kernel<float>.*undeclared_thing"):
        _jit.compile_report("compress/broken.cu", ["broken_kernel<float>"], "sm_80")


def test_installed_wheel_finds_and_compiles_its_kernels(tmp_path):
    """Build a wheel from a copy of the checkout, install it elsewhere, and compile from there
    with no CUDA toolkit on the PATH."""
    src = tmp_path / "src"
    shutil.copytree(REPO, src,
                    ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                             ".whl", "notebooks", "benchmarks"))
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
                   check=True)
    (whl,) = wheels.glob("infllm_cupy-*.whl")
    site = tmp_path / "site"
    subprocess.run(pip + ["install", "--no-deps", "--target", str(site), str(whl)], check=True)
    probe = textwrap.dedent("""
        import shutil, infllm_cupy
        from infllm_cupy import _jit
        assert shutil.which("nvcc") is None, shutil.which("nvcc")
        print(infllm_cupy.__file__)
        print(_jit.kernels_dir())
        n = 0
        for ks in _jit.registered():   # one instance per source and flavour: the path, not the kernels
            r = _jit.compile_report(ks.source, ks.names[:1], "sm_90a" if ks.sm90a else "sm_80")
            assert len(r.kernels) == 1
            n += 1
        print("compiled", n)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA", "INFLLM"))}
    env["PYTHONPATH"] = str(site)
    env["PATH"] = "/usr/bin:/bin"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True).stdout.splitlines()
    assert out[0].startswith(str(site)), out
    assert out[1] == str(site / "infllm_cupy" / "kernels_cu"), out
    assert out[2].startswith("compiled ") and int(out[2].split()[1]) > 0


def test_wgmma_rates_tool_compiles_without_a_gpu():
    # tools/wgmma_rates.cu (sustained wgmma rates of the dk/dv kernel's product shapes) includes the
    # kernels' headers but lives outside kernels_cu/ and is not registered: compile it here so that
    # a header change cannot silently break it. C7511: ptxas serialised the wgmma pipeline.
    r = subprocess.run([sys.executable, str(REPO / "tools" / "wgmma_rates.py"), "--compile-only"], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    head, log = r.stdout.split("\n", 1)
    n = int(head.split()[1])
    assert n > 0 and log.count("Used ") == n, r.stdout
    assert "C7511" not in log, log


# ------------------------------------------------------------------------------------------------
# the disk cache under faults (docs/reliability.md, "The run-time compiler under faults"): the
# backend CuPy's compile path loads from and saves to, exercised without a GPU
# ------------------------------------------------------------------------------------------------
def _cupy_cache():
    """CuPy's pluggable disk cache (CuPy >= 14); the tests skip without it."""
    return pytest.importorskip("cupy.cuda._compiler_cache", reason="needs CuPy >= 14 (the gpu extra)")


def _cache(path):
    _cupy_cache()
    return _jit._cache_class()(str(path))


def test_cache_entry_round_trip_and_corruption_recompiles(tmp_path):
    cache = _cache(tmp_path)
    payload = os.urandom(4096)
    cache.save("k.cubin", payload, "source")
    assert cache.load("k.cubin") == payload
    assert cache.load("absent.cubin") is None
    entry = tmp_path / "k.cubin"
    good = entry.read_bytes()
    for name, bad in (("truncated", good[:-100]), ("cut inside the checksum", good[:10]), ("empty", b""),
                      ("a flipped byte", good[:2000] + bytes([good[2000] ^ 1]) + good[2001:])):
        entry.write_bytes(bad)
        with pytest.warns(_jit.KernelCacheWarning, match=r"k\.cubin is truncated or corrupted.*recompiling"):
            assert cache.load("k.cubin") is None, name
        # the recompile saves over it; the next load is clean
        cache.save("k.cubin", payload, "source")
        assert cache.load("k.cubin") == payload


def test_unreadable_cache_entry_recompiles(tmp_path):
    cache = _cache(tmp_path)
    (tmp_path / "k.cubin").mkdir()                      # something there that cannot be read as a file
    with pytest.warns(_jit.KernelCacheWarning, match=r"k\.cubin cannot be read.*recompiling"):
        assert cache.load("k.cubin") is None


def test_unwritable_cache_folder_warns_once_and_goes_on(tmp_path):
    # a folder that cannot exist (a file is in its place): fails for root too
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("x")
    _jit._WARNED.discard(str(blocker))
    with pytest.warns(_jit.KernelCacheWarning, match="cannot be created.*kept in this process only"):
        cache = _cache(blocker)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # once per folder: no second warning
        cache.save("k.cubin", b"payload", "source")
        assert cache.load("k.cubin") is None
    if os.geteuid() != 0:                               # a read-only folder (root writes anyway)
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        try:
            with pytest.warns(_jit.KernelCacheWarning, match="is not writable.*kept in this process only"):
                _cache(ro).save("k.cubin", b"payload", "source")
        finally:
            ro.chmod(0o755)


_WRITER = """
import os, sys
from infllm_cupy import _jit
cache = _jit._cache_class()(sys.argv[1])
for i in range(int(sys.argv[3])):
    cache.save("k.cubin", bytes([int(sys.argv[2])]) * (1 << 20), "source")
"""


def test_two_processes_writing_one_entry_never_expose_a_partial_file(tmp_path):
    """Two processes compiling the same kernel save the same entry at once; a reader meanwhile sees
    nothing, or one writer's complete entry, never a torn one (write to a temporary file, rename)."""
    import warnings

    cache = _cache(tmp_path)
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(b), "40"]) for b in (1, 2)]
    seen = set()
    with warnings.catch_warnings():
        warnings.simplefilter("error", _jit.KernelCacheWarning)
        while any(w.poll() is None for w in writers):
            got = cache.load("k.cubin")
            if got is not None:
                assert got in (b"\x01" * (1 << 20), b"\x02" * (1 << 20))
                seen.add(got[0])
    assert all(w.returncode == 0 for w in writers)
    assert cache.load("k.cubin") in (b"\x01" * (1 << 20), b"\x02" * (1 << 20))
    assert not [p for p in tmp_path.iterdir() if p.name != "k.cubin"], "temporary files left behind"


def test_install_kernel_cache_replaces_only_cupys_default():
    cupy_cache = _cupy_cache()
    from cupy.cuda import compiler

    saved = compiler._kernel_cache_backend
    try:
        compiler._set_kernel_cache_backend(cupy_cache.DiskKernelCacheBackend(saved._cache_dir))
        ours = _jit.install_kernel_cache()
        assert type(ours).__name__ == "KernelDiskCache" and ours.cache_dir == saved._cache_dir
        assert _jit.install_kernel_cache() is ours                     # once
        mine = cupy_cache.KernelCacheBackend.__new__(type("UserBackend", (cupy_cache.KernelCacheBackend,),
                                                          {"load": lambda s, n: None,
                                                           "save": lambda *a: None}))
        compiler._set_kernel_cache_backend(mine)
        assert _jit.install_kernel_cache() is mine                     # a user's backend is left alone
    finally:
        compiler._set_kernel_cache_backend(saved)


@pytest.mark.nvrtc
def test_two_processes_compiling_one_kernel_at_once():
    code = ("from infllm_cupy import _jit; r = _jit.compile_report('compress/mean_pool.cu', "
            "['compress_mean_pool<float, 64>'], 'sm_80'); print(r.kernels[0].registers)")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert outs[0][0] == outs[1][0] and int(outs[0][0]) > 0
