"""choose-decode-path: whether a quantized decode projection takes its activations as int8.

Matches every LinearQ4 / LinearQ8 (alone, or inside NormLinearQ / NormLinearRotary) whose rows are at
most 8 at run time (decode) and whose K and group size fit the dp4a kernels (atlasc/ir/ops/quant.py:
act8_why_not). Such a node gets act = "int8" (W4A8 / W8A8: its kernel quantizes x per row to int8 in
shared memory and accumulates dp4a products in int32, codegen/act_int8.cu) when the path chosen for its
rows bucket is the int8-activation one; otherwise it keeps float activations (W4A16 / W8A16, quant.cu's
tensor-core path).

The path comes from the measured table passes/decode_paths.yaml: per arch, quantization and rows bucket
("rows 1", "rows 2..8") the faster of the two paths on the decode shapes. The artifact holds one IR for
every `--arch`, so a bucket takes int8 activations only when every arch's table chooses them; an arch
without a measurement chooses float activations ("not measured"). A node whose rows reach 2..8 also
runs batch 1, so it needs both buckets to choose int8. On sm90 (H200) float activations win every
bucket's kernels (1.2-5.9x per call, docs/perf.md; W8A8 measured in its first form: its early form, now what
the compiler emits, is 1.3-1.8x faster and wins gate/up and the LM head at one row, v33, not yet in the table).
A table entry "fused rows 1" (per arch and quantization) measures the decode step with int8 x in the batch-1
kernels of the fused non-rotary projections only (FUSED_ROWS1); where every arch of the compile chose it there,
those kernels take it by default (sm90, docs/perf.md v34: the 8-layer Llama-3-8B step 7.8% faster for int4,
3.0% for int8). ATLAS_INT4_PATH=w4a16|w4a8|w4a8-fused1 and
ATLAS_INT8_PATH=w8a16|w8a8|w8a8-fused1 override the table for every bucket (experiments, GPU tests).
A table entry "bulk rows 1" (BULK_BUCKET) choosing w4a16-bulk / w8a16-bulk, or ATLAS_INT4_PATH=w4a16-bulk /
ATLAS_INT8_PATH=w8a16-bulk, gives an sm90-only compile (the copy engine allowed, ATLAS_QUANT_BULK not 0) float
activations everywhere, recorded as rows 1 "w4a16 (copy engine)": atlasc/compiler.py bulk_ops then hands the op to
codegen, whose copy-engine kernels (codegen/quant_bulk.py, ATLAS_QUANT_BULK=auto) serve its batch-1 projections,
where every node of the op has weights they take (bulk_fits: float16 x, whole stages of K, int4 symmetric g128). An
entry's optional "min k" passes it over for a model whose op has a smaller K anywhere (the record's source then
says so): the sm90 int4 entry (H100, docs/perf.md v50) chose it for Llama-3-8B's shapes (K >= 4096; the decode step
5.8% faster, end to end 7.2%) and not for Llama-3.2-1B's (K 2048: 7.7% slower), so its min k is 4096. The entry
applies to every sm90 GPU though measured on an H100 only (the H200 is v50's Next 1). int8
activations add the error of quantizing them: the compile's accuracy report measures it on a decode
step per calibration prompt (atlasc/accuracy.py decode_act_report).

Requires: fuse-linear-prologue (it runs after it, on the fused nodes). Guarantees: only the attribute
`act` changes, and the node's reference then computes the int8-activation result; the choice is in the
artifact's IR, and Program.decode_paths records per quantization the path per bucket and its source
(the manifest's report: `decode_paths`, shown by `atlasc inspect`).
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from atlasc.errors import UsageError
from atlasc.ir.archs import copy_engine, quant_bulk_mode
from atlasc.ir.graph import Graph, Node
from atlasc.ir.ops.prologue import staging_bytes, staging_limit
from atlasc.ir.ops.quant import act8_why_not
from atlasc.passes.fuse_linear_prologue import rows_upper
from atlasc.ir.program import Program
from atlasc.passes.rewrite import RewriteStats

# op -> (environment variable, its values: float activations first, then int8 ones)
PATHS = {"LinearQ4": ("ATLAS_INT4_PATH", ("w4a16", "w4a8")), "LinearQ8": ("ATLAS_INT8_PATH", ("w8a16", "w8a8"))}
QUANT = {"LinearQ4": "int4", "LinearQ8": "int8"}  # the table's and the record's key per op
RULES = {"LinearQ4": "LinearQ4 (decode) => act int8 (W4A8, dp4a)",
         "LinearQ8": "LinearQ8 (decode) => act int8 (W8A8, dp4a)"}
BUCKETS = ("rows 1", "rows 2..8")
# ATLAS_INT4_PATH=w4a8-fused1 / ATLAS_INT8_PATH=w8a8-fused1 (also the table's FUSED_BUCKET choice): int8 activations
# only in the rows-1 kernels of the fused non-rotary projections (NormLinearQ: gate/up + SwiGLU, the LM head; act =
# "int8@1"). The lab at M = 1 has those faster with int8 x: int4 (docs/perf.md v12) 8B gate/up 23.39 against
# 28.48 us, LM head 77.84 against 83.14; int8 with W8A8's early form (v33, plain kernels) gate/up 33.07 against
# 34.65, LM head 125.43 against 138.46; QKV, o, down and 8 rows slower. In the decode step (v34): see the table.
FUSED_ROWS1 = {"LinearQ4": "w4a8-fused1", "LinearQ8": "w8a8-fused1"}
# the table's entry (per arch and quantization) that measures the fused path in a decode step (a mix of kernels has
# no one-kernel lab row): {"choice", "date", "command", "step us": {path: us}}; choosing FUSED_ROWS1 there makes it
# the default where both buckets' kernel choices are float activations
FUSED_BUCKET = "fused rows 1"
# ATLAS_INT4_PATH=w4a16-bulk / ATLAS_INT8_PATH=w8a16-bulk (also the table's BULK_BUCKET choice): float x everywhere,
# and the batch-1 projections on the copy-engine kernels (codegen/quant_bulk.py, sm90-only compiles): the decode
# step's projections then start their weight copies before the previous kernel ends (docs/perf.md v49)
BULK_ROWS1 = {"LinearQ4": "w4a16-bulk", "LinearQ8": "w8a16-bulk"}
# {"choice", "gpu", "date", "command", "step us": {path: us}, "min k"}, as FUSED_BUCKET; "min k" (optional): the
# smallest K of the op's projections for which the choice holds (models with a smaller one keep the other paths)
BULK_BUCKET = "bulk rows 1"
PASSED_OVER = f"; {BULK_BUCKET} passed over: "  # in a source: why the table's BULK_BUCKET choice did not hold
BULK_RULES = {"LinearQ4": "LinearQ4 (decode, 1 row) => copy engine (w4a16-bulk)",
              "LinearQ8": "LinearQ8 (decode, 1 row) => copy engine (w8a16-bulk)"}
COPY_ENGINE_NOTE = "(copy engine)"  # the rows-1 path's suffix in the record (atlasc/compiler.py bulk_ops reads it)
FUSED_ROWS1_RULE = {"LinearQ4": "NormLinearQ(LinearQ4) (decode, 1 row) => act int8 (W4A8)",
                    "LinearQ8": "NormLinearQ(LinearQ8) (decode, 1 row) => act int8 (W8A8)"}
TABLE = Path(__file__).with_name("decode_paths.yaml")


def load_table(path: Path = TABLE) -> dict:
    """arch -> {"measured": {gpu, date, command}, "int4" | "int8": {bucket: {"m", "choice", "us": {shape:
    {"KxN", <float path>: us, <int8 path>: us}}}}}."""
    return yaml.safe_load(Path(path).read_text())


def table_problems(table: dict) -> list[str]:
    """What is wrong with a table: missing buckets, a choice that is not the path with the smaller sum
    of microseconds over the bucket's shapes, or a FUSED_BUCKET whose choice is not its fastest step."""
    problems = []
    for arch, entry in table.items():
        for op, quant in QUANT.items():
            fused = entry.get(quant, {}).get(FUSED_BUCKET)
            if fused is not None:
                step = fused.get("step us") or {}
                need, known = {PATHS[op][1][0], FUSED_ROWS1[op]}, {*PATHS[op][1], FUSED_ROWS1[op]}
                if not need <= set(step) <= known or fused.get("choice") != min(step, key=step.get):
                    problems.append(f"{arch} {quant} {FUSED_BUCKET}: choice {fused.get('choice')} but step us {step} "
                                    f"(numbers for {', '.join(sorted(need))}, at most {', '.join(sorted(known))})")
            bulk = entry.get(quant, {}).get(BULK_BUCKET)
            if bulk is not None:
                step = bulk.get("step us") or {}
                known = {*PATHS[op][1], FUSED_ROWS1[op], BULK_ROWS1[op]}
                if not (BULK_ROWS1[op] in step and len(step) > 1 and set(step) <= known) or \
                        bulk.get("choice") != min(step, key=step.get):
                    problems.append(f"{arch} {quant} {BULK_BUCKET}: choice {bulk.get('choice')} but step us {step} "
                                    f"(numbers for {BULK_ROWS1[op]} and another of {', '.join(sorted(known))})")
                min_k = bulk.get("min k", 0)  # a blank "min k:" reads as None: refused here, 0 in decide()
                if not isinstance(min_k, int) or isinstance(min_k, bool) or min_k < 0:
                    problems.append(f"{arch} {quant} {BULK_BUCKET}: min k {min_k!r} is not a non-negative integer")
            for bucket in BUCKETS:
                cell = entry.get(quant, {}).get(bucket)
                if not cell or not cell.get("us"):
                    problems.append(f"{arch} {quant} {bucket}: no measurement")
                    continue
                sums = {p: sum(float(row[p]) for row in cell["us"].values()) for p in PATHS[op][1]}
                if cell["choice"] != min(sums, key=sums.get):
                    problems.append(f"{arch} {quant} {bucket}: choice {cell['choice']} but us sums {sums}")
    return problems


def env_choice(op: str) -> str | None:
    """ATLAS_INT4_PATH / ATLAS_INT8_PATH when set (None otherwise); UsageError for an unknown value."""
    env, values = PATHS[op]
    values = (*values, FUSED_ROWS1[op], BULK_ROWS1[op])
    path = os.environ.get(env, "")
    if path and path not in values:
        raise UsageError(f"{env}={path!r} is not a decode path (expected one of: {', '.join(values)})")
    return path or None


def decide(op: str, archs: tuple[str, ...], table: dict, bulk_k: int | None = None) -> dict:
    """{"paths": bucket -> path, "source": why} for op's decode nodes in a compile for archs; bulk_k: the smallest K
    of op's nodes when every one has weights the copy-engine kernels take (smallest_bulk_k()), else None. A table's
    BULK_BUCKET choice holds only where bulk_k is at least its "min k" (the source then names the entry passed
    over); a forced BULK_ROWS1 path holds regardless."""
    env, (float_path, int8_path) = PATHS[op]
    forced = env_choice(op)
    copy_engine_rows1 = {"rows 1": f"{float_path} {COPY_ENGINE_NOTE}", "rows 2..8": float_path}
    if forced == BULK_ROWS1[op]:
        if not bulk_allowed(archs):
            raise UsageError(f"{env}={forced} needs a compile for sm90 alone (--arch sm90) with ATLAS_LINEAR_TMA and "
                             f"ATLAS_QUANT_BULK not 0 (got --arch {','.join(archs) or '-'})")
        return {"paths": copy_engine_rows1, "source": f"{env}={forced}"}
    if forced == FUSED_ROWS1[op]:
        return {"paths": {"rows 1": f"{int8_path} (fused norms)", "rows 2..8": float_path},
                "source": f"{env}={forced}"}
    if forced:
        return {"paths": dict.fromkeys(BUCKETS, forced), "source": f"{env}={forced}"}
    bulk_archs = [a for a in archs if table.get(a, {}).get(QUANT[op], {}).get(BULK_BUCKET, {}).get("choice")
                  == BULK_ROWS1[op] and all(table[a][QUANT[op]][b]["choice"] == float_path for b in BUCKETS)]
    passed_over = ""
    if archs and len(bulk_archs) == len(archs) and bulk_allowed(archs) and bulk_k is not None:
        min_k = max(table[a][QUANT[op]][BULK_BUCKET].get("min k") or 0 for a in archs)
        if bulk_k >= min_k:
            dates = ", ".join(f"{a} measured {table[a][QUANT[op]][BULK_BUCKET]['date']}" for a in archs)
            return {"paths": copy_engine_rows1, "source": f"table {TABLE.name} ({BULK_BUCKET}): {dates}"}
        passed_over = f"{PASSED_OVER}K {bulk_k} < its min k {min_k}"
    fused_archs = [a for a in archs if table.get(a, {}).get(QUANT[op], {}).get(FUSED_BUCKET, {}).get("choice")
                   == FUSED_ROWS1[op] and all(table[a][QUANT[op]][b]["choice"] == float_path for b in BUCKETS)]
    if archs and len(fused_archs) == len(archs):
        dates = ", ".join(f"{a} measured {table[a][QUANT[op]][FUSED_BUCKET]['date']}" for a in archs)
        return {"paths": {"rows 1": f"{int8_path} (fused norms)", "rows 2..8": float_path},
                "source": f"table {TABLE.name} ({FUSED_BUCKET}): {dates}{passed_over}"}
    per_arch, notes = [], []
    for arch in archs:
        entry = table.get(arch)
        if entry is None:
            per_arch.append(dict.fromkeys(BUCKETS, float_path))
            notes.append(f"{arch} not measured")
        else:
            per_arch.append({b: entry[QUANT[op]][b]["choice"] for b in BUCKETS})
            notes.append(f"{arch} measured {entry['measured']['date']}")
    paths = {b: int8_path if per_arch and all(p[b] == int8_path for p in per_arch) else float_path
             for b in BUCKETS}
    if any(p != per_arch[0] for p in per_arch):
        notes.append("the archs differ: float activations where they do")
    return {"paths": paths, "source": f"table {TABLE.name}: " + ", ".join(notes) + passed_over}


def bulk_fits(program: Program, op: str) -> bool:
    """Whether every node computing op (LinearQ4 / LinearQ8, alone or fused) is one the copy-engine kernels take
    (codegen/quant_bulk.py): float16 x of a static K that is a whole number of stages (128 k of int4, 64 of int8),
    int4 symmetric (no zero points) in groups of 128. Others would keep quant.cu's float-x kernels, slower at one row
    than the fused int8-x default. (The kernels' other conditions, e.g. alignment or a rotary tile, hold for the
    decoders the frontend builds.)"""
    stage_k = 128 if op == "LinearQ4" else 64
    for graph in program.entries.values():
        for node in graph.nodes:
            if _projection(node) != op:
                continue
            x = node.inputs[0]
            k = x.shape[-1]
            if x.dtype != "float16" or not isinstance(k, int) or k % stage_k:
                return False
            zero = {"NormLinearQ": 3, "NormLinearRotary": 5}.get(node.op, 1) + 3  # wq, scale, bias, zero
            if op == "LinearQ4" and (int(node.attrs.get("group_size", 0)) != 128
                                     or (len(node.inputs) > zero and node.inputs[zero])):
                return False
    return True


def smallest_bulk_k(program: Program, op: str) -> int | None:
    """The smallest K of op's nodes when there are some and bulk_fits(program, op), else None (decide's bulk_k)."""
    ks = [n.inputs[0].shape[-1] for g in program.entries.values() for n in g.nodes if _projection(n) == op]
    return min(ks) if ks and bulk_fits(program, op) else None


def bulk_allowed(archs: tuple[str, ...]) -> bool:
    """Whether a compile for archs may put batch-1 projections on the copy-engine kernels: sm90 alone with the copy
    engine allowed (atlasc/ir/archs.py copy_engine) and ATLAS_QUANT_BULK not 0."""
    return copy_engine(tuple(archs)) and quant_bulk_mode() != "0"


def _projection(node: Node) -> str | None:
    """LinearQ4 / LinearQ8 when the node computes one of them (fused or not), else None."""
    op = node.attrs.get("linear", node.op) if node.op in ("NormLinearQ", "NormLinearRotary") else node.op
    return op if op in PATHS else None


def choose_graph(graph: Graph, upper: dict[str, int], int8_buckets: dict[str, set[str]],
                 stats: RewriteStats, archs: tuple[str, ...] = ()) -> None:
    """Mark graph's decode projections whose op has int8 activations chosen (op -> those buckets) for
    every rows bucket the node runs in, where their shared memory fits the archs (staging_limit)."""
    limit = staging_limit(archs)
    for node in graph.nodes:
        op = _projection(node)
        if op not in int8_buckets:
            continue
        x = node.inputs[0]
        rows = rows_upper(x, upper)
        group = int(node.attrs.get("group_size", 0))
        why = "its rows have no upper bound" if rows is None else act8_why_not(4 if op == "LinearQ4" else 8,
                                                                              group, x.shape[-1], rows)
        if not why:
            runs = set(BUCKETS[: 1 if rows == 1 else 2])
            if not runs <= int8_buckets[op]:
                why = f"{', '.join(sorted(runs - int8_buckets[op]))} keeps float activations"
        if not why:  # every block keeps the int8 rows (and a fused norm's staged rows) in shared memory
            smem = rows * x.shape[-1] + (staging_bytes(rows, x.shape[-1], x.dtype) if node.op != op else 0)
            if smem > limit:
                why = f"its rows need {smem // 1024} KB of shared memory (at most {limit // 1024} KB on these archs)"
        if why:
            stats.declined[f"{RULES[op]} at {node.name}"] = why
            continue
        node.attrs["act"] = "int8"
        stats.applied[RULES[op]] = stats.applied.get(RULES[op], 0) + 1


# the entries whose kernels are also generated for a batch of 1 when their batch may be larger
# (atlasc/compiler.py decode_buckets)
BUCKETED_ENTRIES = ("decode", "decode_small")


def choose_fused_rows1(graph: Graph, stats: RewriteStats, upper: dict[str, int], bucketed: bool,
                       archs: tuple[str, ...] = (), op: str = "LinearQ4") -> None:
    """ATLAS_INT4_PATH=w4a8-fused1 (op LinearQ4) / ATLAS_INT8_PATH=w8a8-fused1 (LinearQ8): act = "int8@1" on
    graph's NormLinearQ nodes over op that have a kernel for one row (bucketed: the entry's batch-1 kernels;
    otherwise only nodes whose rows are at most 1, e.g. not a prefill of a few tokens, whose one kernel serves
    every row count) and whose one-row kernel the int8-activation path can serve (act8_why_not at one row, its
    shared memory within staging_limit)."""
    limit = staging_limit(archs)
    for node in graph.nodes:
        if node.op != "NormLinearQ" or node.attrs.get("linear") != op:
            continue
        x = node.inputs[0]
        rows = rows_upper(x, upper)
        if not bucketed and (rows is None or rows > 1):
            continue  # no kernel of this node runs with exactly one row only
        k, group = x.shape[-1], int(node.attrs.get("group_size", 0))
        why = act8_why_not(4 if op == "LinearQ4" else 8, group, k, 1)
        if not why and k + staging_bytes(1, k, x.dtype) > limit:
            why = f"its row needs more than {limit // 1024} KB of shared memory on these archs"
        if why:
            stats.declined[f"{FUSED_ROWS1_RULE[op]} at {node.name}"] = why
            continue
        node.attrs["act"] = "int8@1"
        stats.applied[FUSED_ROWS1_RULE[op]] = stats.applied.get(FUSED_ROWS1_RULE[op], 0) + 1


def choose_decode_path(program: Program, table: dict | None = None) -> tuple[Program, RewriteStats]:
    """Mark decode int4 / int8 projections for int8 activations where the table (passes/decode_paths.yaml,
    or `table`) chooses them for every arch of the compile, or ATLAS_INT4_PATH / ATLAS_INT8_PATH say so."""
    stats = RewriteStats()
    ops = {op for g in program.entries.values() for n in g.nodes if (op := _projection(n))}
    if not ops:
        return program, stats
    table = load_table() if table is None else table
    int8_buckets = {}
    for op in sorted(ops):
        decision = decide(op, tuple(program.options.archs), table, smallest_bulk_k(program, op))
        program.decode_paths[QUANT[op]] = decision
        if PASSED_OVER in decision["source"]:  # -vv names it with the declined rewrites
            stats.declined[BULK_RULES[op]] = decision["source"].split(PASSED_OVER)[1]
        if decision["paths"]["rows 1"].endswith("(fused norms)"):
            for entry, graph in program.entries.items():
                choose_fused_rows1(graph, stats, program.bounds.get(entry, {}), entry in BUCKETED_ENTRIES,
                                   program.options.archs, op)
            continue
        chosen = {b for b, path in decision["paths"].items() if path == PATHS[op][1][1]}
        if chosen:
            int8_buckets[op] = chosen
    if int8_buckets:
        for entry, graph in program.entries.items():
            choose_graph(graph, program.bounds.get(entry, {}), int8_buckets, stats, program.options.archs)
    return program, stats
