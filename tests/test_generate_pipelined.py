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


def test_gpu_submit_enqueues_staged_inputs_the_token_copy_the_step_and_the_tokens_back(llama):
    """GpuModel.submit on a simulated device (tests/fake_gpu.py), in stream order: the dims and every input from
    its stage's pinned buffers, then the previous call's tokens copied over the input ids on the device, the
    step's kernels, next_tokens back into the stage, the stage's event; two stages in turn, a stage's earlier
    call waited for before its reuse."""
    from fake_gpu import FakeDevice

    from atlasc.runtime.gpu import GpuModel

    dev = FakeDevice()
    model = GpuModel(open_artifact(llama), device=dev, cuda_graphs=False)
    m = model.manifest
    entry = m.entries["decode"]
    feeds = {"input_ids": np.zeros((3, 1), np.int64), "attention_mask": np.ones((3, 9), np.int64),
             "position_ids": np.full((3, 1), 8, np.int64), **Sampling().inputs(1)}
    feeds = {i.name: feeds[i.name] for i in entry.inputs}
    slots = []
    for call in range(3):
        dev.ops.clear()
        dev.launched.clear()
        slots.append(model.submit("decode", feeds, {"past_seq": 8}, tokens_from=4096, tokens_to="input_ids"))
        stage = model._stages[slots[-1]]
        if call == 2:  # slot 0 again: its first call is waited for before its buffers are rewritten
            assert dev.ops.pop(0) == ("sync", id(stage.done))
        kinds = [op[0] for op in dev.ops]
        assert kinds == ["htod"] * (1 + len(entry.inputs)) + ["dtod", "dtoh", "event"]
        assert dev.ops[0][1] == m.memory.dims_offset and dev.ops[0][2] is stage.dims
        for op, spec in zip(dev.ops[1:], entry.inputs):
            assert op[1] == spec.offset and op[2].base is stage.inputs  # a view of the pinned stage
            assert np.array_equal(op[2], np.ascontiguousarray(feeds[spec.name]).view(np.uint8).reshape(-1))
        ids = next(i for i in entry.inputs if i.name == "input_ids")
        assert dev.ops[-3] == ("dtod", ids.offset, 4096, 3 * 8)
        nxt = next(o for o in entry.outputs if o.name == "next_tokens")
        assert dev.ops[-2][2] == nxt.offset and len(dev.ops[-2][1]) == 3 and stage.count == 3
        assert len(dev.launched) == sum(1 for n in entry.nodes if n.kernel)  # the step, between the two
        model.collect(slots[-1])
    assert slots == [0, 1, 0]
    assert model.tokens_offset("decode") == next(o.offset for o in entry.outputs if o.name == "next_tokens")
