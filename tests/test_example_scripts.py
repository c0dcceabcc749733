"""The GPU machine's shell scripts (examples/*.sh) parse: a syntax error there would cost a device call, which no CPU
test runs otherwise. Each one is also checked to name only example scripts and test files that exist."""

from __future__ import annotations

import re
import subprocess

import pytest

from conftest import REPO

SCRIPTS = sorted((REPO / "examples").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses_and_names_existing_files(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = script.read_text()
    named = set(re.findall(r"\b((?:examples|tests)/[\w./-]+\.(?:py|sh))\b", text))
    named |= {f"examples/{m}" for m in re.findall(r"(?<![/\w])(\w+_lab\.py)\b", text)}  # run from examples/
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"{script.name} names files that do not exist: {missing}"


def test_the_scripts_are_found():
    assert {"gpu_check.sh", "gpu_bench.sh", "step_ab.sh", "bulk_check.sh"} <= {p.name for p in SCRIPTS}
