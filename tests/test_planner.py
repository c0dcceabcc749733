"""The static memory planner (passes/plan_memory.py).

- `best_fit` property tests (hypothesis): buffers live at the same step never share bytes, every
  offset is aligned, the end is at most the sum of the aligned sizes, the result is deterministic
  and independent of the input order;
- `plan_memory` on every fixture at a few (max_batch, max_seq): `check_plan` is clean, regions are
  laid out in the documented order without overlap, every value has a placement inside its region,
  KV-cache views sit in the cache with strides, decoder buffers honour past + seq <= max_seq;
- a deliberately wrong plan is caught by `check_plan`, and an artifact built with an overlapping
  plan gives wrong results on the CPU arena executor while the real plan matches onnxruntime.
"""

from __future__ import annotations

import functools
import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import atlasc.passes.plan_memory as pm
from atlasc.artifact import open_artifact
from atlasc.compiler import compile_model
from atlasc.frontend import import_onnx
from atlasc.ir import symbolic as S
from atlasc.ir.dtypes import itemsize
from atlasc.ir.memory import ALIGNMENT, REGIONS, Placement, align
from atlasc.ir.program import CompileOptions, Program
from atlasc.pipeline import PIPELINES, run_pipeline
from atlasc.runtime.cpu import CpuModel

from conftest import FIXTURES

MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
NAMES = [f["name"] for f in MANIFEST]
DECODERS = [f["name"] for f in MANIFEST if f["kind"] == "decoder"]
LIMITS = [(1, 8), (2, 32), (3, 100)]  # (max_batch, max_seq)


# ---------------------------------------------------------------------------------------------
# best_fit: properties on random buffer lists

def _size():
    return st.one_of(st.integers(1, 64).map(lambda k: k * ALIGNMENT),  # multiples of 256
                     st.integers(1, 20_000))  # anything


@st.composite
def buffer_lists(draw):
    n = draw(st.integers(0, 40))
    out = []
    for i in range(n):
        start = draw(st.integers(0, 40))
        stop = draw(st.integers(start, 40))
        out.append((f"b{i}", draw(_size()), (start, stop)))
    return out


def _overlap(a0, a1, b0, b1) -> bool:
    return a0 <= b1 and b0 <= a1


@settings(max_examples=300, deadline=None)
@given(buffer_lists())
def test_best_fit_no_overlap_aligned_bounded(buffers):
    offsets, end = pm.best_fit(buffers)
    assert set(offsets) == {name for name, _, _ in buffers}
    for name, size, _ in buffers:
        assert offsets[name] % ALIGNMENT == 0, (name, offsets[name])
        assert offsets[name] >= 0
        assert offsets[name] + size <= end
    for i, (a, sa, (a0, a1)) in enumerate(buffers):
        for b, sb, (b0, b1) in buffers[i + 1:]:
            if _overlap(a0, a1, b0, b1):
                oa, ob = offsets[a], offsets[b]
                assert oa + sa <= ob or ob + sb <= oa, f"{a}@{oa}+{sa} and {b}@{ob}+{sb} are live together"
    assert end % ALIGNMENT == 0
    assert end <= sum(align(size) for _, size, _ in buffers)
    # and no better than the true lower bound: the bytes live at the busiest step
    if buffers:
        peak = max(sum(s for _, s, (a0, a1) in buffers if a0 <= t <= a1) for t in range(41))
        assert end >= peak


@settings(max_examples=100, deadline=None)
@given(buffer_lists(), st.randoms(use_true_random=False))
def test_best_fit_deterministic_and_order_independent(buffers, rnd: random.Random):
    first = pm.best_fit(buffers)
    assert pm.best_fit(list(buffers)) == first
    shuffled = list(buffers)
    rnd.shuffle(shuffled)
    assert pm.best_fit(shuffled) == first


def test_best_fit_reuses_dead_buffers():
    # three buffers in sequence: the third reuses the first's bytes
    offsets, end = pm.best_fit([("a", 1024, (0, 1)), ("b", 1024, (1, 2)), ("c", 1024, (2, 3))])
    assert offsets["a"] == offsets["c"] != offsets["b"]
    assert end == 2048


# ---------------------------------------------------------------------------------------------
# plan_memory on the fixtures

@functools.cache
def planned(name: str, max_batch: int, max_seq: int, mask_lengths: bool = True) -> Program:
    """The fixture through the default pipeline (mask_lengths=False: without mask-as-lengths, so prefill
    keeps its materialized [.., seq, past + seq] masks)."""
    graph = import_onnx(FIXTURES / f"{name}.onnx")
    names = [n for n in PIPELINES["default"] if mask_lengths or n != "mask-as-lengths"]
    program, _ = run_pipeline(Program({"main": graph}, CompileOptions(max_batch=max_batch, max_seq=max_seq)),
                              names, verify_each=True)
    return program


CASES = [(n, b, s) for n in NAMES for b, s in LIMITS]


@pytest.mark.parametrize("name,max_batch,max_seq", CASES)
def test_plan_is_sound(name, max_batch, max_seq):
    program = planned(name, max_batch, max_seq)
    assert pm.check_plan(program) == []
    regions = next(iter(program.plans.values())).regions
    # the documented order, contiguous, aligned, no overlap
    assert tuple(regions) == REGIONS
    cursor = 0
    for r in REGIONS:
        assert regions[r].offset == cursor, (r, regions)
        assert regions[r].offset % ALIGNMENT == 0 and regions[r].nbytes % ALIGNMENT == 0
        cursor += regions[r].nbytes
    for plan in program.plans.values():
        assert plan.regions == regions, "entries share one arena"
        assert plan.arena_bytes == cursor
        assert plan.activation_peak <= plan.activation_naive
        assert plan.activation_peak <= regions["activations"].nbytes
        assert plan.dims_offset == regions["io"].offset
        assert regions["kv_cache"].nbytes == (0 if program.kind == "encoder" else
                                              align(int(np.prod(program.kv_cache.shape)) *
                                                    itemsize(program.kv_cache.dtype)))
    assert regions["activations"].nbytes == max(p.activation_peak for p in program.plans.values())


@pytest.mark.parametrize("max_batch", [4, 16])
def test_the_decode_steps_inputs_begin_right_after_the_dims_buffer(max_batch):
    """The entry run once per generated token (split-decode's decode_small where there is one, else decode) has
    its inputs right after the dims buffer, so GpuModel's staged upload sends the dims and them in one copy."""
    program = planned("llama", max_batch, 64)
    step = "decode_small" if max_batch > 8 else "decode"
    assert step in program.entries
    plan = program.plans[step]
    first = min(plan.placements[v.name].offset for v in program.entries[step].inputs)
    assert first == plan.dims_offset + align(8 * max(len(plan.symbols), 1))
    assert pm.io_order(program)[0] == step


@pytest.mark.parametrize("max_batch", [4, 16])
def test_a_decode_steps_input_ids_share_the_slot_of_its_next_tokens(max_batch):
    """A decode step reads its input ids first and writes next_tokens last: one slot, so the next step's ids are
    where this step's tokens are (no device copy between pipelined steps). Not in prefill (its tokens go to a
    decode step's slot by copy). check_plan refuses any other two inputs or outputs in one slot."""
    program = planned("llama", max_batch, 64)
    for entry in program.entries:
        placements = program.plans[entry].placements
        if entry == "prefill":
            assert pm.tokens_slot_input(program, entry) is None
            assert placements["input_ids"].offset != placements["next_tokens"].offset
            continue
        assert pm.tokens_slot_input(program, entry) == "input_ids"
        assert placements["input_ids"] == placements["next_tokens"]
        readers = [i for i, n in enumerate(program.entries[entry].nodes)
                   if any(x is not None and x.name == "input_ids" for x in n.inputs)]
        assert readers and max(readers) < len(program.entries[entry].nodes) - 1  # before the sampling
    placements = program.plans["decode"].placements  # the cached program: put back after
    kept = placements["position_ids"]
    placements["position_ids"] = placements["attention_mask"]
    try:
        assert any("share one slot" in p for p in pm.check_plan(program))
    finally:
        placements["position_ids"] = kept
    assert pm.check_plan(program) == []


@pytest.mark.parametrize("name,max_batch,max_seq", CASES)
def test_every_value_placed_inside_its_region(name, max_batch, max_seq):
    program = planned(name, max_batch, max_seq)
    io_spans = []
    for entry, graph in program.entries.items():
        plan = program.plans[entry]
        regions = plan.regions
        for v in graph.all_values():
            assert v.name in plan.placements, f"{entry}: {v.name} has no placement"
            p = plan.placements[v.name]
            r = regions[p.region]
            assert p.offset % ALIGNMENT == 0 and p.nbytes % ALIGNMENT == 0
            assert r.offset <= p.offset and p.offset + p.nbytes <= r.offset + r.nbytes, \
                f"{entry}: {v.name} {p} outside {r}"
            if v.is_constant:
                assert p.region == "weights"
            elif v in graph.inputs or v in graph.outputs:
                assert p.region == "io"
            # a buffer holds the value at its compile-time maximum
            if p.strides is None and not v.is_constant:
                assert p.nbytes >= pm.value_bytes(v, program.bounds.get(entry, {}), program.roles,
                                                  max_seq if program.kind == "decoder" else None)
        ids = pm.tokens_slot_input(program, entry)  # a decode step's input ids share next_tokens' slot
        for name_, p in plan.placements.items():
            if p.region == "io" and name_ not in plan.aliases and name_ != ids:  # an alias shares its root's bytes
                io_spans.append((entry, name_, p.offset, p.nbytes))
        # the dims buffer comes first in io, before any entry input/output
        n_syms = max(len(plan.symbols), 1)
        assert min(p.offset for p in plan.placements.values() if p.region == "io") >= plan.dims_offset + 8 * n_syms
    # io is never reused: no two io buffers of any entries share bytes (save a decode step's ids and tokens)
    io_spans.sort(key=lambda s: s[2])
    for (e1, n1, o1, s1), (e2, n2, o2, _) in zip(io_spans, io_spans[1:]):
        assert o1 + s1 <= o2, f"io {e1}:{n1} and {e2}:{n2} overlap"


@pytest.mark.parametrize("name", NAMES)
def test_reshape_aliases_share_their_roots_bytes_for_as_long_as_they_are_read(name):
    """A reshape-like output over a contiguous input shares the input's placement (no kernel); the
    root's buffer stays reserved until the alias's last reader, and a graph output never aliases."""
    program = planned(name, 2, 32)
    aliased = 0
    for entry, graph in program.entries.items():
        plan = program.plans[entry]
        producers = {o.name: n for n in graph.nodes for o in n.outputs}
        last_read = {}
        for step, n in enumerate(graph.nodes):
            for i in n.inputs:
                if i is not None:
                    last_read[i.name] = step
        for name_, root in plan.aliases.items():
            aliased += 1
            node = producers[name_]
            assert node.op in pm.ALIAS_OPS
            assert plan.placements[name_] == plan.placements[root]
            assert plan.placements[root].strides is None
            assert name_ not in {o.name for o in graph.outputs}
            assert root not in plan.aliases, "aliases point at their root, not at another alias"
            if root in plan.lifetimes and name_ in last_read:
                assert plan.lifetimes[root][1] >= last_read[name_]
        assert pm.check_plan(program) == []
    assert aliased, "every fixture has a reshape to alias"


@pytest.mark.parametrize("name", DECODERS)
def test_kv_append_outputs_are_strided_views_of_the_cache(name):
    """Every cache write's output (KVAppend's, QKVRotary's two presents) is a view of its own slot."""
    from atlasc.passes.plan_memory import cache_kind

    program = planned(name, 2, 32)
    kv = program.kv_cache
    assert kv is not None and kv.max_batch == 2 and kv.max_seq == 32
    slot_bytes = kv.max_batch * kv.kv_heads * kv.max_seq * kv.head_dim * itemsize(kv.dtype)
    for entry, graph in program.entries.items():
        plan = program.plans[entry]
        region = plan.regions["kv_cache"]
        writes = [(n, o, cache_kind(n, i)) for n in graph.nodes for i, o in enumerate(n.outputs)
                  if cache_kind(n, i) is not None]
        assert len(writes) == 2 * kv.layers
        slots = set()
        for node, out, kind in writes:
            p = plan.placements[out.name]
            assert p.region == "kv_cache"
            assert p.strides == (kv.kv_heads * kv.max_seq * kv.head_dim, kv.max_seq * kv.head_dim, kv.head_dim, 1)
            assert region.offset <= p.offset and p.offset + slot_bytes <= region.offset + region.nbytes
            slot = (p.offset - region.offset) // slot_bytes
            assert slot == node.attrs["layer"] * 2 + ("key", "value").index(kind)
            slots.add(slot)
            assert out.name not in plan.lifetimes, "a cache view is not an activation"
        assert slots == set(range(2 * kv.layers))


def _feasible_max(d, upper: dict, past: str, seq: str, max_seq: int) -> int:
    """Brute force: the largest value of d over integer past >= 0, 1 <= seq with past + seq <= max_seq
    (seq fixed to 1 where the entry binds it), every other symbol at its maximum."""
    seqs = range(1, upper[seq] + 1) if seq in upper else [1]
    best = 0
    for s_ in seqs:
        for p_ in range(0, min(upper[past], max_seq - s_) + 1):
            best = max(best, S.evaluate(d, {**upper, past: p_, seq: s_}))
    return best


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("max_seq", [8, 32])
def test_decoder_buffers_sized_for_past_plus_seq_at_most_max_seq(name, max_seq):
    # without mask-as-lengths: its materialized masks are the [.., seq, past + seq] buffers checked here
    program = planned(name, 2, max_seq, mask_lengths=False)
    past, seq = program.roles["past"], program.roles["seq"]
    checked = softmax = 0
    for entry, graph in program.entries.items():
        upper = program.bounds[entry]
        plan = program.plans[entry]
        seen = {}
        for node in graph.nodes:
            for v in node.outputs:
                for d in v.shape:
                    if past in S.symbols_of(d) and str(d) not in seen:
                        # sound (never below a reachable size) and tight (not above one)
                        seen[str(d)] = got = pm.dim_upper(d, upper, program.roles, max_seq)
                        assert got == _feasible_max(d, upper, past, seq, max_seq), (entry, v.name, d, got)
                if entry != "prefill" or v.name not in plan.lifetimes:
                    continue
                keys = [d for d in v.shape if S.symbols_of(d) == {past, seq}]
                if keys and any(S.as_symbol(d) == seq for d in v.shape):
                    # [.., seq, past + seq] (attention scores, masks): max_seq keys, not 2 * max_seq - 1
                    assert S.evaluate(keys[0], upper) > max_seq  # the naive bound would be too big
                    assert pm.dim_upper(keys[0], upper, program.roles, max_seq) == max_seq
                    n = 1
                    for d in v.shape:
                        n *= max_seq if d in keys else S.evaluate(d, upper)
                    assert plan.placements[v.name].nbytes == align(max(n * itemsize(v.dtype), 1)), v.name
                    checked += 1
                    if node.op == "Softmax":
                        softmax += 1
    assert checked >= 1
    if any(n.op == "Softmax" for g in program.entries.values() for n in g.nodes):  # unfused attention
        assert softmax >= 2  # one per layer


def test_dim_upper_simplex():
    roles = {"past": "p", "seq": "s"}
    upper = {"p": 31, "s": 32, "b": 4}
    ps = S.add(S.sym("p"), S.sym("s"))
    assert pm.dim_upper(ps, upper, roles, 32) == 32
    assert pm.dim_upper(ps, upper, roles, None) == 63  # encoders: no joint constraint
    assert pm.dim_upper(S.add(S.sym("p"), 1), {"p": 31}, roles, 32) == 32  # decode: seq bound to 1
    assert pm.dim_upper(S.sym("s"), upper, roles, 32) == 32
    assert pm.dim_upper(S.mul(S.sym("b"), ps), upper, roles, 32) == 4 * 32


# ---------------------------------------------------------------------------------------------
# a deliberately wrong plan is caught

def _live_together_pair(plan):
    acts = sorted(plan.lifetimes.items(), key=lambda kv: (kv[1], kv[0]))
    for i, (a, (a0, a1)) in enumerate(acts):
        for b, (b0, b1) in acts[i + 1:]:
            if _overlap(a0, a1, b0, b1) and plan.placements[a].offset != plan.placements[b].offset:
                return a, b
    raise AssertionError("no two activations live together")


def test_check_plan_catches_an_overlapping_activation():
    planned.cache_clear()  # the program is edited below: do not hand it to other tests
    program = planned("llama", 2, 32)
    planned.cache_clear()
    plan = program.plans["prefill"]
    a, b = _live_together_pair(plan)
    pa, pb = plan.placements[a], plan.placements[b]
    plan.placements[a] = Placement(pa.region, pb.offset, pa.nbytes, pa.strides)
    problems = pm.check_plan(program)
    assert any(a in p and b in p and "overlap" in p for p in problems), problems
    # an unaligned placement is caught too
    plan.placements[a] = Placement(pa.region, pa.offset + 8, pa.nbytes, pa.strides)
    assert any("unaligned" in p and a in p for p in pm.check_plan(program))


def test_check_plan_catches_a_value_overrunning_its_region():
    planned.cache_clear()
    program = planned("llama", 2, 32)
    planned.cache_clear()
    plan = program.plans["prefill"]
    act = plan.regions["activations"]
    name = next(iter(plan.lifetimes))
    # a buffer twice the activation region's size at its start: it runs past the arena's end
    plan.placements[name] = Placement("activations", act.offset, 2 * act.nbytes)
    assert any(name in p and "outside" in p for p in pm.check_plan(program))


def _prefill_case():
    z = np.load(FIXTURES / "llama.prefill.npz")
    return ({k[3:]: z[k] for k in z.files if k.startswith("in.")},
            {k[4:]: z[k] for k in z.files if k.startswith("out.")})


def _run_prefill(path):
    ins, want = _prefill_case()
    with open_artifact(path) as art:
        entry = art.manifest.entries["prefill"]
        # inputs the ONNX case does not have (static, e.g. sampling parameters): zeros
        feed = {i.name: ins[i.name] if i.name in ins else np.zeros([int(S.from_json(d)) for d in i.shape], i.dtype)
                for i in entry.inputs}
        out = CpuModel(art).run("prefill", feed, {art.manifest.report["roles"]["past"]: 0})
    return out["logits"], want["logits"]


def test_wrong_plan_corrupts_the_arena_executor(tmp_path, monkeypatch, no_nvcc):
    # the CPU executor never reads cubins (no_nvcc): this test is about the memory plan
    options = CompileOptions(archs=("sm80",), max_batch=2, max_seq=32, verify=True)

    good = compile_model(FIXTURES / "llama.onnx", tmp_path / "good.atlas", options)
    assert pm.check_plan(good.program) == []
    got, want = _run_prefill(good.path)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)

    def everything_at_zero(buffers):
        return {name: 0 for name, _, _ in buffers}, align(max((s for _, s, _ in buffers), default=0))

    monkeypatch.setattr(pm, "best_fit", everything_at_zero)
    bad = compile_model(FIXTURES / "llama.onnx", tmp_path / "bad.atlas", options)
    problems = pm.check_plan(bad.program)
    assert problems and all("live together and overlap" in p for p in problems)
    got, want = _run_prefill(bad.path)  # the plan is deterministic: it runs, on clobbered buffers
    assert got.shape == want.shape
    assert not np.allclose(got, want, atol=1e-2, rtol=1e-2, equal_nan=False)
