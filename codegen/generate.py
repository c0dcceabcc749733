"""Generate one CUDA translation unit for a compiled model.

For every node of every entry point, a kernel family (one Python module + one `.cu` template per
family, registered in `EMITTERS`) writes an `extern "C" __global__` wrapper that binds the node's
tensors to arena addresses and calls the family's device code. The wrapper's argument is the arena
base pointer (and, for a kernel shared by nodes that differ only in their tensors' offsets, such as a
model's layers, those offsets: codegen/share.py); shapes are C expressions over the dims buffer, so one
kernel serves every run-time size within the compile-time maxima.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from atlasc.artifact import TENSOR_MAP_BYTES, TensorMapSpec
from atlasc.codegen.cexpr import c_dim, c_type, comment_text
from atlasc.codegen.share import Shared, share_batch1, share_choice, share_kernels
from atlasc.ir.dtypes import itemsize
from atlasc.errors import AtlasError, env_switch
from atlasc.ir import symbolic as S
from atlasc.ir.archs import MAX_SMEM_PER_BLOCK
from atlasc.ir.graph import Graph, Node, Value
from atlasc.ir.memory import MemoryPlan, align

HERE = Path(__file__).resolve().parent
MAX_GRID = 65535  # grid-stride loops make any grid correct; this caps idle blocks for huge maxima
# Grids sized by compile-time maxima are mostly idle blocks when the run is far below them (a 128-token
# prefill of an artifact compiled for 32 x 4352 tokens): a 65535-block grid of which 64K blocks only
# exit costs ~0.5 ms per kernel on an H200. Kernels whose work scales with the run-time size (every
# elementwise, row, attention, sampling and prefill-GEMM grid) stop at STRIDE_GRID blocks, about four
# waves of 256-thread blocks on 132 SMs, and loop (grid-stride) over the rest.
STRIDE_GRID = 4096
# weight_prefetch: bytes of one weight a kernel asks L2 to fetch before its pdl_enter (a third of the
# H200's 50 MB L2, so that they are still there when the kernel's loads reach them)
PREFETCH_BUDGET = 16 << 20
PREFETCH_MIN_ROW = 1024  # a big weight prefetches this much of each of its first rows rather than less of all
PREFETCH_ENV = "ATLAS_PREFETCH"
# DIMS_EARLY: a kernel reads the symbol values it uses (the dims buffer: d[i]) into registers before its
# atlas::pdl_enter, so the first loads after the wait need no dims round trip first. Safe because the dims are
# written only before a call's first kernel starts: by the host's copy, stream-ordered before the launches, or by
# the staging kernel, the graph's first node, whose edge out stays plain (runtime/cudagraph.py make_programmatic),
# and every later kernel is launched only after an earlier one has started; no kernel writes them. The
# early-weights kernels (linear.py early_pro) already read theirs before their wait, in source order. H200, the
# decode step replayed alone at 256 keys (docs/perf.md v39): Llama-3.2-1B fp16 batch 1 818.5 -> 811.1 us, 8 layers
# of Llama-3-8B fp16 1252.6 -> 1247.2 (batch 1) and 1521.2 -> 1513.6 (batch 32), int4 flat (+0.07 / +0.17%).
DIMS_EARLY = True
DIMS_EARLY_ENV = "ATLAS_DIMS_EARLY"  # overrides DIMS_EARLY (0 / 1, A/B timing)
# the scratch's counters, shared by every kernel (GeneratedModule): room for 16384 (an attention split's items,
# a K-split Linear's feature blocks, a looping copy-engine kernel's claims)
COUNTER_BYTES = 64 << 10


class CodegenError(AtlasError):
    """A node cannot be lowered to CUDA (no kernel for its op, or an unsupported variant)."""


@dataclass(frozen=True)
class Variant:
    """The launch for runs whose bucket symbol is at most `upto`: its kernel was generated with that
    symbol's maximum set to `upto` (so it holds only the code paths such runs reach, with the registers
    and grid they need)."""

    upto: int
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int = 0
    args: tuple[int, ...] = ()  # as Launch.args


@dataclass(frozen=True)
class Launch:
    """One kernel launch of an entry point's schedule (the default, valid for every run-time size),
    with its `variants` for smaller values of the entry's bucket `symbol`, tightest first."""

    node: str
    op: str
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int = 0
    symbol: str = ""
    variants: tuple[Variant, ...] = ()
    args: tuple[int, ...] = ()  # the arena offsets a kernel shared by several nodes takes (codegen/share.py)
    co_resident: bool = False  # every block resident at once (a chain: codegen/quant_chain.py; NodeSpec.co_resident)


@dataclass
class KernelCode:
    """What a family emitter returns for one node."""

    body: str  # statements inside the wrapper, after the tensor bindings
    grid: tuple[int, int, int]
    block: tuple[int, int, int] = (256, 1, 1)
    smem: int = 0
    preamble: str = ""  # namespace-scope code (functors) emitted before the wrapper
    scratch: int = 0  # bytes of work space the kernel uses from ctx.scratch_address(0) on (see GeneratedModule)
    counters: int = 0  # unsigned int counters it uses from ctx.counters_address() on (left at 0)
    # statements before atlas::pdl_enter: they may read only constants (weight_prefetch), or what an earlier step
    # wrote, for a hint that cannot change a result (attention.py's early K / V prefetch)
    prefetch: str = ""
    choice: dict | None = None  # a per-kernel choice worth recording (the report's codegen `kernels`)
    min_blocks: int = 0  # > 0: __launch_bounds__'s blocks per SM (caps the registers per thread for them)
    # the body calls atlas::pdl_enter itself (linear.cu LinPro: after its first weight loads), before any read of
    # what an earlier kernel wrote: the wrapper leaves its own out
    waits_inside: bool = False
    trigger_early: bool = False  # the wrapper lets the next kernel launch right after the wait (pdl_leave)
    dims_late: bool = False  # the dims stay behind the buffer's pointer, read after the wait (DIMS_EARLY's exception)



class TensorMapTable:
    """The copy engine's tensor maps (atlasc.artifact.TensorMapSpec: the runtime encodes each at load into its 128-byte
    slot) of one generated module, in `capacity` slots from arena offset `base` (fixed before any
    kernel is emitted, so that a kernel's code names its maps' offsets like any tensor's: codegen/share.py). The
    same matrix read in the same boxes gets one slot."""

    def __init__(self, base: int, capacity: int):
        self.base, self.capacity = base, capacity
        self.maps: dict[tuple, TensorMapSpec] = {}

    def slot(self, address: int, rows: int, cols: int, row_bytes: int, box_rows: int, dtype: str = "float16") -> int:
        """The arena offset of the map of a `dtype` matrix (float16: read with the 128-byte swizzle, linear_tma.cu;
        uint8: int4 / int8 weight bytes, no swizzle, quant_bulk.cu) in boxes of box_rows rows x 64 elements."""
        key = (address, rows, cols, row_bytes, box_rows, dtype)
        if key not in self.maps:
            if len(self.maps) >= self.capacity:
                raise CodegenError(f"more than the {self.capacity} tensor maps reserved")
            self.maps[key] = TensorMapSpec(self.base + TENSOR_MAP_BYTES * len(self.maps), address, rows, cols,
                                           row_bytes, box_rows, 64, dtype)
        return self.maps[key].slot


@dataclass
class GeneratedModule:
    """The translation unit and launches. Kernels may use a scratch region after every plan's arena
    (`scratch_offset`, `scratch_bytes`): whoever allocates the arena makes it `arena_bytes` long and
    zeroes the scratch once before the first launch. Its first COUNTER_BYTES are counters
    (KernelContext.counters_address), which every kernel leaves at 0; the rest is work space
    (scratch_address), which kernels leave as they please: kept apart, one kernel's partial sums never
    land on another kernel's counters. Launches are serialized on one stream, so every kernel may use
    all of it."""

    source: str  # the whole translation unit: prelude + every kernel
    launches: dict[str, list[Launch]] = field(default_factory=dict)
    prelude: str = ""  # shared definitions (common.cuh and the family templates)
    kernels: list[str] = field(default_factory=list)  # one `extern "C"` wrapper per node, in source order
    scratch_offset: int = 0
    scratch_bytes: int = 0
    arena_bytes: int = 0  # the plans' arena plus the scratch
    choices: dict = field(default_factory=dict)  # the kernel paths chosen (codegen_choices), for the artifact
    tensor_maps: list[TensorMapSpec] = field(default_factory=list)  # what the runtime writes at load
    tensor_map_region: tuple[int, int] = (0, 0)  # (offset, bytes) of their slots in the arena (none: 0 bytes)


class KernelContext:
    """Per-node helpers for emitters: C expressions for dims and tensor views bound to the arena."""

    def __init__(self, node: Node, plan: MemoryPlan, upper: dict[str, int], kernel: str, kv_cache: dict | None,
                 scratch_offset: int | None = None, lower: dict[str, int] | None = None,
                 archs: tuple[str, ...] = (), tensor_maps: TensorMapTable | None = None,
                 bulk_ops: frozenset[str] = frozenset()):
        self.scratch_offset = align(plan.arena_bytes) if scratch_offset is None else scratch_offset
        self.archs = archs  # the compile's target archs (() = unknown: the H200's limits)
        self.tensor_maps = tensor_maps  # None: no room reserved (a kernel may not use the copy engine's maps)
        # the projection ops (LinearQ4 / LinearQ8) whose batch-1 kernels choose-decode-path gave the copy-engine path
        # (codegen/quant_bulk.py serves)
        self.bulk_ops = bulk_ops
        self.chain_phase = None  # quant_chain.ChainPhase: emit the node as a chain's phase (quant_bulk.emit)
        self.node = node
        self.plan = plan
        self.upper_bounds = upper
        # symbols the runtime only runs this kernel above (a batch bucket's kernel runs for batches above the
        # next smaller bucket): grid sizing may leave out paths only smaller values take (any grid is correct)
        self.lower_bounds = lower or {}
        self.kernel = kernel
        self.kv_cache = kv_cache
        self.symbol_index = {s: i for i, s in enumerate(plan.symbols)}
        self.lines: list[str] = []

    def dim(self, d) -> str:
        """C expression of dim d."""
        return c_dim(d, self.symbol_index)

    def upper(self, d) -> int:
        """Compile-time upper bound of dim d (symbols at their maxima)."""
        return max(S.evaluate(d, self.upper_bounds), 0)

    def lower(self, d) -> int:
        """Dim d with the symbols at the values this kernel runs above (0 where none is known)."""
        return max(S.evaluate(d, {**{s: 0 for s in self.upper_bounds}, **self.lower_bounds}), 0)

    def numel_upper(self, value: Value) -> int:
        n = 1
        for d in value.shape:
            n *= self.upper(d)
        return n

    def address(self, value: Value) -> str:
        return f"arena + {self.plan.placement(value).offset}LL"

    def tensor_map_address(self, value: Value, rows: int, box_rows: int, dtype: str = "") -> str:
        """C address of the tensor map (TensorMapTable) of value, a contiguous float16 matrix (or one of bytes, dtype
        "uint8": packed int4 or int8 codes) whose last dim is its columns, read as `rows` rows (its leading dims
        flattened, at their maxima) in boxes of box_rows rows."""
        cols = self.upper(value.shape[-1])
        slot = self.tensor_maps.slot(self.plan.placement(value).offset, rows, cols, cols * itemsize(value.dtype),
                                     box_rows, dtype or value.dtype)
        return f"arena + {slot}LL"

    def scratch_address(self, offset: int) -> str:
        """C address of byte `offset` of the scratch's work space (KernelCode.scratch says how many are used)."""
        return f"arena + {self.scratch_offset + COUNTER_BYTES + offset}LL"

    def counters_address(self) -> str:
        """C address of the scratch's counters (KernelCode.counters says how many are used; at 0 between
        launches)."""
        return f"arena + {self.scratch_offset}LL"

    def view(self, value: Value, name: str, rank: int | None = None) -> str:
        """Declare `atlas::View<T, R> name` for value (rank-0 values become [1]); returns the name."""
        shape = list(value.shape) or [1]
        r = len(shape)
        if rank is not None and rank != r:
            raise CodegenError(f"{self.node.name}: expected rank {rank} for {value.name}, got {r}")
        t = c_type(value.dtype)
        placement = self.plan.placement(value)
        dims = [self.dim(x) for x in shape]
        if placement.strides is None:
            strides = ["1LL"] * r
            for i in range(r - 2, -1, -1):
                strides[i] = f"{name}.shape[{i + 1}] * {name}.stride[{i + 1}]"
        else:
            strides = [self.dim(x) for x in (list(placement.strides) or [1])]
        self.lines.append(f"  atlas::View<{t}, {r}> {name};")
        self.lines.append(f"  {name}.p = reinterpret_cast<{t}*>({self.address(value)});")
        for i, x in enumerate(dims):
            self.lines.append(f"  {name}.shape[{i}] = {x};")
        for i in range(r - 1, -1, -1):
            self.lines.append(f"  {name}.stride[{i}] = {strides[i]};")
        return name

    def grid_for(self, work_items: int, block: int = 256) -> tuple[int, int, int]:
        blocks = max(1, min(STRIDE_GRID, (work_items + block - 1) // block))
        return (blocks, 1, 1)


Emitter = Callable[[KernelContext, Node], KernelCode]
EMITTERS: dict[str, Emitter] = {}


def emitter(*ops: str):
    """Register a family function as the emitter of `ops`."""

    def deco(fn: Emitter) -> Emitter:
        for op in ops:
            if op in EMITTERS:
                raise ValueError(f"two emitters for {op}")
            EMITTERS[op] = fn
        return fn

    return deco


def _load_families() -> list[str]:
    """Import every family module (registering its emitters); return their .cu templates' text."""
    from atlasc.codegen import families

    return [(HERE / f"{name}.cu").read_text() for name in families.TEMPLATES]


def check_shared_memory(module: GeneratedModule, archs: tuple[str, ...],
                        cubins: dict[str, list[bytes]] | None = None) -> None:
    """CodegenError (one line) naming the first launch whose shared memory no block of one of `archs` can
    have (atlasc/ir/archs.py MAX_SMEM_PER_BLOCK): the launch would fail on that GPU. Before nvcc (cubins
    None) it counts the launch's dynamic bytes; with an arch's cubins also each kernel's static arrays as
    ptxas laid them out (codegen/cubin.py static_shared_bytes)."""
    from atlasc.codegen.cubin import static_shared_bytes

    for arch in archs:
        most = MAX_SMEM_PER_BLOCK[arch]
        static: dict[str, int] = {}
        for part in (cubins or {}).get(arch, []):
            static.update(static_shared_bytes(part))
        for entry, launches in module.launches.items():
            for launch in launches:
                for kernel, smem in [(launch.kernel, launch.smem), *((v.kernel, v.smem) for v in launch.variants)]:
                    fixed = static.get(kernel, 0)
                    if smem + fixed > most:
                        parts = f" ({smem} dynamic + {fixed} static)" if fixed else ""
                        raise CodegenError(f"{entry} node {launch.node} ({launch.op}, kernel {kernel}) needs "
                                           f"{smem + fixed} bytes of shared memory per block{parts}; {arch} allows "
                                           f"{most}", hint=f"compile without {arch} in --arch")


def generate_module(entries: dict[str, tuple[Graph, MemoryPlan]], upper: dict[str, dict[str, int]],
                    kv_cache: dict | None = None,
                    buckets: dict[str, tuple[str, tuple[int, ...]]] | None = None,
                    archs: tuple[str, ...] = (), lower: dict[str, dict[str, int]] | None = None,
                    decode_steps: dict[str, str] | None = None,
                    bulk_ops: frozenset[str] = frozenset()) -> GeneratedModule:
    """CUDA source for every node of every entry, and each entry's launch list in schedule order.

    `upper[entry]` gives each symbol's compile-time maximum for that entry (grid sizing); `archs` the target
    archs, whose per-block shared memory limits some emitters' tile choices respect.
    `buckets[entry] = (symbol, values)` also generates each node with the symbol's maximum set to each
    value below the entry's (e.g. the decode batch at 1 and 8 of 32): where that changes the kernel, a
    Variant with its own kernel; where only the grid changes, a Variant reusing the default kernel.
    `lower[entry]` gives symbol values the entry runs only above (split-decode's `decode`, whose batches up
    to 8 run `decode_small`): its kernels may leave out what only those runs would need (KernelContext.lower).
    `decode_steps[entry]` names a decode step's batch symbol: its kernels generated for a batch of at most 1
    keep one kernel per node (codegen/share.py says why).
    `bulk_ops`: the projection ops whose batch-1 decode kernels choose-decode-path gave the copy-engine path
    (Program.decode_paths, atlasc/compiler.py bulk_ops); quant_bulk.py serves them unless ATLAS_QUANT_BULK=0.
    Guarantees: deterministic text for the same inputs; one `extern "C"` kernel per node and distinct
    variant, except reshapes the plan aliased to their input (`plan.aliases`), which need none, and nodes
    whose kernels differ only in arena offsets, which share one (codegen/share.py, Launch.args).
    """
    from atlasc.codegen import quant

    templates = _load_families()
    prelude = "\n".join(["// generated by atlasc: do not edit", *quant.prelude_defines(),
                         (HERE / "common.cuh").read_text(), *templates])
    parts: list[tuple[str, str, str]] = []  # (kernel, node, text)
    alone: set[str] = set()  # kernels never shared: a decode step's for one row (unless ATLAS_SHARE_KERNELS=all)
    launches: dict[str, list[Launch]] = {}
    unsupported = sorted({n.op for g, _ in entries.values() for n in g.nodes if n.op not in EMITTERS})
    if unsupported:
        raise CodegenError(f"no CUDA kernel for op(s): {', '.join(unsupported)}")
    arena_end = align(max((plan.arena_bytes for _, plan in entries.values()), default=0))
    from atlasc.codegen import linear_tma, quant_bulk

    map_slots = (linear_tma.map_capacity(entries, buckets, archs)
                 + quant_bulk.map_capacity(entries, buckets, archs, bulk_ops))
    tensor_maps = TensorMapTable(arena_end, map_slots) if map_slots else None
    scratch_offset = align(arena_end + TENSOR_MAP_BYTES * map_slots)
    scratch_bytes = 0
    kernel_choices: dict[str, dict] = {}
    for entry, (graph, plan) in entries.items():
        launches[entry] = []
        for index, node in enumerate(graph.nodes):
            if not plan.needs_kernel(node):
                continue  # a reshape sharing its input's bytes: nothing to run
            kernel = f"{entry}_{index:04d}_{node.op}"
            symbol, values = (buckets or {}).get(entry, ("", ()))
            smaller = sorted(v for v in set(values) if v < upper[entry].get(symbol, 0))

            def above(value: int) -> dict[str, int]:  # the runtime takes the tightest bucket: this one only above
                below = [v for v in smaller if v < value]
                runs_above = dict((lower or {}).get(entry, {}))
                if below:
                    runs_above[symbol] = max(below[-1], runs_above.get(symbol, 0))
                return runs_above

            ctx = KernelContext(node, plan, upper[entry], kernel, kv_cache, scratch_offset,
                                above(upper[entry].get(symbol, 0)), archs, tensor_maps, bulk_ops)
            code = EMITTERS[node.op](ctx, node)
            scratch_bytes = max(scratch_bytes, _scratch_need(node, code))
            if code.choice:
                kernel_choices[kernel] = code.choice
            text = _wrapper(ctx, node, code)
            parts.append((kernel, node.name, text))
            step_batch = None if share_batch1() else (decode_steps or {}).get(entry)
            if step_batch and upper[entry].get(step_batch, 0) <= 1:
                alone.add(kernel)
            variants = []
            for value in smaller:
                name = f"{kernel}_{symbol}{value}"
                vctx = KernelContext(node, plan, {**upper[entry], symbol: value}, name, kv_cache, scratch_offset,
                                     above(value), archs, tensor_maps, bulk_ops)
                vcode = EMITTERS[node.op](vctx, node)
                scratch_bytes = max(scratch_bytes, _scratch_need(node, vcode))
                vtext = _wrapper(vctx, node, vcode)
                geometry = (vcode.grid, vcode.block, vcode.smem)
                if vtext.replace(name, kernel) == text:
                    if geometry != (code.grid, code.block, code.smem):  # same code, a smaller grid
                        variants.append(Variant(value, kernel, *geometry))
                    continue
                parts.append((name, node.name, vtext))
                if vcode.choice:  # a kernel of its own: its choices too (e.g. the batch-1 copy-engine projections)
                    kernel_choices[name] = vcode.choice
                if step_batch and step_batch == symbol and value <= 1:
                    alone.add(name)
                variants.append(Variant(value, name, *geometry))
            launches[entry].append(Launch(node.name, node.op, kernel, code.grid, code.block, code.smem,
                                          symbol if variants else "", tuple(variants)))
        batch = (decode_steps or {}).get(entry)
        if batch and upper[entry].get(batch, 0) <= 1:  # a step of one row: its default kernels are batch-1 ones
            chains = _chain(entry, graph, plan, upper[entry], launches[entry], parts, kernel_choices, kv_cache,
                            scratch_offset, lower, archs, tensor_maps, bulk_ops)
            scratch_bytes = max([scratch_bytes, *chains])
    scratch_bytes = align(scratch_bytes)
    texts, shared = share_kernels(parts, alone)
    launches = {entry: [_shared_launch(launch, shared) for launch in entry_launches]
                for entry, entry_launches in launches.items()}
    choices = {**codegen_choices(), "batch_buckets": {e: [s, sorted(v)] for e, (s, v) in (buckets or {}).items()}}
    kernel_choices = {k: c for k, c in kernel_choices.items() if shared[k].kernel == k}
    if kernel_choices:
        choices["kernels"] = kernel_choices
    maps = list(tensor_maps.maps.values()) if tensor_maps else []
    if maps:
        choices["tensor_maps"] = len(maps)
    return GeneratedModule("\n".join([prelude, *texts]) + "\n", launches, prelude, texts, scratch_offset,
                           scratch_bytes, scratch_offset + scratch_bytes, choices, maps,
                           (arena_end, TENSOR_MAP_BYTES * map_slots) if maps else (0, 0))


def _chain(entry: str, graph: Graph, plan: MemoryPlan, upper: dict[str, int], launches: list[Launch],
           parts: list[tuple[str, str, str]], kernel_choices: dict, kv_cache, scratch_offset: int, lower, archs,
           tensor_maps, bulk_ops) -> list[int]:
    """ATLAS_QUANT_BULK_CHAIN (codegen/quant_chain.py): each run of the entry's launches that may form a chain becomes
    one launch of a chain kernel (named after its first node's, its wrapper replacing that kernel's text in `parts`)
    and launches of no kernel ("") for the others, whose texts and choices go. Edits launches, parts and
    kernel_choices in place; returns the scratch bytes each chain needs."""
    from atlasc.codegen import quant_bulk, quant_chain

    if not quant_chain.chain_choice():
        return []
    nodes = {n.name: n for n in graph.nodes}
    needs = []
    for run in quant_chain.chain_runs([(launch.kernel, kernel_choices.get(launch.kernel)) for launch in launches]):
        members = [launches[i] for i in run]
        if any(launch.variants or launch.args for launch in members):  # a step of one row has neither
            raise CodegenError(f"{entry}: a chain's launches may not have variants or shared-kernel offsets")
        plain = [kernel_choices[launch.kernel] for launch in members]
        codes = [_plain_code(launch, choice) for launch, choice in zip(members, plain)]
        stages = quant_chain.ring_stages(codes, quant_bulk.SMEM_LIMIT)
        if not stages:
            continue
        warps = quant_chain.block_warps(codes)
        head = members[0].kernel
        phases = []
        for j, launch in enumerate(members):
            node = nodes[launch.node]
            ctx = KernelContext(node, plan, upper, head, kv_cache, scratch_offset, (lower or {}).get(entry, {}),
                                archs, tensor_maps, bulk_ops)
            ctx.chain_phase = quant_chain.ChainPhase(j == 0, j == len(members) - 1, stages, warps)
            code = EMITTERS[node.op](ctx, node)
            phases.append(replace(code, body="\n".join([*ctx.lines, code.body])))
        head_ctx = KernelContext(nodes[members[0].node], plan, upper, head, kv_cache, scratch_offset,
                                 (lower or {}).get(entry, {}), archs, tensor_maps, bulk_ops)
        code = quant_chain.assemble([launch.node for launch in members], phases, stages,
                                    head_ctx.counters_address(), quant_bulk.SMS, plain)
        needs.append(_scratch_need(nodes[members[0].node], code))
        text = _wrapper(head_ctx, nodes[members[0].node], code)
        gone = {launch.kernel for launch in members[1:]}
        parts[:] = [(k, n, text if k == head else t) for k, n, t in parts if k not in gone]
        for k in gone:
            kernel_choices.pop(k, None)
        kernel_choices[head] = code.choice
        for j, i in enumerate(run):
            launches[i] = (replace(launches[i], grid=code.grid, block=code.block, smem=code.smem, co_resident=True)
                           if j == 0 else Launch(launches[i].node, launches[i].op, "", (1, 1, 1), (1, 1, 1)))
    return needs


def _plain_code(launch: Launch, choice: dict) -> KernelCode:
    """The geometry and choice of a launch's kernel as quant_chain.ring_stages reads them (smem, config)."""
    return KernelCode("", launch.grid, launch.block, smem=launch.smem, choice=choice)


def _shared_launch(launch: Launch, shared: dict[str, Shared]) -> Launch:
    """The launch with each kernel name replaced by the kernel that serves it and the offsets it passes."""
    if not launch.kernel:  # a chain's later node: nothing to launch
        return launch
    variants = tuple(replace(v, kernel=shared[v.kernel].kernel, args=shared[v.kernel].args) for v in launch.variants)
    return replace(launch, kernel=shared[launch.kernel].kernel, args=shared[launch.kernel].args, variants=variants)


def prefetch_budget() -> int:
    """ATLAS_PREFETCH: bytes of each weight the projection kernels prefetch (weight_prefetch); 0 (default, or
    "0"): off, "1": PREFETCH_BUDGET, "<n>mb" (1 <= n <= 48): n MB. Off by default: on the H200 it made
    Llama-3.2-1B decode 6-12% slower with plain graphs and did not make up for the programmatic launch's own
    cost (docs/perf.md v9, kernels triggering their dependents right after their wait)."""
    value = (os.environ.get(PREFETCH_ENV, "") or "0").lower()
    if value in ("0", "1"):
        return PREFETCH_BUDGET if value == "1" else 0
    mb = value[:-2] if value.endswith("mb") else ""
    if not mb.isdigit() or not 1 <= int(mb) <= 48:
        raise CodegenError(f"{PREFETCH_ENV}={value!r} is not 0, 1 or a budget of 1mb .. 48mb per weight")
    return int(mb) << 20


def prefetch_enabled() -> bool:
    """Whether ATLAS_PREFETCH turns the weight prefetch on (prefetch_budget)."""
    return prefetch_budget() > 0


def weight_prefetch(ctx: "KernelContext", *weights: Value | None) -> str:
    """The KernelCode.prefetch statement for a projection's constant 2-D weights [rows, ...] (None and
    non-constant ones skipped; row bytes from the static shape and dtype). For each array: the first
    min(row_bytes, max(budget / rows, PREFETCH_MIN_ROW)) bytes of each of its first rows, at
    most budget bytes in all (prefetch_budget) (atlas::prefetch_rows_l2, sm90+). Decode projections read their
    weight rows from k = 0 up, all rows of a wave at once, so the first bytes of the first rows are what
    the kernel waits for first. Empty when disabled, for symbolic shapes, or rows not 16-byte aligned."""
    budget = prefetch_budget()
    if not budget:
        return ""
    lines = []
    for value in weights:
        if value is None or not value.is_constant or len(value.shape) != 2 or \
                not all(isinstance(d, int) for d in value.shape):
            continue
        rows, row_bytes = value.shape[0], value.shape[1] * itemsize(value.dtype)
        if row_bytes % 16 or ctx.plan.placement(value).offset % 16 or rows <= 0:
            continue
        per_row = min(row_bytes, max(budget // rows, PREFETCH_MIN_ROW)) // 16 * 16
        count = min(rows, budget // per_row)
        lines.append(f"  atlas::prefetch_rows_l2({ctx.address(value)}, {row_bytes}LL, {per_row}u, {count});")
    return "\n".join(lines)


def _scratch_need(node: Node, code: KernelCode) -> int:
    """Scratch bytes a kernel needs: the counters' area and its work space (0 when it uses neither)."""
    if code.counters > COUNTER_BYTES // 4:
        raise CodegenError(f"{node.name}: {code.counters} scratch counters, more than the {COUNTER_BYTES // 4} "
                           f"there is room for")
    return COUNTER_BYTES + code.scratch if code.scratch or code.counters else 0


def codegen_choices() -> dict:
    """The kernel paths this generation uses (defaults or ATLAS_*_PATH overrides): recorded in the
    artifact's report, so an artifact says which measured choices built it (docs/perf.md, docs/cli.md)."""
    from atlasc.codegen import (attention, flash_attention, gemm, linear, linear_prologue, linear_tma, quant,
                                quant_bulk, quant_chain, reduce, sampling)

    return {"linear_path": linear.path_choice(), "linear_ft": linear.ft_choice(),
            "linear_ksplit": linear.ks_choice(),
            "quant_path": quant.path_choice(), "quant_ksplit": quant.ks_choice(), "quant_ofs": quant.ofs_choice(),
            "quant_min_blocks": quant.min_blocks_choice(), "quant_staged_u": quant.staged_u_choice(),
            "prologue_act8_grid": linear_prologue.act8_grid_choice(),
            "attention_path": attention.path_choice(), "attention_max_split": attention.split_max(),
            "attention_split_min_keys": attention.split_min_keys(),
            "attention_split_target": attention.target_setting(), "attention_v_prefetch": attention.v_prefetch(),
            "attention_early_kv": attention.early_kv_setting(), "norm_vec": reduce.norm_vec_choice(),
            "norm_loads_ahead": linear_prologue.norm_ahead_choice(),
            "attention_mma": attention.mma_setting(),
            "attention_warps": attention.warps_setting(), "attention_warp_merge": attention.warp_merge(),
            # every kernel waits (atlas::pdl_enter, common.cuh) before it reads what an earlier kernel wrote: first
            # (after its dims loads and prefetch, if any), or with early weights after its first weight loads (linear.cu
            # LinPro)
            "pdl_wait": True,
            # ... and ends with atlas::pdl_leave (v9; before: right after the wait); with early_weights 2 the batch-1
            # projections and the decode attention also trigger earlier (linear.py)
            "pdl_trigger": "end",
            "early_weights": linear.early_mode(),  # ATLAS_EARLY_WEIGHTS (linear.py): loads before the wait
            "early_quant": linear.early_quant(),  # ATLAS_EARLY_QUANT: the same for quantized projections (opt-in)
            "sample_split": sampling.split_setting(),  # ATLAS_SAMPLE_SPLIT (sampling.py)
            "weight_prefetch": prefetch_enabled(),
            "weight_prefetch_mb": prefetch_budget() >> 20,
            "share_kernels": share_choice(),
            "dims_early": dims_early_choice(),  # ATLAS_DIMS_EARLY: the dims read before the wait
            "int8_l2_hint": quant.l2_hint(),  # ATLAS_INT8_L2_HINT (quant.py): int8 weight loads with L2::256B
            "linear_tma": linear_tma.tma_choice(),  # ATLAS_LINEAR_TMA (linear_tma.py; sm90-only compiles)
            "linear_tma_config": linear_tma.config_choice(),  # ATLAS_LINEAR_TMA_PLAIN / _GATED / _HEADS
            **quant_bulk.record(),  # ATLAS_QUANT_BULK (quant_bulk.py; sm90-only compiles, auto|0|1)
            "quant_bulk_chain": quant_chain.chain_choice(),  # ATLAS_QUANT_BULK_CHAIN (quant_chain.py)
            **flash_attention.record(),  # ATLAS_ATTENTION_PREFILL (fa2 by default)
            **gemm.record()}  # ATLAS_LINEAR_PREFILL=tc only


def dims_early_choice() -> bool:
    """ATLAS_DIMS_EARLY (default DIMS_EARLY); CodegenError unless 0 or 1. Recorded in the artifact's codegen choices."""
    return env_switch(DIMS_EARLY_ENV, DIMS_EARLY, CodegenError)


def _dims_early(ctx: KernelContext, code: KernelCode) -> list[str] | None:
    """With dims early (dims_early_choice), the statements declaring `d` as a local array holding the dims this
    kernel reads (loaded from the dims buffer before its pdl_enter); None otherwise, for a kernel emitted with
    dims_late, or when the kernel uses `d` other than as d[<constant>] (the pointer form then stays)."""
    if not dims_early_choice() or code.dims_late:
        return None
    text = "\n".join([*ctx.lines, code.body])
    if re.search(r"(?<![\w.>])d(?![\w\[])", text):  # `d` passed or used as a pointer
        return None
    used = sorted({int(i) for i in re.findall(r"(?<![\w.>])d\[(\d+)\]", text)})
    lines = [f"  const long long* __restrict__ dims_buf = reinterpret_cast<const long long*>(arena + "
             f"{ctx.plan.dims_offset}LL);",
             f"  long long d[{max(used, default=0) + 1}] = {{}};  // the dims it reads, before the wait"]
    lines += [f"  d[{i}] = dims_buf[{i}];" for i in used]
    return [*lines, "  (void)d;"]


def _wrapper(ctx: KernelContext, node: Node, code: KernelCode) -> str:
    sig = ", ".join(f"{v.name}: {v.dtype}{S.shape_str(v.shape)}" for v in node.outputs)
    threads = code.block[0] * code.block[1] * code.block[2]
    early = _dims_early(ctx, code)
    dims = early or [f"  const long long* __restrict__ d = reinterpret_cast<const long long*>(arena + "
                     f"{ctx.plan.dims_offset}LL);", "  (void)d;"]
    return "\n".join([
        code.preamble,
        "// " + comment_text(f"{node.name}: {node.op} -> {sig}"),
        f'extern "C" __global__ void __launch_bounds__({threads}{f", {code.min_blocks}" if code.min_blocks else ""}) '
        f'{ctx.kernel}(unsigned char* __restrict__ arena) {{',
        *(early or []),
        *([code.prefetch] if code.prefetch else []),
        *([] if code.waits_inside else ["  atlas::pdl_enter();"]),
        *(["  atlas::pdl_leave();  // early: the next kernel may launch now (it waits for this one's end)"]
          if code.trigger_early else []),
        *([] if early else dims),
        *ctx.lines,
        code.body,
        "  atlas::pdl_leave();",
        "}",
    ])
