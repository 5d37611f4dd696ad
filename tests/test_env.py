"""infllm_cupy/_env.py: the one reader of the environment, and its in-process override."""
import pytest
import torch

from infllm_cupy import _checks, _env, _jit, _launch


def test_variables_are_read_at_each_use(monkeypatch):
    for var in (_env.KERNELS_DIR, _env.VALIDATE, _env.POISON, _env.LINEINFO):
        monkeypatch.delenv(var, raising=False)
    assert (_env.kernels_dir(), _env.validate(), _env.poison(), _env.lineinfo()) == (None, True, False, False)
    monkeypatch.setenv(_env.VALIDATE, "0")
    monkeypatch.setenv(_env.POISON, "1")
    monkeypatch.setenv(_env.LINEINFO, "1")
    monkeypatch.setenv(_env.KERNELS_DIR, "/somewhere")
    assert (_env.kernels_dir(), _env.validate(), _env.poison(), _env.lineinfo()) == ("/somewhere", False,
                                                                                     True, True)
    assert not _checks.validate_values()


def test_override_beats_the_environment_and_restores(monkeypatch, tmp_path):
    monkeypatch.setenv(_env.VALIDATE, "0")
    monkeypatch.delenv(_env.POISON, raising=False)
    with _env.override(validate=True, poison=True):
        assert _env.validate() and _env.poison() and _checks.validate_values()
        with _env.override(validate=False):                 # nested: the inner value, then the outer one
            assert not _env.validate() and _env.poison()
        assert _env.validate()
        out = _launch.empty((3,), dtype=torch.float32, device="cpu")
        assert torch.isnan(out).all()
        ints = _launch.empty((3,), dtype=torch.int32, device="cpu")
        assert (ints == -(2**30)).all()
    assert not _env.validate() and not _env.poison()
    with pytest.raises(RuntimeError), _env.override(validate=True):
        raise RuntimeError("the override is undone on the way out")
    assert not _env.validate()


def test_kernels_dir_override(tmp_path):
    default = _jit.kernels_dir()
    (tmp_path / "k").mkdir()
    with _env.override(kernels_dir=tmp_path / "k"):
        assert _jit.kernels_dir() == (tmp_path / "k").resolve()
    assert _jit.kernels_dir() == default
    with _env.override(kernels_dir=None):                      # None: the default search
        assert _jit.kernels_dir() == default


def test_override_takes_bools_only():
    for bad in ("0", 0, None):
        with pytest.raises(TypeError, match="validate must be a bool"), _env.override(validate=bad):
            pass
