"""The wheel carries every subpackage: pyproject.toml lists packages by hand (the kernels' folder is mapped
into the package), so a new subpackage missing from that list would install as an ImportError for users of
a non-editable install while every test here, which runs from the source tree, still passes."""
import pathlib

import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_subpackage_is_in_the_wheel():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "infllm_cupy").rglob("__init__.py")}
    assert found, "no package found under infllm_cupy/"
    missing = sorted(found - listed)
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}"
    assert "infllm_cupy.kernels_cu" in listed
