"""The one-row int4 / int8 projection with the copy engine streaming the weights (quant_bulk.cu).

quant.cu's one-row kernels take 1.5-1.8x (int4) and 1.2-1.4x (int8) the time of a kernel that only streams the same
bytes (docs/perf.md v11, v37): each warp holds a round of weights in registers and waits for it before
dequantizing, so while it computes it has no bytes in flight. linear_quant_bulk keeps STAGES stages (128 k of int4 or
64 k of int8 for 16 W rows) in flight per block through the copy engine (cp.async.bulk.tensor into shared memory)
while W consumer warps dequantize and multiply what has arrived.
Lab: examples/w4_bulk_lab.py times the same body on the Llama-3-8B shapes. Measured on an H100 (docs/perf.md v44
runs 1-2): the copy engine streams within 1-10% of the read-only floor, but each block's consumers (the per-stage
chain of loads, dequantization and MMAs) bound it. The kernels beat quant.cu's float-x ones in the lab only on the
wide projections, and with those on it the replayed 8-layer int4 step was 12.5% slower (H100; on the H200, v46:
16.8% slower). v49 (H100) capped the copies in flight and held the producer warp to the block's end: the int4 step
then gains 5% (below). v50 (H100): the sm90 int4 default where every int4 projection has K >= 4096 and weights
this path takes (passes/decode_paths.yaml "bulk rows 1", choose_decode_path.bulk_fits: Llama-3-8B's step -5.8%, end
to end -7.2% ms/step; Llama-3.2-1B's step, K 2048, +7.7%); not yet measured on the H200.

ATLAS_QUANT_BULK=1 (every eligible node; auto, the default: only nodes of the ops whose batch-1 decode path
choose-decode-path set to this one, generate_module's bulk_ops, e.g. with ATLAS_INT4_PATH=w4a16-bulk) serves a
LinearQ4 or LinearQ8 node (the plain projection: Llama's o and down at batch 1) whose
kernel runs for one row of x, when the compile targets sm90 alone with the copy engine allowed (ATLAS_LINEAR_TMA,
atlasc/ir/archs.py; the cubin is built for sm_90a), x is a contiguous float16 row at 16-byte aligned bytes, the
weight is int4 symmetric (no zero points) with groups of 128 and K % 128 == 0, or int8 with K % 64 == 0 (not FP8
codes), N < 2^31, and the node takes float x (not act int8). It also serves a one-row NormLinearQ (eligible_norm:
Llama's gate/up + SwiGLU and the LM head) or NormLinearRotary (the merged QKV projection with the rotary and the
cache append, its tiles of 8 W pairs dividing D / 2 and R / 2: W = 8 for Llama-3-8B's 128-dim heads, 4 for
Llama-3.2-1B's 64, rotary_warps) with the same weights and contiguous, aligned norm operands: the consumer warps
stage the (Add)RMSNorm of x (quant_bulk.cu QbNorm) while the producer's first copies are in flight, and a paired
epilogue (SwiGLU, LinRotary) reads its pairs' two rows as two boxes per stage. Nodes with int8 activations (act
int8: the sm90 default of the batch-1 gate/up and LM head kernels for int8, and for int4 where the "bulk rows 1"
entry is passed over) keep them, so the reference's arithmetic holds;
ATLAS_INT4_PATH=w4a16 / ATLAS_INT8_PATH=w8a16 give them float x and so this path (the batch-1 QKV + rotary takes
float x by default).
The producer warp stays until the consumers took its last stage (HOLD, below), so the wrapper's atlas::pdl_leave
comes at the block's end as common.cuh's trigger expects; v44-v46's producer let its lanes leave at the start, which
cost the path under programmatic launch (v46: 82 us in an 8-layer step; v49: the hold took 717.0 -> 693.0 us).
ATLAS_QUANT_BULK_EARLY=1 (default) starts the copies before the wait for the previous kernel: only the consumer warps
wait (atlas::pdl_enter, before they read x; and a looping block's producer, after a ring of copies, before its first
claim), so each block's first stages stream while that kernel drains, as the
default kernels' early weights do (linear.py early_pro). v44 run 2's step ran the kernels with the wait first (=0)
and lost 12.5%. On the H200 (docs/perf.md v46 run 1) the early copies are correct inside programmatic graphs and
gain nothing: the 8-layer int4 step with gate/up and the LM head on this path replays in 702.1 us (=1) and 702.3 (=0)
against 600.9 for the default kernels; with plain graphs 620.3 against 595.0. Programmatic launch, not the copies'
start, cost the path its step then (the producer's early exit: the hold below).
ATLAS_QUANT_BULK_CONFIG=W-S-B sets the consumer warps, the stages and the launch bound's blocks per SM (A/B
timing; default CONFIG); ATLAS_QUANT_BULK_KS=1|2|4|8|16 forces the K split (default: ks_split, whose runs keep at
least ATLAS_QUANT_BULK_MIN_RUN stages, default MIN_RUN);
ATLAS_QUANT_BULK_LOOP=auto|0|N: a weight of more tiles than blocks (auto: 132 x the configuration's blocks per SM;
N: N blocks; 0: never) without a K split, e.g. the LM head's 501 tiles, runs on that many blocks, each looping over
the tiles it claims, its ring kept full across tiles and x (or the norm) staged once (H100, docs/perf.md v51, its
first form d8c2159: the 8-layer Llama-3-8B int4 step 662.5 -> 656.3 us, the Llama-3.2-1B LM head alone 54.4 -> 52.1
us; the first claim's later place since a7d6358 is not yet timed);
ATLAS_QUANT_BULK_G_EARLY=1 has a norm source's consumers read their first bytes of the norm's scale, where it is a
constant, before the wait for the previous kernel (default 0, not yet timed);
ATLAS_QUANT_BULK_MIN_N=N leaves weights of fewer than N rows to quant.cu; ATLAS_QUANT_BULK_INFLIGHT=D caps the copies in
flight per block at D (below the stages; default 2; 0: no cap) and ATLAS_QUANT_BULK_HOLD=1 (default) keeps the
producer warp until the consumers took its last stage (quant_bulk.cu INFLIGHT, HOLD; with 0 it leaves once its last
copy is issued, up to STAGES stages before the end; v44-v46's code let all lanes but the issuing one leave at the
start, a form no longer built).
H100, 8-layer Llama-3-8B int4 step at batch 1 replayed with programmatic edges (docs/perf.md v49): with
ATLAS_INT4_PATH=w4a16 and every projection on this path at 16-11-1, D = 2 and the producer held, 689.8 -> 654.9 us
(-5.1%) against the default kernels; the hold alone takes gate/up and the LM head on this path at 16-6-1 from
717.0 to 693.0 us. int8 (w8a16, the same settings): 961.7 -> 1009.7 us (+5.0%). int4's offset
dequantization follows ATLAS_QUANT_OFS as for quant.cu's one-row kernels (quant.ofs_choice: auto takes it for
weights of at least OFS_MIN_N rows).
"""

from __future__ import annotations

import os

from atlasc.codegen.generate import CodegenError, KernelCode, KernelContext
from atlasc.codegen.nvcc import SM90A_MARKER
from atlasc.errors import env_choice, env_switch
from atlasc.ir.archs import QUANT_BULK_ENV, copy_engine, quant_bulk_mode

BULK_ENV = QUANT_BULK_ENV
CONFIG_ENV = "ATLAS_QUANT_BULK_CONFIG"
KS_ENV = "ATLAS_QUANT_BULK_KS"
# =N: only weights of at least N rows take the path (default 0: every eligible one). H100 lab (docs/perf.md v44 run
# 1): the bulk kernels beat quant.cu's float-x kernels on the wide 8B projections (gate/up, the LM head) and lose on
# the narrow ones (QKV, o), so a step A/B can put only the wide ones on it (v44 run 2: the step lost 12.5%).
MIN_N_ENV = "ATLAS_QUANT_BULK_MIN_N"
EARLY_ENV = "ATLAS_QUANT_BULK_EARLY"  # 0: the wrapper's wait first (v44's form); 1 (default): copies before the wait
# =D: at most D copies in flight per block (quant_bulk.cu INFLIGHT; default INFLIGHT; 0: no cap)
INFLIGHT_ENV = "ATLAS_QUANT_BULK_INFLIGHT"
# =1 (default): the producer warp stays until the consumers took its last stage (quant_bulk.cu HOLD); 0: it leaves
# once its last copy is issued
HOLD_ENV = "ATLAS_QUANT_BULK_HOLD"
KS_VALUES = ("1", "2", "4", "8", "16")
# W consumer warps, STAGES, blocks per SM: examples/chain_lab.py's best one-launch-per-projection form (16 warps, 11
# stages, 2 copies in flight) and the best 8-layer int4 step of docs/perf.md v49 (H100: 16-8-1 and a cap of 3 slower)
CONFIG = (16, 11, 1)
INFLIGHT = 2  # copies in flight per block (quant_bulk.cu INFLIGHT) unless ATLAS_QUANT_BULK_INFLIGHT says otherwise
STAGE_K = {4: 128, 8: 64}  # k per stage (qb_stage_k): one int4 group, or 64 bytes of int8
GROUP = 128
OPS = {"LinearQ4": 4, "LinearQ8": 8}
WEIGHT_INPUT = {"NormLinearQ": 3, "NormLinearRotary": 5}  # the packed weight's input (plain projections: 1)
# an sm90 block's shared memory, less 2 KB for the static arrays (the barriers, and a norm source's row offsets and
# scratch from linear_prologue._norm_source: ~0.8 KB)
SMEM_LIMIT = 227 * 1024 - 2048
SMS = 132  # the K split aims for config()'s blocks per SM of an H200 (132 SMs)
MIN_RUN = 4  # stages each K run keeps at least, unless ATLAS_QUANT_BULK_MIN_RUN says otherwise
# =R: the auto K split keeps R stages a run at least (default MIN_RUN). Llama-3.2-1B's o (8 tiles of 16 stages) then
# runs on 32 blocks of 132 SMs; a smaller R gives such narrow weights more blocks (docs/perf.md v50, H100: the 1B's
# step on this path +7.5% against the default kernels at R = 4, +3.9% at 2, +2.6% at 1; the 8B's splits are the same
# at any R)
MIN_RUN_ENV = "ATLAS_QUANT_BULK_MIN_RUN"
# =auto (default): a weight of more tiles than SMS x config()'s blocks per SM without a K split (the LM head: 501
# tiles) runs on that many blocks, each looping over tiles it claims (quant_bulk.cu: the ring kept full across tiles,
# x and the norm staged once a block); =N: at most N blocks (tests: with one K run, small N makes small weights
# loop); =0: a block a tile, as before
LOOP_ENV = "ATLAS_QUANT_BULK_LOOP"
# =1: a norm source's consumer threads read their first 16 bytes of the norm's scale g before the wait for the
# previous kernel (quant_bulk.cu QbNorm G_EARLY), not after the norm's reduction; default 0 until timed
G_EARLY_ENV = "ATLAS_QUANT_BULK_G_EARLY"
I32 = 1 << 31


def bulk_choice() -> str:
    """ATLAS_QUANT_BULK: "auto" (default: the projections choose-decode-path gave this path), "1" (every eligible
    one) or "0" (none); CodegenError for another value. Recorded in the artifact's codegen choices."""
    return quant_bulk_mode(CodegenError)


def serves(op: str, bulk_ops: frozenset[str]) -> bool:
    """Whether the path may take op's (LinearQ4 / LinearQ8) batch-1 kernels: ATLAS_QUANT_BULK=1, or auto with op in
    bulk_ops (the ops whose batch-1 decode path choose-decode-path set to the copy engine, generate_module's
    bulk_ops)."""
    mode = bulk_choice()
    return mode == "1" or (mode == "auto" and op in bulk_ops)


def smem_bytes(w: int, stages: int, run: int, bits: int = 4, norm_k: int = 0) -> int:
    """Dynamic shared memory of linear_quant_bulk for K runs of `run` stages: the stages (64 bytes of 16 w rows
    each), the run's x (float16) and its stages' offset sums (a float each), rounded to 16 bytes, with a norm source
    (norm_k = K) h for all of K and a float per warp, and 128 bytes for the stages' alignment."""
    x_bytes = -(-run * (2 * STAGE_K[bits] + 4) // 16) * 16
    return stages * 16 * w * 64 + x_bytes + (2 * norm_k + 4 * w if norm_k else 0) + 128


def early_choice() -> bool:
    """ATLAS_QUANT_BULK_EARLY (default on: the producer's copies start before the wait for the previous kernel);
    CodegenError unless 0 or 1. Recorded in the artifact's codegen choices."""
    return env_switch(EARLY_ENV, True, CodegenError)


def inflight_choice() -> int:
    """ATLAS_QUANT_BULK_INFLIGHT as an int (INFLIGHT when unset; 0: no cap); CodegenError unless a non-negative
    integer. emit() lowers a cap of at least the kernel's stages to 0."""
    value = os.environ.get(INFLIGHT_ENV, "") or str(INFLIGHT)
    if not value.isdigit():
        raise CodegenError(f"{INFLIGHT_ENV}={value!r} is not a count of copies (expected a non-negative integer)")
    return int(value)


def hold_choice() -> bool:
    """ATLAS_QUANT_BULK_HOLD (default on: the producer warp stays until its last stage is taken); CodegenError unless
    0 or 1."""
    return env_switch(HOLD_ENV, True, CodegenError)


def min_n_choice() -> int:
    """ATLAS_QUANT_BULK_MIN_N as an int (0 when unset); CodegenError unless a non-negative integer. Recorded in the
    artifact's codegen choices."""
    value = os.environ.get(MIN_N_ENV, "") or "0"
    if not value.isdigit():
        raise CodegenError(f"{MIN_N_ENV}={value!r} is not a row count (expected a non-negative integer)")
    return int(value)


def min_run_choice() -> int:
    """ATLAS_QUANT_BULK_MIN_RUN as an int (MIN_RUN when unset); CodegenError unless a positive integer. Recorded in
    the artifact's codegen choices."""
    value = os.environ.get(MIN_RUN_ENV, "") or str(MIN_RUN)
    if not value.isdigit() or int(value) < 1:
        raise CodegenError(f"{MIN_RUN_ENV}={value!r} is not a stage count (expected a positive integer)")
    return int(value)


def loop_choice() -> str:
    """ATLAS_QUANT_BULK_LOOP as given: "auto" (default), "0" or a positive block count; CodegenError otherwise.
    Recorded in the artifact's codegen choices."""
    value = os.environ.get(LOOP_ENV, "") or "auto"
    if value != "auto" and not value.isdigit():
        raise CodegenError(f"{LOOP_ENV}={value!r} is not auto, 0 or a block count")
    return value


def g_early_choice() -> bool:
    """ATLAS_QUANT_BULK_G_EARLY (default off); CodegenError unless 0 or 1. Recorded in the artifact's codegen
    choices."""
    return env_switch(G_EARLY_ENV, False, CodegenError)


def g_early(node) -> bool:
    """Whether a NormLinearQ / NormLinearRotary kernel reads its norm's scale before the wait: g_early_choice() and
    the scale (input 2) a constant, which no earlier kernel writes."""
    return g_early_choice() and node.inputs[2].is_constant


def norm_source(add: bool, eps: float, sum_ptr: str, early_g: bool = False, coherent: bool = False) -> str:
    """The QbNorm expression of a NormLinearQ / NormLinearRotary kernel (linear_prologue binds xs, its XNorm):
    with the residual add or not, its epsilon, the sum output's pointer (or nullptr), G_EARLY as early_g (g_early's
    answer); coherent: a chain's phase (its loads of a and b coherent: an earlier phase may have written them)."""
    flags = str(add).lower()
    if early_g or coherent:
        flags += f", {str(early_g).lower()}"
    if coherent:
        flags += ", true"
    return f"atlas::QbNorm<{flags}>{{xs, {eps!r}f, {sum_ptr}}}"


def loop_grid(tiles: int, ks: int) -> int:
    """The blocks of a launch whose blocks loop over tiles (quant_bulk.cu: more tiles than blocks, no K split), or 0
    for a block an item: with one K run and more tiles than loop_choice()'s blocks (auto: SMS x config()'s blocks
    per SM), that many blocks."""
    mode = loop_choice()
    limit = SMS * config()[2] if mode == "auto" else int(mode)
    return limit if ks == 1 and 0 < limit < tiles else 0


def config() -> tuple[int, int, int]:
    """(W, STAGES, blocks per SM): CONFIG or ATLAS_QUANT_BULK_CONFIG; CodegenError for a value that is not W-S-B of
    positive integers, a tile over 256 rows (a tensor-map box), fewer than 2 stages, or B blocks of 32 (W + 1)
    threads over an SM's 2048."""
    value = os.environ.get(CONFIG_ENV, "")
    if not value:
        return CONFIG
    parts = value.split("-")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise CodegenError(f"{CONFIG_ENV}={value!r} is not W-STAGES-BLOCKS (e.g. 16-11-1)")
    w, stages, blocks = (int(p) for p in parts)
    if 16 * w > 256 or stages < 2 or blocks * 32 * (w + 1) > 2048:
        raise CodegenError(f"{CONFIG_ENV}={value!r}: needs at most 16 warps (a box of at most 256 rows), at least 2 "
                           f"stages and at most 2048 threads per SM in B blocks of 32 (W + 1)")
    return w, stages, blocks


def ks_choice() -> str:
    """ATLAS_QUANT_BULK_KS as given ("auto" when unset); CodegenError unless auto or one of KS_VALUES."""
    return env_choice(KS_ENV, "auto", (*KS_VALUES, "auto"), "a K split", CodegenError)


def ks_split(tiles: int, steps: int) -> int:
    """K runs for `tiles` tiles of `steps` stages: forced by ATLAS_QUANT_BULK_KS, or the largest power of two up to
    16 that keeps tiles x runs <= SMS x config()'s blocks per SM and every run >= min_run_choice() stages (at least
    1); never more runs than stages."""
    mode = ks_choice()
    if mode != "auto":
        return min(int(mode), steps)
    target = SMS * config()[2]
    ks, min_run = 1, min_run_choice()
    while ks < 16 and tiles * ks * 2 <= target and steps // (ks * 2) >= min_run:
        ks *= 2
    return ks


def record() -> dict:
    """The path's settings for the artifact's codegen choices: the mode (auto|0|1), the configuration, the K split
    mode and the rest, each validated whatever the mode (CodegenError naming a bad one)."""
    return {"quant_bulk": bulk_choice(), "quant_bulk_config": list(config()), "quant_bulk_ks": ks_choice(),
            "quant_bulk_min_run": min_run_choice(), "quant_bulk_min_n": min_n_choice(),
            "quant_bulk_early": early_choice(), "quant_bulk_inflight": inflight_choice(),
            "quant_bulk_hold": hold_choice(), "quant_bulk_loop": loop_choice(), "quant_bulk_g_early": g_early_choice()}


def map_capacity(entries: dict, buckets: dict | None, archs: tuple[str, ...],
                 bulk_ops: frozenset[str] = frozenset()) -> int:
    """Tensor-map slots to reserve for a module: one per kernel and kernel variant of a LinearQ4 / LinearQ8 node or a
    NormLinearQ / NormLinearRotary node over one, whose op the path serves (serves(op, bulk_ops)) in an sm90-only
    compile with the copy engine allowed; else 0."""
    if not copy_engine(archs):
        return 0
    slots = 0
    for entry, (graph, _) in entries.items():
        kernels = 1 + len((buckets or {}).get(entry, ("", ()))[1])
        slots += kernels * sum(serves(op, bulk_ops) for n in graph.nodes
                               if (op := n.attrs.get("linear") if n.op in WEIGHT_INPUT else n.op) in OPS)
    return slots


def _aligned(ctx: KernelContext, v) -> bool:
    """v is a contiguous value at 16-byte aligned bytes."""
    placement = ctx.plan.placement(v)
    return placement.strides is None and placement.offset % 16 == 0


def _projection_ok(ctx: KernelContext, bits: int, x_v, wq_v, m_upper: int, zp: bool, group: int, k_static,
                   n_upper: int) -> bool:
    """The conditions every kernel of the path shares (the module docstring's): the path serving the projection's op
    (serves: ATLAS_QUANT_BULK=1, or auto and choose-decode-path chose it) in an sm90-only compile with room for
    tensor maps, int4 symmetric g128 or int8 weights of static N < 2^31, K a whole number of
    stages, one row of float16 x of K values, x and the weight contiguous and 16-byte aligned, and at least
    ATLAS_QUANT_BULK_MIN_N rows."""
    if not bits or not serves(f"LinearQ{bits}", ctx.bulk_ops) or ctx.tensor_maps is None or not copy_engine(ctx.archs):
        return False
    if n_upper < min_n_choice():
        return False
    if m_upper != 1 or zp or (bits == 4 and group != GROUP) or x_v.dtype != "float16":
        return False
    if not isinstance(k_static, int) or k_static % STAGE_K[bits] or not isinstance(wq_v.shape[0], int) or \
            n_upper >= I32:
        return False
    return _aligned(ctx, x_v) and _aligned(ctx, wq_v) and ctx.upper(x_v.shape[-1]) == k_static


def eligible(ctx: KernelContext, node, m_upper: int, zp: bool, group: int, k_static, n_upper: int) -> bool:
    """Whether linear_quant_bulk serves this LinearQ4 / LinearQ8 node's kernel (the module docstring's conditions;
    the caller has already given a node with int8 activations its own kernel)."""
    bits = OPS.get(node.op, 0)
    return (_projection_ok(ctx, bits, node.inputs[0], node.inputs[1], m_upper, zp, group, k_static, n_upper)
            and plan(n_upper, k_static, bits) is not None)


def rotary_tiles_ok(node, pairs: int) -> bool:
    """Whether a NormLinearRotary's pairs (linear.cu LinRotary: dims i and i + R/2 of a head for i < R/2, then i + R/2
    and i + D/2) fall in tiles of `pairs` consecutive pairs whose two weight rows each step by one: `pairs` divides
    D / 2 and R / 2 (R the static width of the cos table, 0 without rotary), D and R even."""
    d = int(node.attrs["head_dim"])
    cos_v = node.inputs[3]
    r = 0 if cos_v is None else cos_v.shape[-1]
    return isinstance(r, int) and d % 2 == 0 and r % 2 == 0 and (d // 2) % pairs == 0 and (r // 2) % pairs == 0


def rotary_warps(node) -> int:
    """The consumer warps of a NormLinearRotary's kernel: the most, up to config()'s W, whose tiles of 8 W pairs
    rotary_tiles_ok allows (W 4 for a 64-dim head, e.g. Llama-3.2-1B's), or 0 where none does."""
    w = config()[0]
    while w and not rotary_tiles_ok(node, 8 * w):
        w -= 1
    return w


def eligible_norm(ctx: KernelContext, node, wq_v, m_upper: int, zp: bool, group: int, k_static, n_upper: int,
                  kind: str, s_v) -> bool:
    """Whether linear_quant_bulk serves this NormLinearQ / NormLinearRotary node's kernel (the (Add)RMSNorm source
    QbNorm; kind "": plain, "gated": the SwiGLU-style paired epilogue, "rotary": LinRotary's pairs, the merged QKV
    projection's rotary and cache append): _projection_ok on its projection (weight wq_v) with a as x, float x (a node
    that choose-decode-path gave int8 activations keeps its kernel, whose arithmetic the reference has;
    ATLAS_INT4_PATH=w4a16 / ATLAS_INT8_PATH=w8a16 give every node float x), b / g / the sum s contiguous and 16-byte
    aligned, g of K values, an even N when paired, and for rotary a W that rotary_warps finds."""
    from atlasc.ir.ops.quant import act_int8

    if node.op not in ("NormLinearQ", "NormLinearRotary") or act_int8(node.attrs.get("act", ""), m_upper):
        return False
    bits = OPS.get(node.attrs.get("linear", ""), 0)
    a_v, b_v, g_v = node.inputs[0], node.inputs[1], node.inputs[2]
    if not _projection_ok(ctx, bits, a_v, wq_v, m_upper, zp, group, k_static, n_upper) or (kind and n_upper % 2):
        return False
    warps = rotary_warps(node) if kind == "rotary" else 0
    if kind == "rotary" and not warps:
        return False
    if not all(_aligned(ctx, v) for v in (b_v, g_v, s_v) if v is not None):
        return False
    if len(g_v.shape) != 1 or ctx.upper(g_v.shape[0]) != k_static:
        return False
    return plan(n_upper, k_static, bits, bool(kind), k_static, warps) is not None


def plan(n: int, k: int, bits: int, gated: bool = False, norm_k: int = 0,
         warps: int = 0) -> tuple[int, int, int, int, int, int] | None:
    """(W, STAGES, blocks per SM, tiles, K runs, stages per run) of an N x K projection (gated: N / 2 pairs, tiles of
    8 W; norm_k: a norm source over K): config()'s (warps: W instead, e.g. rotary_warps), with fewer stages (down to
    2) where its shared memory would not fit a block, and as many K runs as ks_split's runs of ceil(steps / ks)
    stages fill (a forced split leaves no empty run); None where even 2 stages do not fit (quant.cu serves it)."""
    w, stages, blocks = config()
    w = warps or w
    tiles, steps = -(-(n // 2 if gated else n) // (8 * w if gated else 16 * w)), k // STAGE_K[bits]
    run = -(-steps // ks_split(tiles, steps))
    while stages > 2 and smem_bytes(w, stages, run, bits, norm_k) > SMEM_LIMIT:
        stages -= 1
    if smem_bytes(w, stages, run, bits, norm_k) > SMEM_LIMIT:
        return None
    return w, stages, blocks, tiles, -(-steps // run), run


def emit(ctx: KernelContext, node, has_bias: str, k: int, n: int, head: list[str], src: str = "", epi: str = "",
         norm_k: int = 0, early_g: bool = False) -> KernelCode:
    """The kernel body calling linear_quant_bulk after the statements `head` (which declare M; the caller bound y,
    wq, wscale, bias and bias_stride, and x or the norm source; eligible() or eligible_norm() said yes), with its
    grid, block, shared memory, scratch and tensor map (uint8 for int8 codes too: the copy engine moves bytes).
    src: the x source expression (default: the View x, QbPlain); epi: the paired epilogue's name ("": plain);
    norm_k: K for a norm source (its shared memory); early_g: the norm source reads its scale before the wait
    (recorded)."""
    from atlasc.codegen import quant

    bits = OPS[node.attrs.get("linear", node.op)]
    warps = rotary_warps(node) if node.op == "NormLinearRotary" else 0
    w, stages, blocks, tiles, ks, run = plan(n, k, bits, bool(epi), norm_k, warps)
    chain = ctx.chain_phase  # a chain's phase (quant_chain.py): its ring's stages, no loop (a static schedule)
    if chain is not None:
        stages = chain.stages
    rows = 16 * w
    mode = quant.ofs_choice()
    ofs = bits == 4 and (mode == "1" or (mode == "auto" and n >= quant.OFS_MIN_N))
    early = early_choice()
    inflight = inflight_choice() if inflight_choice() < stages else 0
    hold = hold_choice()
    r = len(node.inputs[0].shape)
    src = src or f"atlas::QbPlain<{r}{', true' if chain is not None else ''}>{{x}}"
    wq_v = node.inputs[WEIGHT_INPUT.get(node.op, 1)]
    tw = ctx.tensor_map_address(wq_v, n, 8 * w if epi else rows, "uint8")
    ws = f"reinterpret_cast<float*>({ctx.scratch_address(0)})" if ks > 1 else "nullptr"
    grid = loop_grid(tiles, ks) if chain is None else 0
    counters, scratch = (tiles, tiles * ks * rows * 4) if ks > 1 else (1, 0) if grid else (0, 0)
    cnt = f"reinterpret_cast<unsigned int*>({ctx.counters_address()})" if counters else "nullptr"
    args = f"{tw}, wscale, {src}, bias, bias_stride, y, M, {n}, {k}, {ws}, {cnt}, {ks}{', ' + epi if epi else ''}"
    if chain is None:
        call = (f"  atlas::linear_quant_bulk<{r}, {bits}, {w}, {stages}, {has_bias}, {str(ofs).lower()}, "
                f"{str(early).lower()}, {inflight}, {str(hold).lower()}>({args});")
    else:
        call = (f"  atlas::qb_chain_phase<{r}, {bits}, {chain.warps}, {w}, {stages}, {has_bias}, {str(ofs).lower()}, "
                f"{inflight}, {str(hold).lower()}, {str(chain.first).lower()}, {str(chain.last).lower()}>(qb_ring, "
                f"{args});")
    body = "\n".join([*head, f"  {SM90A_MARKER}", call])
    choice = {"path": "bulk", "config": [w, stages, blocks], "ks": ks, "ofs": ofs, "early": early,
              "inflight": inflight, "hold": hold}
    if norm_k:
        choice["norm"] = True
        if early_g:
            choice["g_early"] = True
    if epi:
        choice["paired"] = True
    if node.op == "NormLinearRotary":
        choice["rotary"] = True
    if grid:
        choice["loop"] = grid
    return KernelCode(body, (grid or tiles * ks, 1, 1), (32 * w + 32, 1, 1),
                      smem=smem_bytes(w, stages, run, bits, norm_k), scratch=scratch, counters=counters, choice=choice,
                      min_blocks=blocks, waits_inside=early)
