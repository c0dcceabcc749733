"""simplify-decode-mask: the decode entry's mask machinery (ranges, GatherND, comparisons) replaced by
Where(attention_mask == 0, fill, 0): fewer kernels per step, bit-identical decode outputs with left
padding on every decoder fixture, sliding-window masks (mistral) left alone with the reason."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from atlasc.frontend import import_onnx
from atlasc.ir import interpret
from atlasc.ir.program import CompileOptions, Program
from atlasc.pipeline import PIPELINES, run_pipeline
from atlasc.runtime.generate import Sampling

from conftest import FIXTURES

MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
DECODERS = [f["name"] for f in MANIFEST if f["kind"] == "decoder"]
WINDOWED = {"mistral"}  # a sliding-window mask: not padding alone


@functools.cache
def programs(name: str):
    """(with the pass, without it, the pass's record): the default pipeline up to schedule, less
    mask-as-lengths (on by default, it takes these masks first: simplify-decode-mask serves the masks it
    declines, and ATLAS_MASK_LENGTHS=0 builds)."""
    names = [n for n in PIPELINES["default"] if n != "mask-as-lengths"]
    upto = names[: names.index("schedule")]
    options = CompileOptions(archs=("sm90",), max_batch=4, max_seq=64)
    got = run_pipeline(Program({"main": import_onnx(FIXTURES / f"{name}.onnx")}, options), upto, verify_each=True)
    base = run_pipeline(Program({"main": import_onnx(FIXTURES / f"{name}.onnx")}, options),
                        [n for n in upto if n != "simplify-decode-mask"], verify_each=True)
    record = next(r for r in got[1].records if r.name == "simplify-decode-mask")
    return got[0], base[0], record


def _run_decode(program, name: str, pad: list[int]):
    z = np.load(FIXTURES / f"{name}.decode.npz")
    ins = {k[3:]: z[k] for k in z.files if k.startswith("in.")}
    kv = program.kv_cache
    rng = np.random.default_rng(5)
    state = {"kv_cache": rng.uniform(-1, 1, kv.shape).astype(np.dtype(kv.dtype))}
    past = ins["past_key_values.0.key"].shape[2]
    b = ins["input_ids"].shape[0]
    mask = np.ones((b, past + 1), np.int64)
    for row, n in enumerate(pad[:b]):
        mask[row, :n] = 0  # left padding of n keys
    graph = program.entries["decode"]
    feed = {v.name: ins[v.name] for v in graph.inputs if v.name in ins} | Sampling().inputs(0)
    feed["attention_mask"] = mask
    out = interpret(graph, feed, state=state, symbols={program.roles["past"]: past})
    return out, state["kv_cache"]


@pytest.mark.parametrize("name", DECODERS)
def test_decode_outputs_unchanged_with_left_padding(name):
    got_p, base_p, record = programs(name)
    for pad in ([0, 0, 0, 0], [2, 0, 1, 3]):
        got, cache_got = _run_decode(got_p, name, pad)
        want, cache_want = _run_decode(base_p, name, pad)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{key} pad {pad}")
        np.testing.assert_array_equal(cache_got, cache_want)


@pytest.mark.parametrize("name", DECODERS)
def test_fires_except_on_sliding_windows(name):
    got_p, base_p, record = programs(name)
    ops = [n.op for n in got_p.entries["decode"].nodes]
    base_ops = [n.op for n in base_p.entries["decode"].nodes]
    if name in WINDOWED:
        assert not record.applied and any("window" in why for why in record.declined.values())
        assert ops == base_ops
        return
    assert sum(record.applied.values()) == 1, record  # every layer's Attention shares the one mask
    assert "GatherND" not in ops, ops
    gone = len(base_ops) - len(ops)
    assert gone >= 5, (gone, base_ops)
    # prefill keeps its causal mask machinery
    assert [n.op for n in got_p.entries["prefill"].nodes] == [n.op for n in base_p.entries["prefill"].nodes]
