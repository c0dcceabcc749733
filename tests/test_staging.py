"""Mapped staging (runtime/staging.py): the PTX of the two staging kernels assembles for every supported arch, and
the host-side rules that decide a call's path (one span from the stage's start, within the graph's capacity)."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from atlasc.codegen.nvcc import SUPPORTED_ARCHS
from atlasc.runtime.cudagraph import chain_ends
from atlasc.runtime.staging import BLOCK, HEADER, PTX, blocks_for, mapped_span, write_header


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_staging_ptx_assembles_for_every_supported_arch(arch, tmp_path):
    """The driver JIT-compiles this PTX at load on the user's GPU; ptxas (nvcc's assembler) must accept it for each
    arch the compiler targets, with both kernels in the cubin."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("no ptxas on PATH")
    src = tmp_path / "staging.ptx"
    src.write_text(PTX)
    out = tmp_path / "staging.cubin"
    r = subprocess.run([ptxas, f"-arch=sm_{arch[2:]}", str(src), "-o", str(out)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    assert b"atlas_stage_in" in data and b"atlas_stage_out" in data


def test_a_call_takes_the_mapped_path_only_with_one_span_from_the_stage_start_within_capacity():
    assert mapped_span([[256, 256 + 100]], 256, 4096) == 112  # rounded up to whole 16-byte words
    assert mapped_span([[256, 256 + 4096]], 256, 4096) == 4096
    assert mapped_span([[256, 256 + 4097]], 256, 4096) is None  # longer than the graph's kernel covers
    assert mapped_span([[512, 600]], 256, 4096) is None  # not from the stage's first slot (the dims)
    assert mapped_span([[256, 300], [1024, 1100]], 256, 4096) is None  # two spans
    assert mapped_span([], 256, 4096) is None


def test_blocks_cover_the_capacity_and_the_header_holds_words_and_offset():
    assert blocks_for(0) == 1 and blocks_for(16 * BLOCK) == 1 and blocks_for(16 * BLOCK + 16) == 2
    raw = np.zeros(HEADER + 64, np.uint8)
    write_header(raw, 48, 123456)
    assert raw[:HEADER].view(np.uint64).tolist() == [3, 123456] and not raw[HEADER:].any()


def test_a_chain_keeps_its_first_and_last_node_as_ends():
    """make_programmatic(plain_ends=True) leaves the edges touching these plain: the staging kernels do not wait."""
    assert chain_ends([1, 2, 3], [2, 3, 4]) == {1, 4}
    assert chain_ends([1], [2]) == {1, 2}
    assert chain_ends([], []) == set()
