"""A non-editable install (`pip install .`, a wheel) carries every file the package reads at run time:
the kernel templates (codegen/*.cu, *.cuh) and the measured tables (passes/*.yaml) are package data."""

from __future__ import annotations

import tomllib
from fnmatch import fnmatch

from conftest import REPO


def package_folder(package: str, dirs: dict[str, str]) -> str:
    """The source folder of a package under setuptools' package-dir mapping (longest prefix wins)."""
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in dirs:
            return "/".join([dirs[prefix], *parts[i:]])
    return "/".join(parts)


def test_every_data_file_is_package_data():
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    data = setup.get("package-data", {})
    missing = []
    for package in setup["packages"]:
        for f in sorted((REPO / package_folder(package, setup["package-dir"])).iterdir()):
            globs = data.get(package, [])
            if f.is_file() and f.suffix not in (".py", ".pyc") and not any(fnmatch(f.name, g) for g in globs):
                missing.append(f"{package}: {f.name}")
    assert not missing, f"not package data (a wheel would lack them): {missing}"
