"""Run an artifact on an NVIDIA GPU: one arena, weights uploaded once, prepared launches, CUDA graphs.

Load: verify the artifact, load the cubins for this GPU's arch (a clear error names the arches the
artifact has), make the one device allocation (an out-of-memory error gives the bytes needed and
free), upload the weights image in one copy, and capture the CUDA graph of every entry and batch bucket
(instantiated and uploaded: the driver's own allocation for them happens here too). Run: write the dims
buffer and the inputs into the arena, launch the entry's kernels (or replay its captured CUDA graph), read
the outputs back. No device allocation happens after load. On sm90+ the captured graphs' kernel-to-kernel
edges are programmatic (ATLAS_PDL=0 turns that off), so a kernel's blocks launch while the previous kernel
drains (each kernel waits for its inputs in atlas::pdl_enter before it reads them and lets the next one launch
in atlas::pdl_leave: at its end, or earlier for the batch-1 projections and the decode attention, codegen/linear.py
early weights): the decode step replayed alone, 8 layers of Llama-3-8B shapes, batch 1
1298.3 -> 1277.9 us, batch 32 2149.1 -> 2132.1 (docs/perf.md v17; earlier one-bench measurements, v7 / v9,
were inside a bench's own +-3%). The pipelined decode loop (submit / collect) stages a step's inputs and tokens
through mapped host memory and two small kernels in the step's graph (runtime/staging.py), not copies.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from atlasc.artifact import Artifact
from atlasc.errors import UsageError
from atlasc.runtime.bind import bind_call, output_shape
from atlasc.runtime.cudagraph import CUDA_ERROR_OUT_OF_MEMORY, PDL_ENV, CapturedGraph, CudaGraphError
from atlasc.runtime.device import Device, DeviceOutOfMemoryError, KernelTable
from atlasc.runtime.launches import bucket_of, entry_buckets, node_launch
from atlasc.runtime.tensor_maps import write_tensor_maps
from atlasc.runtime.staging import (BLOCK, HEADER, MAX_BYTES, blocks_for, load_staging, mapped_setting, mapped_span,
                                    write_header)


@dataclass
class _Stage:
    """One pipelined call's pinned host memory (GpuModel.submit): its inputs, its dims, its tokens coming back,
    and the event recorded behind it. With mapped staging (runtime/staging.py) the input and token buffers are
    mapped: raw is the input buffer with its header, inputs the part after it; host_in / host_tokens are their
    device addresses."""

    inputs: np.ndarray
    dims: np.ndarray
    tokens: np.ndarray
    done: object  # recorded behind the tokens' copy back (on the copy stream with ATLAS_COPY_STREAM=1)
    ran: object  # recorded on the stream behind the call's kernels (what the copy stream waits for)
    count: int = 0  # tokens of its latest call
    used: bool = False  # done has been recorded
    raw: np.ndarray | None = None
    host_in: int = 0
    host_tokens: int = 0
    mapped: bool = False  # its latest call went through the staging kernels (done is on the main stream)


DIMS = "(dims)"  # the dims buffer's slot among a staged upload's slots (_staged_specs)

# bytes of slack (an input below its slot's upper bound) one staged copy may carry rather than split in two: a
# copy's fixed cost on the stream is microseconds, 4 KB over PCIe well under one
COPY_GAP = 4096


COPY_STREAM_ENV = "ATLAS_COPY_STREAM"


def copy_stream_setting() -> bool:
    """ATLAS_COPY_STREAM (default 1): a pipelined call's tokens go back on a second stream (GpuModel.submit);
    UsageError for a value not 0 or 1."""
    value = os.environ.get(COPY_STREAM_ENV, "") or "1"
    if value not in ("0", "1"):
        raise UsageError(f"{COPY_STREAM_ENV}={value!r} is not 0 or 1")
    return value == "1"


def pdl_setting() -> bool:
    """ATLAS_PDL (default 1): programmatic edges in the captured graphs; UsageError for a value not 0 or 1."""
    value = os.environ.get(PDL_ENV, "") or "1"
    if value not in ("0", "1"):
        raise UsageError(f"{PDL_ENV}={value!r} is not 0 or 1")
    return value == "1"


def co_resident_caps(manifest, sms: int) -> dict[str, int]:
    """kernel -> the most blocks a launch of it may have on a GPU of `sms` SMs: the kernels whose blocks must all be
    resident at once (NodeSpec.co_resident: a chain's grid barrier, codegen/quant_chain.py) run one block per SM at
    most; the others are absent. sms 0 (unknown): no cap."""
    return {n.kernel: sms for e in manifest.entries.values() for n in e.nodes if sms > 0 and n.co_resident}


class GpuModel:
    """An artifact loaded on the GPU; same interface as CpuModel (`run`, `reset`, `manifest`)."""

    device = "gpu"

    def __init__(self, artifact: Artifact, *, device: Device | None = None, cuda_graphs: bool = True):
        self.dev = device or Device()
        m = artifact.manifest
        self.manifest = m
        # one module per cubin part (a chunked build has several; each kernel lives in one of them)
        self.modules = [self.dev.load_module(cubin) for cubin in artifact.cubins(self.dev.arch)]
        self.arena = self.dev.alloc_arena(m.memory.arena_bytes)
        weights = artifact.weights_array()
        t = time.perf_counter()
        self.dev.upload(self.arena, 0, weights)
        self.dev.synchronize()
        self.upload_seconds = time.perf_counter() - t
        scratch = m.memory.regions.get("scratch")
        if scratch is not None:  # kernels' counters start at 0 (and every kernel leaves them at 0)
            self.dev.cuda.memset_d8_async(int(self.arena) + scratch.offset, 0, scratch.nbytes, self.dev.stream)
            self.dev.synchronize()
        try:
            write_tensor_maps(self.dev, self.arena, m.memory.tensor_maps)  # the copy engine's (linear_tma.cu)
        except BaseException:  # a failed load keeps nothing on the device
            self.arena.free()
            self.arena = None
            raise
        self.symbols = [s.name for s in m.symbols]
        self.bounds = {s.name: (s.lower, s.upper) for s in m.symbols}
        self.buckets = {name: entry_buckets(e) for name, e in m.entries.items()}
        self.schedules = {}  # (entry, bucket) -> [(kernel, grid, block, smem, args, node)], built on first use
        self.last_env = {}  # entry -> the symbol values of its latest write_inputs
        self.routed: dict[str, str] = {}  # entry called -> the entry its latest write_inputs ran (bind_call)
        self._stages: dict[int, _Stage] = {}  # submit's two pinned stages, made at first use
        self._specs: dict[str, list] = {}  # entry -> the slots its staged uploads fill (_staged_specs)
        self._capacities: dict[str, int] = {}  # entry -> bytes its staging kernel covers (_capacity)
        self._submitted = 0
        self.mapped_calls = 0  # submitted calls that went through the staging kernels
        # the tokens' copy back on its own stream, beside the next call's input copy (submit)
        self._copy_stream = self.dev.cuda.Stream() if copy_stream_setting() else None
        self._submitted_stage: _Stage | None = None  # the latest submit's stage
        # the staging kernels of a pipelined call's graph (runtime/staging.py), or why there are none
        self.staging, self.staging_error = (load_staging(self.dev.cuda, self.dev.device) if mapped_setting()
                                            else (None, "ATLAS_MAPPED_STAGING=0"))
        kernels = sorted({k for e in m.entries.values() for n in e.nodes if n.kernel  # "": an aliased reshape
                          for k in (n.kernel, *(v.kernel for v in n.variants))})
        self.kernels = KernelTable(self.dev, self.modules, kernels)
        self.kernels.grid_cap = co_resident_caps(m, getattr(self.dev, "sms", 0))
        self.dims_host = self.dev.cuda.pagelocked_zeros(max(len(self.symbols), 1), np.int64)
        self.cuda_graphs = cuda_graphs
        # programmatic dependent launch inside the captured graphs (ATLAS_PDL=0: plain edges; measured in
        # docs/perf.md v17); needs sm90+ and kernels that wait in atlas::pdl_enter before they read what earlier
        # kernels wrote (report.codegen pdl_wait)
        self.pdl = (pdl_setting() and int(self.dev.arch[2:]) >= 90
                    and bool(m.report.get("codegen", {}).get("pdl_wait")))
        self.pdl_error = ""  # why the driver refused programmatic edges, when it did (graphs fall back)
        self.graphs = {}
        if cuda_graphs:  # every (entry, bucket) graph now: instantiating one allocates device memory
            try:
                for name, (symbol, uptos) in self.buckets.items():
                    for upto in (*uptos, None):  # None: the default kernels, above every bucket
                        key, launches = self.schedule(name, {symbol: upto} if upto is not None else {})
                        self._graph(key, launches)
                        if self._staged(name):  # and one per pinned stage with the staging kernels
                            for slot in (0, 1):
                                self._staged_graph(key, launches, slot)
                self.dev.synchronize()
            except BaseException as e:  # a failed load keeps nothing on the device
                self.close()
                if isinstance(e, CudaGraphError) and e.code == CUDA_ERROR_OUT_OF_MEMORY:
                    raise DeviceOutOfMemoryError(f"the model's CUDA graphs do not fit beside its arena: {e}",
                                                 hint="compile with a smaller --max-batch / --max-seq, or run "
                                                      "with --no-cuda-graphs") from None
                raise
        self.reset()

    # -- state ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Zero the KV cache (a new generation starts)."""
        kv = self.manifest.kv_cache
        if kv is not None:
            region = self.manifest.memory.regions["kv_cache"]
            self.dev.cuda.memset_d8_async(int(self.arena) + region.offset, 0, region.nbytes, self.dev.stream)
            self.dev.synchronize()

    def read_kv_cache(self) -> np.ndarray | None:
        """A host copy of the whole cache [layers, 2, max_batch, kv_heads, max_seq, head_dim] (tests, debugging)."""
        kv = self.manifest.kv_cache
        if kv is None:
            return None
        dt = np.dtype(kv.dtype)
        shape = (kv.layers, 2, kv.max_batch, kv.kv_heads, kv.max_seq, kv.head_dim)
        n = int(np.prod(shape)) * dt.itemsize
        return self.dev.download(self.arena, kv.offset, n).view(dt).reshape(shape)

    def write_kv_cache(self, cache: np.ndarray) -> None:
        """Overwrite the whole cache from a host array shaped like read_kv_cache()."""
        kv = self.manifest.kv_cache
        self.dev.upload(self.arena, kv.offset, np.ascontiguousarray(cache, dtype=np.dtype(kv.dtype)))
        self.dev.synchronize()

    def close(self) -> None:
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        for g in self.graphs.values():
            g.close()
        self.graphs.clear()
        if self.arena is not None:
            self.arena.free()
            self.arena = None

    # -- execution ------------------------------------------------------------------------------
    def schedule(self, entry: str, env: Mapping[str, int]) -> tuple[tuple, list[tuple]]:
        """(key, launches): the entry's launches [(kernel, grid, block, smem, args, node)] for the symbol values
        env, each node's tightest variant that covers them; key = (entry, bucket), shared by every env
        of one bucket (and by its captured graph)."""
        key = (entry, bucket_of(self.buckets[entry], env))
        launches = self.schedules.get(key)
        if launches is None:
            launches = [(*node_launch(n, env), n.name) for n in self.manifest.entries[entry].nodes if n.kernel]
            self.schedules[key] = launches
        return key, launches

    def _launch_all(self, launches: list[tuple]) -> None:
        for kernel, grid, block, smem, args, node in launches:
            self.kernels.launch(kernel, grid, block, smem, self.arena, node=node, args=args)

    def enqueue(self, entry: str) -> None:
        """Issue the entry's kernels for the symbol values of its latest write_inputs on the stream
        (replaying the graph captured for their bucket when graphs are enabled); the entry that call was
        routed to (bind_call) when it has a narrower twin."""
        entry = self.routed.get(entry, entry)
        key, launches = self.schedule(entry, self.last_env.get(entry, {}))
        if not self.cuda_graphs:
            self._launch_all(launches)
            return
        self._graph(key, launches).launch()

    def _staged(self, entry: str) -> bool:
        """Whether pipelined calls of `entry` (one with next_tokens, not the prefill) can stage through the
        staging kernels."""
        e = self.manifest.entries[entry]
        return self.staging is not None and entry != "prefill" and any(o.name == "next_tokens" for o in e.outputs)

    def _capacity(self, entry: str) -> int:
        """Bytes of a call's span that the staging kernel of `entry`'s graphs covers: its staged slots, at most
        staging.MAX_BYTES (a longer span goes through the copy engine)."""
        if entry not in self._capacities:  # worked out once: submit asks per call
            specs = self._slots(self.manifest.entries[entry])
            most = max(i.offset + i.nbytes for i in specs) - min(i.offset for i in specs) if specs else 0
            self._capacities[entry] = min(-(-most // 16) * 16, MAX_BYTES)
        return self._capacities[entry]

    def _record_staged(self, entry: str, launches: list[tuple], stage: _Stage) -> None:
        """Issue a call with its staging kernels: the span in, the launches, next_tokens out."""
        out = next(o for o in self.manifest.entries[entry].outputs if o.name == "next_tokens")
        self.staging.copy_in(self.arena, stage.host_in, blocks_for(self._capacity(entry)), self.dev.stream)
        self._launch_all(launches)
        self.staging.copy_out(stage.host_tokens, int(self.arena) + out.offset, stage.tokens.nbytes, self.dev.stream)

    def _staged_graph(self, key: tuple, launches: list[tuple], slot: int) -> CapturedGraph:
        """The graph of one (entry, bucket) between the staging kernels of pinned stage `slot` (the edges to and
        from them stay plain: they do not wait in pdl_enter)."""
        stage = self._stage(slot)
        return self._captured((*key, "staged", slot), lambda: self._record_staged(key[0], launches, stage), True)

    def _graph(self, key: tuple, launches: list[tuple]) -> CapturedGraph:
        """The CUDA graph of one (entry, bucket): captured, instantiated and uploaded on first use (load
        captures every one, so that no run allocates)."""
        return self._captured(key, lambda: self._launch_all(launches))

    def _captured(self, key: tuple, record, plain_ends: bool = False) -> CapturedGraph:
        """The graph under `key` in self.graphs, captured from `record` the first time: with programmatic edges
        while the driver takes them (a driver without them: plain ones from then on)."""
        graph = self.graphs.get(key)
        if graph is None:
            if self.pdl:
                try:
                    graph = CapturedGraph(self.dev.stream, record, programmatic=True, plain_ends=plain_ends)
                except CudaGraphError as e:
                    self.pdl, self.pdl_error = False, str(e)
            if graph is None:
                graph = CapturedGraph(self.dev.stream, record)
            self.graphs[key] = graph
        return graph

    def write_inputs(self, entry_name: str, inputs: Mapping[str, np.ndarray], symbols: Mapping[str, int],
                     stage: _Stage | None = None, skip: str = "") -> dict:
        """Bind and upload one call's inputs and symbols for `entry_name`, or for the narrower twin that
        serves the call (bind_call; enqueue then runs that one); returns the symbol values. With `stage`
        (submit) the bytes go through its pinned buffer, so the copies never wait for the stream: each input at
        its arena offset relative to the entry's first slot, and inputs in adjacent slots (plan_memory puts an
        entry's inputs side by side, smallest first, and the decode step's right after the dims buffer) go up
        in one copy, so a decode step's dims and inputs are one copy (two before: docs/perf.md v22). Input `skip`
        is not written (submit overwrites it on the device afterwards). With mapped staging, when the call's bytes
        are one span from the dims on that its graph's staging kernel covers (staging.mapped_span), no copy is
        issued: the span's header is written and stage.mapped set (submit then runs the staged graph)."""
        called = entry_name
        entry_name, env = bind_call(self.manifest, entry_name, inputs, symbols, self.bounds)
        self.routed[called] = entry_name
        entry = self.manifest.entries[entry_name]
        self.last_env[entry_name] = env
        dims = self.dims_host if stage is None else stage.dims
        dims[: len(self.symbols)] = [env.get(s, 0) for s in self.symbols]
        specs = [] if stage is None else self._slots(entry)
        if not specs or specs[0].name != DIMS:
            self.dev.cuda.memcpy_htod_async(int(self.arena) + self.manifest.memory.dims_offset, dims, self.dev.stream)
        if stage is None:
            for spec in entry.inputs:
                self.dev.upload(self.arena, spec.offset, np.ascontiguousarray(inputs[spec.name]))
            return env
        base = min((spec.offset for spec in specs), default=0)
        spans = self._stage_inputs(specs, {**inputs, DIMS: dims[: len(self.symbols)]}, stage.inputs, skip)
        nbytes = None
        if stage.raw is not None and specs and specs[0].name == DIMS and self._staged(entry_name):
            nbytes = mapped_span(spans, base, self._capacity(entry_name))
        stage.mapped = nbytes is not None
        if stage.mapped:
            write_header(stage.raw, nbytes, base)
            return env
        for start, end in spans:
            self.dev.cuda.memcpy_htod_async(int(self.arena) + start, stage.inputs[start - base: end - base],
                                            self.dev.stream)
        return env

    def _slots(self, entry) -> list:
        """_staged_specs(entry), worked out once per entry (a decode step's upload runs once per token)."""
        if entry.name not in self._specs:
            self._specs[entry.name] = self._staged_specs(entry)
        return self._specs[entry.name]

    def _staged_specs(self, entry) -> list:
        """The slots a staged upload of `entry` fills: its inputs, and first the dims buffer when the entry's
        inputs begin right after it (plan_memory places the decode step's there), so one copy sends both."""
        specs = list(entry.inputs)
        memory = self.manifest.memory
        dims_offset, unit = memory.dims_offset, memory.alignment
        slot = -(-8 * max(len(self.symbols), 1) // unit) * unit  # the dims buffer's slot (plan_memory)
        if specs and min(spec.offset for spec in specs) == dims_offset + slot:
            specs.insert(0, SimpleNamespace(name=DIMS, offset=dims_offset, nbytes=slot))
        return specs

    @staticmethod
    def _stage_inputs(slots, inputs: Mapping[str, np.ndarray], pinned: np.ndarray, skip: str) -> list[list[int]]:
        """Write the inputs of `slots` (specs with name, offset, nbytes: _staged_specs) into `pinned` (arena layout
        from the first slot on) and return the arena spans [start, end) to copy: one per run of adjacent slots, a
        run broken where the bytes between one input's end and the next slot would exceed COPY_GAP (an input far
        below its slot's upper bound)."""
        specs = sorted(slots, key=lambda spec: spec.offset)
        base = specs[0].offset if specs else 0
        spans: list[list[int]] = []
        slot_end = -1  # end of the last slot the open span covers (-1: no open span)
        for spec in specs:
            n = 0
            if spec.name != skip:
                raw = np.ascontiguousarray(inputs[spec.name]).view(np.uint8).reshape(-1)
                n = raw.size
                pinned[spec.offset - base: spec.offset - base + n] = raw
            if spec.offset == slot_end and (n == 0 or spec.offset - spans[-1][1] <= COPY_GAP):
                if n:  # the next slot, near enough: the open span grows over it
                    spans[-1][1] = spec.offset + n
                slot_end = spec.offset + spec.nbytes  # (a skipped slot is copied over, stale: skip says why)
            elif n:
                spans.append([spec.offset, spec.offset + n])
                slot_end = spec.offset + spec.nbytes
            else:
                slot_end = -1
        return spans

    # -- pipelined calls (runtime/generate.py's decode loop) ------------------------------------------
    def submit(self, entry_name: str, inputs: Mapping[str, np.ndarray], symbols: Mapping[str, int], *,
               tokens_from: int | None = None, tokens_to: str = "") -> int:
        """Enqueue one call of `entry_name` without waiting for it or for earlier ones; returns its slot for
        collect(). Its inputs and dims go through one of two pinned stages, in turn (the call two submits back,
        which used the same stage, is waited for first: collected already in generate's loop, so at once).
        With `tokens_from` (an arena offset: tokens_offset of the previous call), the input `tokens_to` is then
        overwritten on the device by the int64 tokens there, so the host need not have read them yet (no copy
        when the previous call was a decode step of the same entry: its next_tokens share the slot of the input
        ids, plan_memory tokens_slot_input). With mapped staging (ATLAS_MAPPED_STAGING=1, default; runtime/staging.py)
        the call runs in the graph that stages its inputs in and its tokens out itself (no copy engine: ~10 us less
        between steps, docs/perf.md v24), when its inputs fit (write_inputs). Otherwise its inputs go up in one copy
        and its next_tokens are copied back behind it: with ATLAS_COPY_STREAM=1 (default) on a second stream,
        which waits for the call's kernels, so that the copy runs beside the next call's input copy; the next
        call's kernels wait for it (they overwrite the tokens)."""
        slot = self._submitted % 2
        self._submitted += 1
        stage = self._stage(slot)
        if stage.used:
            stage.done.synchronize()
        env = self.write_inputs(entry_name, inputs, symbols, stage, skip=tokens_to if tokens_from is not None else "")
        self._after_copies()  # the previous call's tokens are read before these kernels rewrite them
        entry = self.manifest.entries[self.routed[entry_name]]
        if tokens_from is not None:
            spec = next(i for i in entry.inputs if i.name == tokens_to)
            nbytes = np.asarray(inputs[tokens_to]).nbytes
            if spec.offset != tokens_from:  # the same slot (plan_memory tokens_slot_input): the tokens are there
                self.dev.cuda.memcpy_dtod_async(int(self.arena) + spec.offset, int(self.arena) + tokens_from,
                                                nbytes, self.dev.stream)
        out = next(o for o in entry.outputs if o.name == "next_tokens")
        stage.count = int(np.prod(output_shape(out, env), dtype=np.int64))
        stage.used = True
        self._submitted_stage = stage
        if stage.mapped:
            self.mapped_calls += 1
            key, launches = self.schedule(entry.name, env)
            if self.cuda_graphs:
                self._staged_graph(key, launches, slot).launch()
            else:
                self._record_staged(entry.name, launches, stage)
            stage.done.record(self.dev.stream)
            return slot
        self.enqueue(entry_name)
        copy = self.dev.stream
        if self._copy_stream is not None:
            stage.ran.record(self.dev.stream)
            copy = self._copy_stream
            copy.wait_for_event(stage.ran)
        self.dev.cuda.memcpy_dtoh_async(stage.tokens[: stage.count], int(self.arena) + out.offset, copy)
        stage.done.record(copy)
        return slot

    def _after_copies(self) -> None:
        """With the copy stream: make the stream wait for the latest submitted call's copy back (and so for every
        earlier one: the copy stream runs them in order) before kernels that may rewrite its tokens."""
        latest = self._submitted_stage
        if self._copy_stream is not None and latest is not None and not latest.mapped:
            self.dev.stream.wait_for_event(latest.done)

    def collect(self, slot: int) -> np.ndarray:
        """The next_tokens of the call submitted in `slot`, once it has run (waits for it)."""
        stage = self._stages[slot]
        stage.done.synchronize()
        return stage.tokens[: stage.count].copy()

    def tokens_offset(self, entry_name: str) -> int:
        """Arena offset of next_tokens of the entry that served the latest call of `entry_name`."""
        entry = self.manifest.entries[self.routed.get(entry_name, entry_name)]
        return next(o.offset for o in entry.outputs if o.name == "next_tokens")

    def _stage(self, slot: int) -> _Stage:
        stage = self._stages.get(slot)
        if stage is None:  # pinned host memory for the largest call of any entry: its input slots (write_inputs)
            def slots_bytes(entry) -> int:
                specs = self._slots(entry)
                return max(i.offset + i.nbytes for i in specs) - min(i.offset for i in specs) if specs else 0

            most = max(slots_bytes(e) for e in self.manifest.entries.values())
            batch = self.manifest.kv_cache.max_batch if self.manifest.kv_cache is not None else 1
            cuda = self.dev.cuda
            dims = cuda.pagelocked_zeros(max(len(self.symbols), 1), np.int64)
            tokens = -(-max(batch, 1) // 2) * 2  # whole 16-byte words (staging.copy_out)
            if self.staging is None:
                stage = _Stage(cuda.pagelocked_zeros(max(most, 16), np.uint8), dims,
                               cuda.pagelocked_zeros(tokens, np.int64), cuda.Event(), cuda.Event())
            else:  # mapped; atlas_stage_in's block 0 reads BLOCK words whatever the span
                mapped = cuda.host_alloc_flags.DEVICEMAP
                raw = cuda.pagelocked_zeros(HEADER + max(-(-most // 16) * 16, 16 * BLOCK), np.uint8, mem_flags=mapped)
                out = cuda.pagelocked_zeros(tokens, np.int64, mem_flags=mapped)
                stage = _Stage(raw[HEADER:], dims, out, cuda.Event(), cuda.Event(), raw=raw,
                               host_in=int(raw.base.get_device_pointer()),
                               host_tokens=int(out.base.get_device_pointer()))
            self._stages[slot] = stage
        return stage

    def run(self, entry_name: str, inputs: Mapping[str, np.ndarray], symbols: Mapping[str, int] | None = None,
            outputs: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
        """Execute one entry point; returns its outputs by name (only `outputs` if given: less to copy back)."""
        env = self.write_inputs(entry_name, inputs, symbols or {})
        self._after_copies()
        self.enqueue(entry_name)
        out = {}
        for spec in self.manifest.entries[self.routed.get(entry_name, entry_name)].outputs:
            if outputs is not None and spec.name not in outputs:
                continue
            shape = output_shape(spec, env)
            dt = np.dtype(spec.dtype)
            n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            out[spec.name] = self.dev.download(self.arena, spec.offset, n).view(dt).reshape(shape)
        return out
