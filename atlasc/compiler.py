"""The compile driver: ONNX file -> IR -> passes -> CUDA -> cubins -> one `.atlas` file.

`compile_model` is what `atlasc compile` calls. It reports progress through a callback (the CLI
draws it with rich) and writes the artifact atomically: a failure anywhere leaves no file.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from atlasc.artifact import (
    EntrySpec,
    IOSpec,
    KVCacheSpec,
    Manifest,
    MemorySpec,
    NodeSpec,
    VariantSpec,
    RegionSpec,
    SourceInfo,
    SymbolSpec,
    ValueSpec,
    WeightSpec,
    WeightsImage,
    cubin_member,
    write_artifact,
)
from atlasc.codegen import generate_module
from atlasc.codegen.generate import GeneratedModule, check_shared_memory
from atlasc.codegen.nvcc import check_stopped, compile_module
from atlasc.errors import ShapeError
from atlasc.frontend import import_onnx
from atlasc.ir import symbolic as S
from atlasc.ir.graph import Graph
from atlasc.ir.memory import ALIGNMENT, MemoryPlan
from atlasc.ir.program import CompileOptions, Program, narrowed_lower  # noqa: F401 (narrowed_lower: tests)
from atlasc.ir.serialize import encode_attrs
from atlasc.passes.plan_memory import dim_upper
from atlasc.pipeline import PipelineReport, run_pipeline

# (stage, detail[, (done, total) or (done, total, "bytes")]): done / total count items, or bytes with "bytes"
Progress = Callable[..., None]


@dataclass
class CompileResult:
    path: Path
    manifest: Manifest
    program: Program
    pipeline: PipelineReport
    seconds: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict:
        """A JSON-able summary (the CLI's --json)."""
        m = self.manifest
        return {
            "artifact": str(self.path),
            "kind": self.program.kind,
            "entries": {k: sum(1 for n in e.nodes if n.kernel) for k, e in m.entries.items()},  # launches
            "kernels": len(m.kernels()),  # distinct: a layer's shared kernels count once
            "archs": list(m.archs),
            "arena_bytes": m.memory.arena_bytes,
            "weights_bytes": m.memory.regions["weights"].nbytes,
            "kv_cache_bytes": m.memory.regions["kv_cache"].nbytes,
            "scratch_bytes": m.memory.regions["scratch"].nbytes if "scratch" in m.memory.regions else 0,
            "activation_peak_bytes": m.memory.activation_peak,
            "activation_naive_bytes": m.memory.activation_naive,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            **({"quantization": m.report["quantization"]} if "quantization" in m.report else {}),
        }


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def compile_model(model_path: str | Path, out_path: str | Path, options: CompileOptions, *,
                  dump_ir: str | Path | None = None, progress: Progress | None = None) -> CompileResult:
    """Compile an ONNX model into an artifact at out_path.

    Guarantees: the artifact holds one cubin per requested arch, the weights image in arena order
    and a manifest that describes every launch; same inputs and options give a byte-identical file;
    on any error no file is left at out_path (an existing one is untouched).
    """
    report_progress = progress or (lambda stage, detail, done=None: None)

    def say(stage, detail, done=None):  # every stage and pass boundary: a terminated compile stops here
        check_stopped()
        report_progress(stage, detail, done)

    model_path, out_path = Path(model_path), Path(out_path)
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    say("import", str(model_path))
    graph = import_onnx(model_path)
    seconds["import"] = time.perf_counter() - t
    _check_dtype(graph, options.dtype)

    with spill_directory() as spill:
        result = _compile_program(graph, model_path, out_path, options, seconds, say, spill, dump_ir)
    result.program.spill_dir = None  # removed: later constants stay in memory (the spilled ones stay mapped)
    return result


@contextlib.contextmanager
def spill_directory() -> Iterator[Path]:
    """A fresh private folder in the temporary directory, removed with its files on any exit. Its removal is
    armed before the folder exists: tempfile.TemporaryDirectory makes the folder first, and a SIGTERM landing
    between its mkdir and the cleanup's registration (the CLI's signal handler raises there) left the folder
    behind (seen once in CI); a stop landing in the removal itself is caught and the removal finished."""
    path = Path(tempfile.gettempdir()) / f"atlasc-spill-{uuid.uuid4().hex}"
    ours = True
    try:
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:  # not ours to remove (a uuid4 name: practically never)
            ours = False
            raise
        yield path
    finally:
        if ours:
            try:
                shutil.rmtree(path, ignore_errors=True)
            except BaseException:  # the first signal's stop landing in the removal: finish it, then go on
                shutil.rmtree(path, ignore_errors=True)  # (the handler ignores later signals)
                raise


def _compile_program(graph, model_path: Path, out_path: Path, options: CompileOptions, seconds: dict,
                     say, spill_dir: Path, dump_ir) -> CompileResult:
    """compile_model after the import; the large constants passes make go to files in spill_dir."""
    t = time.perf_counter()
    program = Program({"main": graph}, options, progress=say, spill_dir=spill_dir)
    program, report = run_pipeline(program, verify_each=options.verify, dump_ir=dump_ir,
                                   on_pass=lambda name: say("pass", name))
    seconds["passes"] = time.perf_counter() - t
    if program.quantization and program.kind == "decoder":
        t = time.perf_counter()
        say("accuracy", "quantized vs float on calibration prompts")
        program.quantization["accuracy"] = _accuracy(program, options, say)
        seconds["accuracy"] = time.perf_counter() - t

    t = time.perf_counter()
    kernels = sum(program.plans[k].needs_kernel(n) for k, g in program.entries.items() for n in g.nodes)
    say("codegen", f"{kernels} nodes")  # launches: fewer where kernels chain (codegen/quant_chain.py)
    module = program_module(program, options.archs)
    check_shared_memory(module, options.archs)
    seconds["codegen"] = time.perf_counter() - t

    t = time.perf_counter()
    say("nvcc", f"{', '.join(options.archs)}: {len(module.kernels)} kernels")
    cubins = compile_module(module, options.archs,
                            on_built=lambda done, total: say("nvcc", "cubins built", (done, total)))
    check_shared_memory(module, options.archs, cubins)  # now with each kernel's static arrays
    seconds["nvcc"] = time.perf_counter() - t

    t = time.perf_counter()
    say("write", str(out_path))
    manifest, weights = build_manifest(program, module, model_path, options, report)
    members = {"kernels.cu": module.source.encode()}
    members.update({cubin_member(arch, i): data for arch, parts in cubins.items() for i, data in enumerate(parts)})
    manifest = write_artifact(out_path, manifest, members, weights)
    seconds["write"] = time.perf_counter() - t
    return CompileResult(out_path, manifest, program, report, seconds)


def program_module(program: Program, archs: tuple[str, ...]) -> GeneratedModule:
    """The CUDA module of a program after the pass pipeline (generate_module with its entries, plans, bounds,
    KV cache, decode buckets and steps) for the target archs; nvcc not run."""
    return generate_module({k: (g, program.plans[k]) for k, g in program.entries.items()}, program.bounds,
                           _kv_dict(program), decode_buckets(program), archs, narrowed_lower(program),
                           decode_steps(program), bulk_ops(program))


def bulk_ops(program: Program) -> frozenset[str]:
    """The projection ops (LinearQ4 / LinearQ8) whose batch-1 decode path choose-decode-path set to the copy-engine
    kernels (its decode_paths record: rows 1 ending in COPY_ENGINE_NOTE)."""
    from atlasc.passes.choose_decode_path import COPY_ENGINE_NOTE, QUANT

    rows1 = {quant: d.get("paths", {}).get("rows 1", "") for quant, d in program.decode_paths.items()}
    return frozenset(op for op, quant in QUANT.items() if rows1.get(quant, "").endswith(COPY_ENGINE_NOTE))


# Decode batch sizes that get their own kernels when the artifact's maximum batch is larger: a kernel
# holds the code paths of every batch up to its maximum, and the largest paths set its registers (a
# Linear compiled for batch 32 uses 128 registers where batch 1 needs 62, halving the blocks per SM
# and the bytes in flight of the batch-1 GEMV: 2x slower on the H200, docs/perf.md v5).
DECODE_BATCH_BUCKETS = (1, 8)


def decode_buckets(program: Program) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{"decode": (batch symbol, the DECODE_BATCH_BUCKETS below its --max-batch)} for decoders, else {} (or when
    none is below): see generate_module. With split-decode's `decode_small` the small batches run there: it gets
    the buckets below its bound and `decode` none (it serves only the larger batches)."""
    batch = program.roles.get("batch")
    if program.kind != "decoder" or "decode" not in program.entries or not batch:
        return {}
    small = next((name for name, (wide, _) in program.narrows.items() if wide == "decode"), None)
    entry = small or "decode"
    below = tuple(b for b in DECODE_BATCH_BUCKETS if b < program.bounds[entry][batch])
    return {entry: (batch, below)} if below else {}


def decode_steps(program: Program) -> dict[str, str]:
    """{entry: batch symbol} of a decoder's decode steps (`decode`, and split-decode's `decode_small`, which
    narrows it): generate_module keeps their batch-1 kernels one per node."""
    batch = program.roles.get("batch")
    if program.kind != "decoder" or not batch:
        return {}
    return {name: batch for name in program.decode_steps()}


def _accuracy(program: Program, options: CompileOptions, say: Progress) -> dict:
    from atlasc.accuracy import accuracy_report, decode_act_report, default_prompts, load_calibration

    vocab = int(program.entries["prefill"].outputs[0].shape[-1])
    if options.calib:
        ids = load_calibration(options.calib, vocab, options.max_seq)
    else:
        ids = default_prompts(vocab, options.max_batch, options.max_seq)
    caches: list = []  # the quantized prefill's KV caches, which the decode steps start from
    report = accuracy_report(program, ids, caches, progress=say)
    act = decode_act_report(program, ids, caches if report else None, progress=say)
    if act:
        report["decode_act_int8"] = act
    report["calibration"] = options.calib or "random prompts (seed 0)"
    return report


def model_float_dtype(graph) -> str | None:
    """The float dtype holding most of the model's weight bytes (None for a model without float weights)."""
    sizes: dict[str, int] = {}
    for c in graph.constants():
        if c.dtype in ("float32", "float16"):
            sizes[c.dtype] = sizes.get(c.dtype, 0) + c.data.nbytes
    return max(sizes, key=sizes.get) if sizes else None


def _check_dtype(graph, requested: str) -> None:
    """--dtype fp32/fp16 must match the export: converting a model's precision is not implemented."""
    if requested == "auto":
        return
    want = {"fp32": "float32", "fp16": "float16"}[requested]
    have = model_float_dtype(graph)
    if have is not None and have != want:
        raise ShapeError(f"--dtype {requested} asked for, but the model's weights are {have}: atlasc compiles a "
                         "model in the precision it was exported in",
                         hint="export the model in the precision you want, or use --dtype auto")


def _kv_dict(program: Program) -> dict | None:
    kv = program.kv_cache
    if kv is None:
        return None
    plan = next(iter(program.plans.values()))
    return {**asdict(kv), "offset": plan.regions["kv_cache"].offset}


def _io(v, plan: MemoryPlan) -> IOSpec:
    p = plan.placement(v)
    return IOSpec(v.name, v.dtype, tuple(S.to_json(d) for d in v.shape), p.offset, p.nbytes)


def build_manifest(program: Program, module, model_path: Path, options: CompileOptions,
                   report: PipelineReport) -> tuple[Manifest, WeightsImage]:
    """The manifest and the weights image (in arena order, laid out as it is written) for a planned,
    generated program."""
    plans = program.plans
    any_plan = next(iter(plans.values()))
    regions = any_plan.regions
    pieces: list[tuple[int, np.ndarray]] = []  # (offset, array): laid out while written (WeightsImage)
    weight_specs: dict[str, WeightSpec] = {}
    for graph in program.entries.values():
        for c in graph.constants():
            if c.name in weight_specs:
                continue
            p = plans[graph.name if graph.name in plans else next(iter(plans))].placement(c)
            pieces.append((p.offset, c.data))
            weight_specs[c.name] = WeightSpec(c.name, c.dtype, tuple(int(x) for x in c.data.shape), p.offset,
                                              int(c.data.nbytes))
    weights_img = WeightsImage(regions["weights"].nbytes, pieces)
    entries = {}
    for name, graph in program.entries.items():
        entries[name] = _entry_spec(name, graph, plans[name], module.launches[name], program.bindings.get(name, {}),
                                    program.narrows.get(name))
    upper_all: dict[str, int] = {}
    for bounds in program.bounds.values():
        for s, u in bounds.items():
            upper_all[s] = max(upper_all.get(s, 0), u)
    lowers = {s: info.lower for g in program.entries.values() for s, info in g.symbols.items()}
    symbols = tuple(SymbolSpec(s, lowers.get(s, 1), upper_all.get(s, 1)) for s in any_plan.symbols)
    kv = program.kv_cache
    kv_spec = None if kv is None else KVCacheSpec(kv.layers, kv.kv_heads, kv.head_dim, kv.max_batch, kv.max_seq,
                                                  kv.dtype, regions["kv_cache"].offset)
    region_specs = {k: RegionSpec(r.offset, r.nbytes) for k, r in regions.items()}
    if module.scratch_bytes:  # kernels' scratch after the planned arena (codegen GeneratedModule)
        region_specs["scratch"] = RegionSpec(module.scratch_offset, module.scratch_bytes)
    if module.tensor_maps:  # copy-engine tensor maps the runtime writes at load (codegen/linear_tma.py)
        region_specs["tensor_maps"] = RegionSpec(*module.tensor_map_region)
    memory = MemorySpec(ALIGNMENT, max(any_plan.arena_bytes, module.arena_bytes), region_specs,
                        any_plan.dims_offset, max(p.activation_peak for p in plans.values()),
                        max(p.activation_naive for p in plans.values()), tuple(module.tensor_maps))
    compile_report = {
        "kind": program.kind,
        "roles": program.roles,
        "codegen": module.choices,
        "decoder_io": _decoder_io(program),
        "passes": [{"name": r.name, "applied": r.applied, "nodes": r.nodes_after} for r in report.records],
    }
    if program.quantization:
        compile_report["quantization"] = program.quantization
    if program.decode_paths:
        compile_report["decode_paths"] = program.decode_paths
    manifest = Manifest(
        source=SourceInfo(model_path.name, sha256_file(model_path)),
        options={"archs": list(options.archs), "dtype": options.dtype, "max_batch": options.max_batch,
                 "max_seq": options.max_seq, "fusion": options.fusion,
                 **({"prefill_logits": "last"} if options.prefill_logits == "last" else {}),
                 **({"quant": options.quant, "quant_skip": list(options.quant_skip)}
                    if options.quant != "none" else {}),
                 **({"group_size": options.group_size} if options.quant == "int4" else {}),  # int8 / fp8: per channel
                 **({"zero_points": True} if options.quant == "int4" and options.zero_points else {})},
        archs=tuple(options.archs), symbols=symbols, memory=memory, kv_cache=kv_spec,
        weights=tuple(weight_specs.values()), entries=entries, report=compile_report,
    )
    return manifest, weights_img


def _decoder_io(program: Program) -> dict:
    if program.kind != "decoder":
        return {}
    sig = program.entries["prefill"].metadata["decoder"]
    logits = program.entries["prefill"].outputs[0].name
    return {"input_ids": sig.input_ids, "attention_mask": sig.attention_mask, "position_ids": sig.position_ids,
            "logits": logits}


def _entry_spec(name: str, graph: Graph, plan: MemoryPlan, launches, bindings: dict,
                narrows: tuple[str, dict[str, int]] | None = None) -> EntrySpec:
    values = []
    seen = set()
    for v in graph.all_values():
        if v.is_constant or v.name in seen:
            continue
        seen.add(v.name)
        p = plan.placement(v)
        strides = None if p.strides is None else tuple(S.to_json(d) for d in p.strides)
        values.append(ValueSpec(v.name, v.dtype, tuple(S.to_json(d) for d in v.shape), p.offset, p.nbytes, strides))
    by_node = {launch.node: launch for launch in launches}
    nodes = []
    for n in graph.nodes:
        ins, outs = tuple(None if i is None else i.name for i in n.inputs), tuple(o.name for o in n.outputs)
        launch = by_node.get(n.name)
        if launch is None:
            if plan.needs_kernel(n):
                raise ShapeError(f"node {n.name} has no kernel launch")
            # an aliased reshape: its output already sits in its input's bytes, nothing to launch
            nodes.append(NodeSpec(n.name, n.op, ins, outs, encode_attrs(n.attrs), "", (1, 1, 1), (1, 1, 1), 0))
            continue
        variants = tuple(VariantSpec(v.upto, v.kernel, tuple(v.grid), tuple(v.block), v.smem, v.args)
                         for v in launch.variants)
        nodes.append(NodeSpec(n.name, n.op, ins, outs, encode_attrs(n.attrs), launch.kernel,
                              tuple(launch.grid), tuple(launch.block), launch.smem, launch.symbol, variants,
                              launch.args, launch.co_resident))
    wide, upper = narrows or ("", {})
    return EntrySpec(name, tuple(_io(v, plan) for v in graph.inputs), tuple(_io(v, plan) for v in graph.outputs),
                     dict(bindings), tuple(values), tuple(nodes), wide, dict(upper))


def upper_bound(d, program: Program, entry: str) -> int:
    """Compile-time maximum of a dim in an entry (what buffers are sized for)."""
    return dim_upper(d, program.bounds.get(entry, {}), program.roles,
                     program.options.max_seq if program.kind == "decoder" else None)
