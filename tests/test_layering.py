"""Import directions of design.md, enforced by parsing every module's imports with `ast`.

Every import counts, including ones inside functions and under `if TYPE_CHECKING`: a lazy
`import onnx` in the runtime still breaks a machine that has only pycuda.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO

# source folder -> the package it installs as (pyproject.toml's package-dir)
FOLDERS = {"atlasc": "atlasc", "passes": "atlasc.passes", "codegen": "atlasc.codegen", "runtime": "atlasc.runtime"}

ANY = None  # any project module / any third-party package (torch and transformers are still banned)
BANNED = {"torch", "transformers"}  # only examples/ and tests/ may use them


@dataclass(frozen=True)
class Rule:
    project: frozenset[str] | None  # project packages this layer may import (its own is implied)
    third_party: frozenset[str] | None  # top-level third-party packages it may import


def rule(project, third_party) -> Rule:
    return Rule(None if project is ANY else frozenset(project), None if third_party is ANY else frozenset(third_party))


# The longest matching key applies. `atlasc` itself (its __init__) must stay import-free so that
# `import atlasc.runtime` on a deployment machine pulls in nothing of the compiler.
# atlasc.errors is a stdlib-only leaf every layer may raise from.
RULES: dict[str, Rule] = {
    "atlasc": rule({"atlasc.errors"}, set()),
    "atlasc.errors": rule(set(), set()),
    "atlasc.env_vars": rule(set(), set()),  # the list of ATLAS_* names, stdlib only
    "atlasc.ir": rule({"atlasc.errors"}, {"numpy"}),
    "atlasc.frontend": rule({"atlasc.ir", "atlasc.errors"}, {"numpy", "onnx", "onnx_graphsurgeon"}),
    # yaml: choose-decode-path reads its measured table (passes/decode_paths.yaml); threadpoolctl: quantize
    # keeps BLAS on one thread inside its worker threads
    "atlasc.passes": rule({"atlasc.ir", "atlasc.errors"}, {"numpy", "yaml", "threadpoolctl"}),
    "atlasc.codegen": rule({"atlasc.ir", "atlasc.artifact", "atlasc.errors"}, {"numpy"}),
    "atlasc.artifact": rule({"atlasc.errors"}, {"numpy", "yaml"}),
    "atlasc.runtime": rule({"atlasc.artifact", "atlasc.errors"}, {"numpy", "pycuda"}),
    # the CPU executor runs the op table's numpy references (atlasc.ir needs only numpy)
    "atlasc.runtime.cpu": rule({"atlasc.artifact", "atlasc.ir", "atlasc.runtime", "atlasc.errors"}, {"numpy"}),
    "atlasc.pipeline": rule({"atlasc.ir", "atlasc.passes", "atlasc.errors"}, {"numpy"}),
    # the quantization accuracy report: runs programs on the reference interpreter
    "atlasc.accuracy": rule({"atlasc.ir", "atlasc.errors"}, {"numpy"}),
    # the compile driver: ONNX file in, .atlas file out
    "atlasc.compiler": rule({"atlasc.frontend", "atlasc.ir", "atlasc.pipeline", "atlasc.passes", "atlasc.codegen",
                             "atlasc.accuracy", "atlasc.artifact", "atlasc.errors"}, {"numpy", "yaml"}),
    # the command line sits on top of everything
    "atlasc.cli": rule(ANY, {"typer", "rich", "click", "numpy", "yaml"}),
    "atlasc.__main__": rule({"atlasc.cli"}, set()),
}


def module_name(path: Path) -> str:
    """atlasc/ir/graph.py -> atlasc.ir.graph; passes/fuse.py -> atlasc.passes.fuse; pkg/__init__.py -> pkg."""
    rel = path.relative_to(REPO)
    package = FOLDERS[rel.parts[0]]
    parts = [*package.split("."), *rel.parts[1:-1]]
    if rel.name != "__init__.py":
        parts.append(rel.stem)
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in `source`, relative ones resolved."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            if node.module is None or node.level:
                # `from . import x` may name submodules: check each one as its own import
                out += [(node.lineno, f"{target}.{alias.name}" if node.module is None else target)
                        for alias in node.names]
            else:
                out.append((node.lineno, target))
    return out


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def rule_for(module: str) -> tuple[str, Rule]:
    keys = [k for k in RULES if _within(module, k)]
    if not keys:
        raise KeyError(module)
    key = max(keys, key=len)
    return key, RULES[key]


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every import in `source` (the text of `module`) that its layer's rule does not allow."""
    key, r = rule_for(module)
    found = []
    for line, name in imports_of(source, module, is_package):
        top = name.split(".")[0]
        if top in BANNED:
            found.append(f"{module}:{line} imports {name} (torch/transformers only in examples/ and tests/)")
        elif top == "atlasc":
            if key != "atlasc" and _within(name, key):  # its own package
                continue
            if r.project is not None and not any(_within(name, p) for p in r.project):
                found.append(f"{module}:{line} imports {name}, but layer {key} may import only "
                             f"{sorted(r.project) or 'nothing'} from the project")
        elif top in sys.stdlib_module_names:
            continue
        elif r.third_party is not None and top not in r.third_party:
            found.append(f"{module}:{line} imports third-party {top}, but layer {key} may import only "
                         f"{sorted(r.third_party) or 'the standard library'}")
    return found


def source_files() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_has_a_rule():
    missing = []
    for path in source_files():
        module = module_name(path)
        key, _ = rule_for(module)
        if key == "atlasc" and module != "atlasc":
            missing.append(f"{module} ({path.relative_to(REPO)}): add its layer to RULES in tests/test_layering.py")
    assert not missing, "\n".join(missing)


def test_import_directions():
    files = source_files()
    assert any(module_name(p) == "atlasc.ir" for p in files), "atlasc/ir/__init__.py not found"
    found = []
    for path in files:
        found += violations(path.read_text(), module_name(path), path.name == "__init__.py")
    assert not found, "layering violations (design.md, 'Layout and imports'):\n" + "\n".join(found)


# ---------------------------------------------------------------------------------------------
# the checker itself, on synthetic sources


@pytest.mark.parametrize("module,source", [
    ("atlasc.runtime.loader", "import onnx"),
    ("atlasc.runtime.loader", "def f():\n    import onnx_graphsurgeon as gs"),
    ("atlasc.runtime.loader", "from atlasc.passes import fuse"),
    ("atlasc.runtime.loader", "from ..codegen import emit"),
    ("atlasc.runtime.loader", "from atlasc.frontend import import_onnx"),
    ("atlasc.runtime.loader", "from atlasc import ir"),
    ("atlasc.ir.graph", "from atlasc.frontend import load_model"),
    ("atlasc.ir.graph", "import onnx"),
    ("atlasc.ir.graph", "from .. import cli"),
    ("atlasc.passes.fuse", "from atlasc.codegen import kernels"),
    ("atlasc.passes.fuse", "import torch"),
    ("atlasc.frontend.importer", "from transformers import AutoModel"),
    ("atlasc.frontend.importer", "from atlasc.passes.fuse import run"),
    ("atlasc.artifact.format", "from atlasc.ir import Graph"),
    ("atlasc.artifact.format", "import onnx"),
    ("atlasc.codegen.emit", "import onnx"),
    ("atlasc", "from atlasc.ir import Graph"),
    ("atlasc.cli", "import torch"),
])
def test_checker_rejects(module, source):
    assert violations(source, module), (module, source)


@pytest.mark.parametrize("module,source", [
    ("atlasc.runtime.loader", "import numpy as np\nimport pycuda.driver as cuda\nfrom atlasc.artifact import read"),
    ("atlasc.runtime.loader",
     "from ..artifact import read\nfrom .arena import Arena\nfrom atlasc.errors import InputError"),
    ("atlasc.ir.graph", "from __future__ import annotations\nimport numpy as np\nfrom .symbolic import Expr"),
    ("atlasc.ir.graph", "from atlasc.errors import ShapeError\nfrom atlasc.ir import symbolic"),
    ("atlasc.frontend.importer", "import onnx\nimport onnx_graphsurgeon as gs\nfrom atlasc.ir import Graph"),
    ("atlasc.passes.fuse", "from atlasc.ir.graph import Graph\nfrom . import pattern"),
    ("atlasc.codegen.emit", "from atlasc.artifact import Manifest\nfrom atlasc.ir import Graph\nimport subprocess"),
    ("atlasc.cli", "import typer\nfrom atlasc.frontend import import_onnx\nfrom atlasc.runtime import run"),
])
def test_checker_accepts(module, source):
    assert violations(source, module) == []


def test_relative_imports_resolve():
    assert imports_of("from . import x", "atlasc.ir", is_package=True) == [(1, "atlasc.ir.x")]
    assert imports_of("from .graph import Value", "atlasc.ir.verify", is_package=False) == [(1, "atlasc.ir.graph")]
    assert imports_of("from ..errors import E", "atlasc.ir", is_package=True) == [(1, "atlasc.errors")]
    assert imports_of("from ..graph import G", "atlasc.ir.ops", is_package=True) == [(1, "atlasc.ir.graph")]
    assert module_name(REPO / "passes" / "fuse_rmsnorm.py") == "atlasc.passes.fuse_rmsnorm"
    assert module_name(REPO / "atlasc" / "ir" / "__init__.py") == "atlasc.ir"
