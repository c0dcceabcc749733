"""generate's pipelined decode loop (runtime/generate.py _DecodeCalls with a backend that has GpuModel's submit /
collect / tokens_offset): each call is enqueued behind the previous one with its input ids taken from that
call's next_tokens "on the device", before the host reads them. Here the backend is the CPU executor behind a
simulated device (calls run in submit order, tokens kept by arena offset): the tokens, stop handling, sampling
steps and callbacks must equal the plain loop's."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from conftest import FIXTURES

from atlasc.artifact import open_artifact
from atlasc.compiler import compile_model
from atlasc.ir.program import CompileOptions
from atlasc.runtime.cpu import CpuModel
from atlasc.runtime.generate import Sampling, generate


class PipelinedCpu:
    """CpuModel with GpuModel's pipelined calls: submit runs the call at once (in order, as the stream would)
    after replacing input `tokens_to` by the tokens stored at `tokens_from`; collect returns a slot's tokens
    and checks GpuModel's rule that a slot is collected before it is reused."""

    OFFSETS = {"prefill": 1000, "decode": 2000}

    def __init__(self, art):
        self.cpu = CpuModel(art)
        self.manifest = self.cpu.manifest
        self.device: dict[int, np.ndarray] = {}  # arena offset -> next_tokens written there
        self.slots: dict[int, np.ndarray] = {}
        self.submitted = 0
        self.host_ids: list[np.ndarray] = []  # the input ids the host passed to submit

    def reset(self):
        self.cpu.reset()
        self.device.clear()

    def run(self, entry, inputs, symbols=None, outputs=None):
        out = self.cpu.run(entry, inputs, symbols, outputs=outputs)
        self.device[self.OFFSETS[entry]] = out["next_tokens"].copy()
        return out

    def tokens_offset(self, entry):
        return self.OFFSETS[entry]

    def submit(self, entry, inputs, symbols, *, tokens_from=None, tokens_to=""):
        slot = self.submitted % 2
        assert slot not in self.slots, "a stage reused before its call was collected"
        self.submitted += 1
        inputs = dict(inputs)
        self.host_ids.append(inputs[tokens_to].copy())
        inputs[tokens_to] = self.device[tokens_from].reshape(-1, 1).astype(np.int64)
        self.slots[slot] = self.run(entry, inputs, symbols, outputs=("next_tokens",))["next_tokens"]
        return slot

    def collect(self, slot):
        return self.slots.pop(slot)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH (the compile builds empty cubins)")
    from conftest import empty_cubins

    path = tmp_path_factory.mktemp("pipelined") / "llama.atlas"
    with empty_cubins():
        compile_model(FIXTURES / "llama.onnx", path, CompileOptions(archs=("sm90",), max_batch=4, max_seq=64))
    return path


@pytest.mark.parametrize("new_tokens", [1, 2, 3, 12])
def test_pipelined_greedy_tokens_equal_the_plain_loop(llama, new_tokens):
    prompts = [[5, 17, 42, 7, 99], [3, 8]]
    want = generate(CpuModel(open_artifact(llama)), prompts, new_tokens)
    model = PipelinedCpu(open_artifact(llama))
    got = generate(model, prompts, new_tokens)
    assert got.tokens == want.tokens
    assert model.submitted == new_tokens - 1 and not model.slots  # every decode call submitted and collected
    assert all(not ids.any() for ids in model.host_ids)  # the ids came from the "device", not the host
    assert len(got.decode_seconds) == new_tokens - 1


def test_pipelined_stop_tokens_sampling_and_callbacks_equal_the_plain_loop(llama):
    prompts = [[5, 17, 42, 7, 99], [3, 8], [11]]
    sampling = Sampling(temperature=0.8, top_k=20, seed=7)
    plain_seen, seen = [], []
    want = generate(CpuModel(open_artifact(llama)), prompts, 10, sampling=sampling,
                    on_token=lambda step, toks: plain_seen.append((step, toks)))
    stop = [want.tokens[0][3], want.tokens[1][2], want.tokens[2][4]]  # every sequence stops early
    want = generate(CpuModel(open_artifact(llama)), prompts, 10, sampling=sampling, stop_tokens=stop,
                    on_token=lambda step, toks: plain_seen.append((step, toks)))
    model = PipelinedCpu(open_artifact(llama))
    got = generate(model, prompts, 10, sampling=sampling, stop_tokens=stop,
                   on_token=lambda step, toks: seen.append((step, toks)))
    assert got.tokens == want.tokens and max(map(len, got.tokens)) < 10
    assert seen == plain_seen[-len(seen):]  # the second plain run's callbacks
    assert not model.slots  # the call enqueued past the stop was drained


def test_per_step_logits_take_the_plain_loop(llama):
    """keep_logits needs every step's logits on the host: no pipelining (nothing submitted)."""
    model = PipelinedCpu(open_artifact(llama))
    got = generate(model, [[5, 17, 42]], 4, keep_logits=True)
    assert model.submitted == 0 and len(got.step_logits) == 3


@pytest.mark.parametrize("copy_stream", ["1", "0"])
def test_gpu_submit_enqueues_staged_inputs_the_token_copy_the_step_and_the_tokens_back(llama, copy_stream,
                                                                                       monkeypatch):
    """GpuModel.submit on a simulated device (tests/fake_gpu.py), in stream order: the dims and the inputs from
    its stage's pinned buffer in one copy (plan_memory puts them side by side after the dims, the growing
    attention mask last; the input ids are not staged: they share next_tokens' slot), then the previous call's
    tokens copied into the input ids on the device unless they are there already (the previous call was a
    decode step), the step's kernels, next_tokens back into the stage, the stage's event; two stages in turn, a
    stage's earlier call waited for before its reuse. The copies leave every staged input's bytes at its arena
    offset and write nothing outside the dims and the entry's input slots. ATLAS_COPY_STREAM=1 (default): the
    tokens go back on the copy stream, which waits for an event behind the step's kernels, and the next call's
    kernels (and its token copy) wait for that copy, its input copy not."""
    from fake_gpu import FakeDevice

    from atlasc.runtime.gpu import GpuModel

    monkeypatch.setenv("ATLAS_COPY_STREAM", copy_stream)
    dev = FakeDevice()
    model = GpuModel(open_artifact(llama), device=dev, cuda_graphs=False)
    m = model.manifest
    entry = m.entries["decode"]
    ids = next(i for i in entry.inputs if i.name == "input_ids")
    nxt = next(o for o in entry.outputs if o.name == "next_tokens")
    assert (ids.offset, ids.nbytes) == (nxt.offset, nxt.nbytes)  # one slot (plan_memory tokens_slot_input)
    specs = sorted((i for i in entry.inputs if i.name != "input_ids"), key=lambda i: i.offset)
    assert specs[-1].name == "attention_mask"  # the largest upper bound last
    assert all(a.offset + a.nbytes == b.offset for a, b in zip(specs, specs[1:]))  # side by side
    slots, rng = [], np.random.default_rng(0)
    for call in range(4):
        past = 8 + call
        feeds = {"input_ids": np.zeros((3, 1), np.int64), "attention_mask": rng.integers(0, 2, (3, past + 1)),
                 "position_ids": rng.integers(0, 60, (3, 1)), **Sampling(seed=call).inputs(1)}
        feeds = {i.name: feeds[i.name] for i in entry.inputs}
        dev.ops.clear()
        dev.launched.clear()
        # calls 0-2 as after a prefill (its tokens elsewhere), call 3 as after a decode step: no copy
        tokens_from = 4096 if call < 3 else model.tokens_offset("decode")
        slots.append(model.submit("decode", feeds, {"past_seq": past}, tokens_from=tokens_from,
                                  tokens_to="input_ids"))
        stage = model._stages[slots[-1]]
        if call >= 2:  # a slot again: its earlier call is waited for before its buffers are rewritten
            assert dev.ops.pop(0) == ("sync", id(stage.done))
        kinds = [op[0] for op in dev.ops]
        # the dims go up with the inputs: one copy
        want = ["htod", "dtod", "dtoh", "event"] if call < 3 else ["htod", "dtoh", "event"]
        if copy_stream == "1":
            want[-2:-2] = ["event", "wait"]  # the step's event on the stream, the copy stream's wait for it
            if call > 0:  # the kernels wait for the previous call's tokens to be read
                want.insert(1, "wait")
                previous = model._stages[slots[-2]]
                assert dev.ops[1] == ("wait", "main", id(previous.done))
            assert dev.ops[-4:-2] == [("event", id(stage.ran), "main"), ("wait", "copy", id(stage.ran))]
        assert kinds == want
        assert dev.ops[-2][3] == ("copy" if copy_stream == "1" else "main")
        assert dev.ops[-1] == ("event", id(stage.done), dev.ops[-2][3])
        start, data = dev.ops[0][1], dev.ops[0][2]
        assert data.base is stage.inputs  # a view of the pinned stage
        assert start == m.memory.dims_offset  # plan_memory: the decode step's inputs right after the dims
        env = model.last_env["decode"]
        assert env["past_seq"] == past and env["batch"] == 3
        dims = np.array([env.get(s.name, 0) for s in m.symbols], np.int64)
        assert np.array_equal(data[: dims.nbytes], dims.view(np.uint8))
        hi = specs[-1].offset + specs[-1].nbytes
        assert start + data.size <= hi  # inside the dims and the entry's input slots
        for spec in specs:
            if spec.name == "input_ids":
                continue
            raw = np.ascontiguousarray(feeds[spec.name]).view(np.uint8).reshape(-1)
            assert start <= spec.offset and spec.offset + raw.size <= start + data.size
            assert np.array_equal(data[spec.offset - start: spec.offset - start + raw.size], raw), spec.name
        if call < 3:
            assert next(op for op in dev.ops if op[0] == "dtod") == ("dtod", ids.offset, 4096, 3 * 8)
        assert dev.ops[-2][2] == nxt.offset and len(dev.ops[-2][1]) == 3 and stage.count == 3
        assert len(dev.launched) == sum(1 for n in entry.nodes if n.kernel)  # the step, between the two
        model.collect(slots[-1])
    assert slots == [0, 1, 0, 1]
    assert model.tokens_offset("decode") == nxt.offset


def test_gpu_submit_stages_a_step_through_the_mapped_kernels_when_its_inputs_fit(llama, monkeypatch):
    """Mapped staging (runtime/staging.py) on a simulated device that maps host memory: a call whose dims and inputs
    are one span within the graph's capacity issues no copy: the header (16-byte words, the dims' arena offset)
    and the bytes in arena layout are in its stage's mapped buffer, and its kernels run between atlas_stage_in
    (reading that buffer) and atlas_stage_out (next_tokens' slot into the stage's mapped tokens), the stage's event
    on the main stream. A call whose span is longer than the capacity (call 2 here) takes the copies instead; the
    call after it waits for its tokens' copy back, the one after a mapped call does not."""
    from fake_gpu import FakeDevice

    import atlasc.runtime.gpu as gpu

    monkeypatch.delenv("ATLAS_MAPPED_STAGING", raising=False)
    dev = FakeDevice(mapped=True)
    model = gpu.GpuModel(open_artifact(llama), device=dev, cuda_graphs=False)
    assert model.staging is not None
    m = model.manifest
    entry = m.entries["decode"]
    nxt = next(o for o in entry.outputs if o.name == "next_tokens")
    specs = sorted((i for i in entry.inputs if i.name != "input_ids"), key=lambda i: i.offset)
    kernels = [n.kernel for n in entry.nodes if n.kernel]
    rng = np.random.default_rng(1)
    slots = []
    for call in range(4):
        past = 8 + call
        feeds = {"input_ids": np.zeros((3, 1), np.int64), "attention_mask": rng.integers(0, 2, (3, past + 1)),
                 "position_ids": rng.integers(0, 60, (3, 1)), **Sampling(seed=call).inputs(1)}
        feeds = {i.name: feeds[i.name] for i in entry.inputs}
        monkeypatch.setattr(gpu, "MAX_BYTES", 64 if call == 2 else staging_max())
        model._capacities.clear()  # worked out once per entry otherwise
        dev.ops.clear()
        dev.launched.clear()
        tokens_from = 4096 if call == 0 else model.tokens_offset("decode")
        slots.append(model.submit("decode", feeds, {"past_seq": past}, tokens_from=tokens_from,
                                  tokens_to="input_ids"))
        stage = model._stages[slots[-1]]
        ops = [op for op in dev.ops if op[0] != "sync"]
        if call == 2:  # the copies
            assert [op[0] for op in ops] == ["htod", "event", "wait", "dtoh", "event"] and not stage.mapped
            assert dev.launched == kernels
            model.collect(slots[-1])
            continue
        assert stage.mapped and dev.launched == ["atlas_stage_in", *kernels, "atlas_stage_out"]
        want = ["atlas_stage_in", "atlas_stage_out", "event"]
        if call == 0:
            want.insert(0, "dtod")  # the prefill's tokens into the input ids
        if call == 3:  # after call 2's copy back on the copy stream
            want.insert(0, "wait")
            assert ops[0] == ("wait", "main", id(model._stages[slots[2]].done))
        assert [op[0] for op in ops] == want
        stage_in = next(op for op in ops if op[0] == "atlas_stage_in")
        assert stage_in[2:] == (0, stage.host_in) and dev.pinned[stage.host_in] is stage.raw
        words, offset = stage.raw[:16].view(np.uint64).tolist()
        assert offset == m.memory.dims_offset
        raw = stage.raw[16:]
        env = model.last_env["decode"]
        dims = np.array([env.get(s.name, 0) for s in m.symbols], np.int64)
        assert np.array_equal(raw[: dims.nbytes], dims.view(np.uint8))
        end = 0
        for spec in specs:
            data = np.ascontiguousarray(feeds[spec.name]).view(np.uint8).reshape(-1)
            at = spec.offset - offset
            assert np.array_equal(raw[at: at + data.size], data), spec.name
            end = at + data.size
        assert words == -(-end // 16) and stage_in[1][0] * 256 * 16 >= 16 * words
        stage_out = next(op for op in ops if op[0] == "atlas_stage_out")
        assert stage_out[2:] == (stage.host_tokens, nxt.offset, stage.tokens.nbytes // 16)
        assert dev.pinned[stage.host_tokens] is stage.tokens and stage.count == 3
        assert ops[-1] == ("event", id(stage.done), "main")
        model.collect(slots[-1])


def staging_max() -> int:
    from atlasc.runtime.staging import MAX_BYTES

    return MAX_BYTES


def test_staged_copies_split_where_an_input_is_far_below_its_slot():
    """GpuModel._stage_inputs: adjacent slots go up in one copy while the slack between them stays within
    COPY_GAP; a larger slack, a gap between slots, or a skipped first input starts a new copy; a skipped input
    between two others is copied over (stale), not split on."""
    from types import SimpleNamespace

    from atlasc.runtime.gpu import COPY_GAP, GpuModel

    def spec(name, offset, nbytes):
        return SimpleNamespace(name=name, offset=offset, nbytes=nbytes)

    def spans(specs, sizes, skip=""):
        pinned = np.zeros(1 << 16, np.uint8)
        feeds = {name: np.full(n, 7, np.uint8) for name, n in sizes.items()}
        got = GpuModel._stage_inputs(specs, feeds, pinned, skip)
        base = min(s.offset for s in specs)
        for s in specs:  # every input not skipped is staged at its slot
            if s.name != skip:
                assert (pinned[s.offset - base: s.offset - base + sizes[s.name]] == 7).all()
        return got

    near = [spec("a", 1000, 256), spec("b", 1256, 256), spec("c", 1512, 8192)]
    assert spans(near, {"a": 8, "b": 16, "c": 100}) == [[1000, 1612]]
    assert spans(near, {"a": 8, "b": 16, "c": 100}, skip="a") == [[1256, 1612]]
    assert spans(near, {"a": 8, "b": 16, "c": 100}, skip="b") == [[1000, 1612]]
    far = [spec("m", 0, 2 * COPY_GAP), spec("p", 2 * COPY_GAP, 256)]
    assert spans(far, {"m": 64, "p": 8}) == [[0, 64], [2 * COPY_GAP, 2 * COPY_GAP + 8]]
    apart = [spec("a", 0, 256), spec("b", 512, 256)]  # not adjacent slots: never merged
    assert spans(apart, {"a": 8, "b": 8}) == [[0, 8], [512, 520]]
    assert spans(apart, {"a": 0, "b": 8}) == [[512, 520]]  # an empty input copies nothing


def test_the_dims_join_a_staged_upload_only_when_the_inputs_begin_right_after_them():
    """GpuModel._staged_specs: the dims buffer's slot (8 bytes per symbol, rounded up to the plan's alignment) is
    the first slot of the staged copy when the entry's first input starts where it ends; otherwise (another
    entry's io in between) and for an entry without inputs the dims go up on their own."""
    from types import SimpleNamespace

    from atlasc.runtime.gpu import DIMS, GpuModel

    memory = SimpleNamespace(dims_offset=1024, alignment=256)
    model = SimpleNamespace(manifest=SimpleNamespace(memory=memory), symbols=["batch", "past_seq", "seq"])
    ids = SimpleNamespace(name="ids", offset=1280, nbytes=256)
    got = GpuModel._staged_specs(model, SimpleNamespace(inputs=[ids]))
    assert [s.name for s in got] == [DIMS, "ids"] and (got[0].offset, got[0].nbytes) == (1024, 256)
    far = SimpleNamespace(name="ids", offset=4096, nbytes=256)
    assert [s.name for s in GpuModel._staged_specs(model, SimpleNamespace(inputs=[far]))] == ["ids"]
    assert GpuModel._staged_specs(model, SimpleNamespace(inputs=[])) == []
    model.symbols = [f"s{i}" for i in range(40)]  # 320 bytes of dims: a slot of 512
    assert [s.name for s in GpuModel._staged_specs(model, SimpleNamespace(inputs=[ids]))] == ["ids"]
    assert GpuModel._staged_specs(model, SimpleNamespace(inputs=[SimpleNamespace(name="x", offset=1536,
                                                                                 nbytes=8)]))[0].name == DIMS
