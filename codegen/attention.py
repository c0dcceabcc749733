"""Attention (opset 23), RotaryEmbedding (opset 23), KVAppend and QKVRotary: device code in attention.cu.

The emitters reduce every layout to rank-4 Views by strides alone: Attention's 3-D [B, S, H*D]
tensors become [B, H, S, D] views (head stride D * elem stride), RotaryEmbedding's input and output
become [B, S, H, D] views (a 4-D [B, H, S, D] input just permutes its strides), attention masks are
right-aligned to [B, Hq, Sq, mask_len] with stride 0 on broadcast dims. KV-cache views (strided K/V
inputs, KVAppend's `present`) therefore need no special case in the kernels.

Attention has two kernels, chosen at code generation by the environment variable ATLAS_ATTENTION_PATH:
- "fast" (the default, also when unset): `attention_decode`, the decode path: one block of
  fast_warps() warps per (batch, kv head, tile of up to FAST_MAX_ROWS query rows of that kv head's
  group), so each K/V row is read once for all the query heads that share it; a lane scores a whole
  key row with 16-byte loads (32 keys per warp at once), lanes split the head dim for V. Emitted for
  fp16 / fp32, Dk == Dv a compile-time head dim of at most FAST_MAX_HEAD_DIM whose 16-byte vectors
  pack into a warp (fp16: 8, 16, 32, 64, 128, 256; fp32: 4 ... 256), unit stride along the head dim,
  optional past, bool / additive mask, causal; `fast_decline` names why a node keeps `attention_rows`
  (softcap, qk or present outputs, other head dims, a non-unit head-dim stride). At run time the kernel
  also checks that K/V rows are 16-byte aligned and otherwise runs attention_rows itself. float16 at head
  dim 64 or 128 computes the scores and values on tensor cores (MMA, ATLAS_ATTENTION_MMA; default on).
- "rows": `attention_rows` everywhere, one block per (batch, query head, query row) whose warps walk
  the keys one at a time. Every variant (softcap, qk / present outputs, any layout).
Measured on the H200 (docs/perf.md v5, `python3 examples/attention_lab.py`): fast is 3.5-12x faster
than rows at 256 and 4096 keys, batch 1 and 32.
Any other value of ATLAS_ATTENTION_PATH is a CodegenError.
Prefill: with ATLAS_ATTENTION_PREFILL=fa2 (the default; =off turns it off) the prefill-sized fp16 nodes
flash_attention.fa2_decline accepts run `attention_fa2` instead (flash_attention.py / .cu: FlashAttention-2
on tensor cores); the others keep the kernel chosen above, the decline reason recorded in the report.
Both kernels take a `KEYS` variant for key_mask=1 nodes (pass mask-as-lengths, ATLAS_MASK_LENGTHS=1):
the mask input is attention_mask [B, T] (int64 / int32 / bool), viewed as [B, Hq, Sq, T] with stride 0
on heads and queries, and the kernel applies causal / window and the export's fill itself
(attention.cu key_bias_of); compile-checked, not yet run on a GPU.
"""

from __future__ import annotations

import os

from atlasc.codegen import flash_attention
from atlasc.codegen.cexpr import c_type
from atlasc.codegen.generate import STRIDE_GRID, CodegenError, KernelCode, KernelContext, emitter
from atlasc.codegen.linear import EARLY_WAVE_SMS, early_mode
from atlasc.errors import env_switch
from atlasc.ir import symbolic as S
from atlasc.ir.dtypes import to_numpy
from atlasc.ir.graph import Node, Value
from atlasc.ir.ops.kvcache import KINDS

ATT_THREADS = 128
FLOATS = ("float32", "float16")
MAX_HEAD_DIM = 1024
PATH_ENV = "ATLAS_ATTENTION_PATH"
PATHS = ("rows", "fast")
FAST_WARPS = 8  # NW of attention_decode: warps per block, splitting the keys
# ... but 4 in a kernel that runs only batches above FAST_WARPS_WIDE_BATCH (a decode batch bucket's default
# kernel) on tensor cores (MMA, head dims 64 and 128: 8B shapes at batch 32 18.4 vs 23.3 us at 256 keys, 155.4 vs
# 164.9 at 4096; 1B 11.8 vs 15.7 and 114.6 vs 119.0, docs/perf.md v15), or on the SIMT path at head dim 128
# (22.6 vs 26.7 us at 256 keys, v14; 8 warps won there for head dim 64); 8 at batch 1 everywhere
FAST_WARPS_WIDE = 4
FAST_WARPS_WIDE_HEAD_DIM = 128
FAST_WARPS_WIDE_BATCH = 8
FAST_MAX_ROWS = 8  # R: query rows per tile (a whole GQA group at decode up to group 8; 4 for D > 128)
FAST_MAX_HEAD_DIM = 256
FAST_MAX_SPLIT = 32  # SPLIT: runs of keys per item at most (the kernel picks fewer at run time)
FAST_SPLIT_SCRATCH = 64 << 20  # bytes of split partials at most
FAST_SPLIT_TARGET = 256  # ATT_SPLIT_TARGET of attention.cu: blocks the run-time split aims for (ceil(256 / items) runs)
# ... but a cap of one wave of an H200 for the 8-warp tensor-core kernel (the batch-1..8 decode kernels): its 168 / 250
# registers (ptxas sm90, head dim 64 / 128) fit one 256-thread block per SM, so 256 blocks took two waves. H200,
# attention_lab at 4096 keys, Llama-3-8B shapes, us (256 blocks -> 128): batch 2 22.20 -> 17.02, batch 4 30.49 ->
# 24.72, batch 8 45.97 -> 40.43; 1024 keys batch 8 22.92 -> 17.25 (docs/perf.md v39, run 3). An H200's SMs (also an
# H100 SXM's), as linear.py's: on a GPU with fewer (A100: 108) 132 blocks take a second, partial wave
SPLIT_WAVE_SMS = EARLY_WAVE_SMS
TARGET_ENV = "ATLAS_ATTENTION_SPLIT_TARGET"  # auto (split_target's rule) or a block count, for every kernel (A/B)
SPLIT_ENV = "ATLAS_ATTENTION_SPLIT"  # overrides FAST_MAX_SPLIT at code generation (1: no split), for A/B timing
FAST_SPLIT_MIN_KEYS = 256  # ATT_SPLIT_MIN_KEYS of attention.cu: keys per run at least (perf.md v14: 64 lost)
MIN_KEYS_ENV = "ATLAS_ATTENTION_SPLIT_MIN_KEYS"  # overrides FAST_SPLIT_MIN_KEYS (A/B timing of short contexts)
FAST_VPREFETCH = True  # VPF of attention.cu: V rows prefetched into L2 with the K reads (perf.md v14: won)
VPREFETCH_ENV = "ATLAS_ATTENTION_VPREFETCH"  # overrides FAST_VPREFETCH (0 / 1, A/B timing)
# MMA of attention.cu: scores and values on tensor cores (float16, head dim 64 / 128, sm80+). 8B shapes: batch 32,
# 4096 keys 252 -> 155 us, batch 1, 256 keys 10.9 -> 8.6 us (attention_lab, docs/perf.md v15)
FAST_MMA = True
MMA_ENV = "ATLAS_ATTENTION_MMA"  # overrides FAST_MMA (0 / 1, A/B timing)
MMA_HEAD_DIMS = (64, 128)
WARPS_ENV = "ATLAS_ATTENTION_WARPS"  # auto (fast_warps' rule), or 2, 4 or 8 for every kernel (A/B timing)
# EARLY_KV: a decode attention_decode asks L2 for its K / V rows before its pdl_enter (attention.cu
# attention_prefetch_kv), so they stream in while the QKV projection before it runs. Off: H200, 8 layers of Llama-3-8B
# shapes at batch 1, the decode step replayed alone 1242.0 -> 1237.8 us at 256 keys, 1294.1 -> 1293.0 at 4096
# (docs/perf.md v28): -0.3%, against the 1-2 us per attention predicted.
EARLY_KV = False
EARLY_KV_ENV = "ATLAS_ATTENTION_EARLY_KV"  # overrides EARLY_KV (0 / 1, A/B timing)
# WMERGE of attention.cu: the split's last run merges the runs' rows with a warp per row and a lane per run, every
# run's partials read at once (0: the first form, one thread per row walking the runs a few at a time). H200,
# batch 1 (attention_lab "fast" against "mmawm", docs/perf.md v34): 8B 4096 keys 16.83 -> 15.74 us, 1024 keys
# 11.69 -> 11.32; 1B 11.70 -> 10.08 and 8.90 -> 8.25; 256 keys (no split) unchanged
WARP_MERGE = True
WARP_MERGE_ENV = "ATLAS_ATTENTION_WARP_MERGE"  # overrides WARP_MERGE (0 / 1, A/B timing)


def path_choice() -> str:
    """ATLAS_ATTENTION_PATH (default "fast"); CodegenError for an unknown value."""
    path = os.environ.get(PATH_ENV, "") or "fast"
    if path not in PATHS:
        raise CodegenError(f"{PATH_ENV}={path!r} is not an Attention path (expected one of: {', '.join(PATHS)})")
    return path


def fast_smem(d: int, r: int, nw: int = FAST_WARPS) -> int:
    """attention_decode_smem<D, R, NW>() of attention.cu: row info, q tile, warps' partial states."""
    return 16 * ((12 * r + 15) // 16) + 4 * (r * d + nw * r * d + 3 * nw * r)


def fast_v_elems(d: int, itemsize: int) -> int | None:
    """EV of attention_decode: elements per lane and V load (a power of two, at most 16 bytes, up to
    d / 32 so that the lanes of a warp cover a row), such that d / EV lanes divide 32 or are a multiple
    of 32; None when the row is not whole 16-byte vectors (K loads) or no EV fits."""
    vec = 16 // itemsize
    if d <= 0 or d % vec:
        return None
    ev = 1
    while ev * 2 <= vec and ev * 2 * 32 <= d:
        ev *= 2
    while ev >= 1:
        lanes = d // ev
        if d % ev == 0 and (32 % lanes == 0 or lanes % 32 == 0):
            return ev
        ev //= 2
    return None


def _static_int(d) -> int | None:
    return None if S.is_symbolic(d) else int(d)


def _unit_last_stride(ctx: KernelContext, value: Value) -> bool:
    """value's innermost (head-dim) stride is 1: contiguous, or a view whose last stride is 1."""
    strides = ctx.plan.placement(value).strides
    return strides is None or (len(strides) > 0 and _static_int(strides[-1]) == 1)


def _declare4(ctx: KernelContext, name: str, t: str, base: str, dims: list[tuple[str, str]]) -> str:
    ctx.lines.append(f"  atlas::View<{t}, {len(dims)}> {name};")
    ctx.lines.append(f"  {name}.p = {base};")
    for i, (shape, stride) in enumerate(dims):
        ctx.lines.append(f"  {name}.shape[{i}] = {shape}; {name}.stride[{i}] = {stride};")
    return name


def _bhsd(ctx: KernelContext, value: Value, name: str, heads: int | None) -> str:
    """A [B, H, S, D] View of value: 4-D as is, 3-D [B, S, H*D] split by strides (heads given)."""
    if len(value.shape) == 4:
        return ctx.view(value, name)
    if len(value.shape) != 3 or not heads:
        raise CodegenError(f"{ctx.node.name}: {value.name} must be [B, H, S, D] or [B, S, H*D] with a head count")
    src = ctx.view(value, f"{name}_3d")
    t = c_type(value.dtype)
    hd = f"({src}.shape[2] / {heads}LL)"
    return _declare4(ctx, name, t, f"{src}.p", [
        (f"{src}.shape[0]", f"{src}.stride[0]"),
        (f"{heads}LL", f"{hd} * {src}.stride[2]"),
        (f"{src}.shape[1]", f"{src}.stride[1]"),
        (hd, f"{src}.stride[2]"),
    ])


def _placed(ctx: KernelContext, value: Value | None) -> bool:
    return value is not None and value.name in ctx.plan.placements


def _float_literal(x: float) -> str:
    return f"{float(x)!r}f"


def fast_decline(ctx: KernelContext, node: Node) -> str | None:
    """Why attention_decode does not serve this node (None: it does)."""
    ins = list(node.inputs) + [None] * (6 - len(node.inputs))
    q_v, k_v, v_v, _mask_v, pk_v, pv_v = ins[:6]
    outs = list(node.outputs) + [None] * (4 - len(node.outputs))
    attrs = node.attrs
    if (attrs.get("softcap", 0.0) or 0.0) > 0:
        return "softcap"
    if any(_placed(ctx, o) for o in outs[1:]):
        return "present or qk outputs"
    rank3 = len(q_v.shape) == 3
    if rank3:
        hq, hk = int(attrs.get("q_num_heads", 0) or 0), int(attrs.get("kv_num_heads", 0) or 0)
        if not hq or not hk:
            return "3-D inputs without head counts"
        dk, dv = S.floordiv(k_v.shape[2], hk), S.floordiv(v_v.shape[2], hk)
    else:
        hq, hk = _static_int(q_v.shape[1]), _static_int(k_v.shape[1])
        dk, dv = k_v.shape[3], v_v.shape[3]
    if hq is None or hk is None or hk <= 0 or hq % hk:
        return f"head counts {q_v.shape[1]} / {k_v.shape[1]} (static, q heads a multiple of kv heads)"
    d, d_v = _static_int(dk), _static_int(dv)
    if d is None or d != d_v:
        return f"head dims {dk} / {dv} (static and equal)"
    if d > FAST_MAX_HEAD_DIM or fast_v_elems(d, to_numpy(q_v.dtype).itemsize) is None:
        return (f"head dim {d} (whole 16-byte vectors per row, V lanes packing into a warp; "
                f"at most {FAST_MAX_HEAD_DIM})")
    for value in (k_v, v_v, pk_v, pv_v):
        if value is not None and not _unit_last_stride(ctx, value):
            return f"{value.name} has a non-unit stride along the head dim"
    return None


def _emit_fast(ctx: KernelContext, node: Node, flags: tuple[str, ...], acc: int, dk_up: int, dv_up: int,
               keys: bool = False) -> KernelCode:
    """attention_decode for a node fast_decline accepted (its args are already bound); dk_up / dv_up: the
    head dims' maxima (the kernel may run attention_rows itself, K/V rows not 16-byte aligned: its shared
    memory too)."""
    bind = list(ctx.lines)  # the args' bindings (_early_kv_prefetch repeats them before the wait)
    q_v, k_v = node.inputs[0], node.inputs[1]
    attrs = node.attrs
    t = c_type(q_v.dtype)
    if len(q_v.shape) == 3:
        hq, hk = int(attrs["q_num_heads"]), int(attrs["kv_num_heads"])
        d, sq = int(S.floordiv(k_v.shape[2], hk)), q_v.shape[1]
        batch = q_v.shape[0]
    else:
        hq, hk, d, sq, batch = int(q_v.shape[1]), int(k_v.shape[1]), int(k_v.shape[3]), q_v.shape[2], q_v.shape[0]
    group = hq // hk
    rows_up = group * ctx.upper(sq)
    # head dims over 128: half the rows (fp32, D 256, R 8 needs more than 255 registers: spills)
    r = max(1, min(FAST_MAX_ROWS if d <= 128 else FAST_MAX_ROWS // 2, rows_up))
    items = ctx.upper(batch) * hk * max(1, -(-rows_up // r))
    mask_t, has_past, has_mask, causal = flags
    ev = fast_v_elems(d, to_numpy(q_v.dtype).itemsize)
    mma = mma_setting() and mma_fits(q_v.dtype, d, r)
    nw = fast_warps(d, ctx.lower(batch), mma)
    rows_smem = 4 * (((dk_up + 3) // 4) * 4 + nw * (dv_up + 2))
    tmpl = f"{t}, {mask_t}, {d}, {ev}, {r}, {nw}, {acc}, {has_past}, {has_mask}, {causal}"
    split = fast_split(rows_up, r, items, d)
    target = split_target(nw, mma)
    scratch = counters = 0
    if split > 1:  # counters [items], work space [items][split][r][d + 2] floats (attention.cu: sequence split)
        counters, scratch = items, 4 * items * split * r * (d + 2)
        ctx.lines.append(f"  unsigned int* att_cnt = reinterpret_cast<unsigned int*>({ctx.counters_address()});")
        ctx.lines.append(f"  float* att_ws = reinterpret_cast<float*>({ctx.scratch_address(0)});")
        body = (f"  atlas::attention_decode<{tmpl}{decode_template_tail(split, keys, mma, target)}>"
                "(args, att_ws, att_cnt);")
    else:
        body = f"  atlas::attention_decode<{tmpl}{decode_template_tail(1, keys, mma)}>(args);"
    smem = max(fast_smem(d, r, nw), rows_smem)
    threads = nw * 32
    # a declaration of the wrapper that adds "at least 1 block per SM" to its launch bounds: without it
    # ptxas caps the registers at 128 for 2 blocks per SM and spills (sm80 and sm90, nvcc 13); with it
    # ptxas takes what the loads in flight need (ptxas -v: 110 to 200 registers, no spills)
    # ... except the fp16 split kernel at head dim 64: its bookkeeping took it from 124 registers (2 blocks
    # per SM) to 142 (1 block), 1.5x slower at batch 32 (attention_lab, docs/perf.md v5); asking for 2
    # blocks gives 128 registers without spills (ptxas, sm80 / sm90; fp32 or head dim 128 would spill:
    # tests/test_codegen_matmul_attention.py::test_attention_decode_compiles_without_spills)
    # ... and the tensor-core path, which holds its accumulators in registers (1 block: 224 at head dim 128; 2
    # blocks spilled at head dim 64, ptxas sm90)
    min_blocks = 2 if split > 1 and d <= 64 and q_v.dtype == "float16" and not mma else 1
    preamble = (f'extern "C" __global__ void __launch_bounds__({threads}, {min_blocks}) {ctx.kernel}'
                f"(unsigned char* __restrict__ arena);")
    # a grid of target blocks (items when more): a cap target (not FAST_SPLIT_TARGET) is never exceeded at run time
    # (attention.cu att_decode_splits rounds down); with FAST_SPLIT_TARGET (ceil(256 / items) runs) the maximal batch
    # leaves no block idle and a smaller batch in between may loop once more over the grid
    blocks = max(items, min(items * split, target))
    # ATLAS_EARLY_WEIGHTS=2 (linear.py): the next kernel, a projection, may launch right after the wait and load
    # its first weights while this one runs (at batch 1 most of this grid's blocks have no work)
    prefetch = ""
    if early_kv_setting() and ctx.upper(sq) == 1:
        prefetch = _early_kv_prefetch(ctx, node, bind, f"{t}, {mask_t}, {d}, {r}, {has_past}, {causal}, {split}, "
                                      f"{split_min_keys()}, {target}")
    return KernelCode(body, (max(1, min(STRIDE_GRID, blocks)), 1, 1), (threads, 1, 1), smem, preamble, scratch,
                      counters=counters, trigger_early=early_mode() == "2", prefetch=prefetch)


def _early_kv_prefetch(ctx: KernelContext, node: Node, bind: list[str], tmpl: str) -> str:
    """KernelCode.prefetch of ATLAS_ATTENTION_EARLY_KV: the args bound again in a scope of their own before the
    wait, then attention_prefetch_kv with the elements each K / V value's allocation holds from its base (its
    requests stay inside them whatever the dims buffer holds; the same in every batch bucket and, for KV-cache
    slots, every layer, so the kernels share as without it)."""
    ins = list(node.inputs) + [None] * (6 - len(node.inputs))
    k_v, v_v, pk_v, pv_v = ins[1], ins[2], ins[4], ins[5]

    def extent(value: Value | None) -> str:
        if value is None:
            return "0LL"
        return f"{ctx.plan.placement(value).nbytes // to_numpy(value.dtype).itemsize}LL"

    extents = ", ".join(extent(v) for v in (k_v, v_v, pk_v, pv_v))
    return "\n".join(["  {  // early KV (ATLAS_ATTENTION_EARLY_KV): this block's K / V rows into L2 before the wait",
                      "  const long long* __restrict__ d = reinterpret_cast<const long long*>("
                      f"arena + {ctx.plan.dims_offset}LL);",
                      "  (void)d;", *bind,
                      f"  atlas::attention_prefetch_kv<{tmpl}>(args, {extents});", "  }"])


def split_max() -> int:
    """ATLAS_ATTENTION_SPLIT (default FAST_MAX_SPLIT); CodegenError outside 1..FAST_MAX_SPLIT."""
    text = os.environ.get(SPLIT_ENV, "") or str(FAST_MAX_SPLIT)
    if not text.isdigit() or not 1 <= int(text) <= FAST_MAX_SPLIT:
        raise CodegenError(f"{SPLIT_ENV}={text!r} is not a split count (expected 1 to {FAST_MAX_SPLIT})")
    return int(text)


def split_target(nw: int, mma: bool) -> int:
    """TARGET of an attention_decode kernel of nw warps (attention.cu att_decode_splits: FAST_SPLIT_TARGET, the
    blocks its sequence split aims for, or any other value, a cap): ATLAS_ATTENTION_SPLIT_TARGET when set (1 to
    65536, every kernel's; "auto" as unset), else SPLIT_WAVE_SMS for the 8-warp tensor-core kernel (one block per
    SM) and FAST_SPLIT_TARGET for the others; CodegenError otherwise."""
    text = os.environ.get(TARGET_ENV, "") or "auto"
    if text == "auto":
        return SPLIT_WAVE_SMS if nw == 8 and mma else FAST_SPLIT_TARGET
    if not text.isdigit() or not 1 <= int(text) <= 65536:
        raise CodegenError(f"{TARGET_ENV}={text!r} is not a block count (expected auto or 1 to 65536)")
    return int(text)


def target_setting() -> str:
    """ATLAS_ATTENTION_SPLIT_TARGET as recorded in the artifact's codegen choices ("auto" when unset); CodegenError
    as split_target."""
    split_target(8, True)
    return os.environ.get(TARGET_ENV, "") or "auto"


def split_min_keys() -> int:
    """ATLAS_ATTENTION_SPLIT_MIN_KEYS (default FAST_SPLIT_MIN_KEYS): the fewest keys a run of the sequence
    split gets (the split cuts fewer runs at short contexts); CodegenError unless 1 to 65536."""
    text = os.environ.get(MIN_KEYS_ENV, "") or str(FAST_SPLIT_MIN_KEYS)
    if not text.isdigit() or not 1 <= int(text) <= 65536:
        raise CodegenError(f"{MIN_KEYS_ENV}={text!r} is not a key count (expected 1 to 65536)")
    return int(text)


def warps_setting() -> str:
    """ATLAS_ATTENTION_WARPS: "auto" (also when unset; fast_warps' rule), or "2", "4", "8" for every
    attention_decode kernel; CodegenError otherwise."""
    text = os.environ.get(WARPS_ENV, "") or "auto"
    if text not in ("auto", "2", "4", "8"):
        raise CodegenError(f"{WARPS_ENV}={text!r} is not a warp count (expected auto, 2, 4 or 8)")
    return text


def fast_warps(head_dim: int, batch_above: int, mma: bool = False) -> int:
    """Warps per attention_decode block for a kernel of this head dim that runs only batches above
    `batch_above` (0: any batch), on tensor cores or not (`mma`): ATLAS_ATTENTION_WARPS when set, else
    FAST_WARPS_WIDE above FAST_WARPS_WIDE_BATCH on tensor cores or at head dim FAST_WARPS_WIDE_HEAD_DIM,
    FAST_WARPS otherwise (fewer warps: less idle warps and a cheaper merge when a block's keys are few)."""
    text = warps_setting()
    if text != "auto":
        return int(text)
    wide = (mma or head_dim == FAST_WARPS_WIDE_HEAD_DIM) and batch_above >= FAST_WARPS_WIDE_BATCH
    return FAST_WARPS_WIDE if wide else FAST_WARPS


def v_prefetch() -> bool:
    """ATLAS_ATTENTION_VPREFETCH (default FAST_VPREFETCH, on): 1 has attention_decode prefetch each key's V row
    into L2 before it reads the K row, 0 not (the MMA path in 8-warp blocks loads a block's V with its K rows either
    way); CodegenError unless 0 or 1."""
    return env_switch(VPREFETCH_ENV, FAST_VPREFETCH, CodegenError)


def mma_setting() -> bool:
    """ATLAS_ATTENTION_MMA (default FAST_MMA): 1 runs attention_decode's scores and values on tensor cores where
    mma_fits; CodegenError unless 0 or 1."""
    return env_switch(MMA_ENV, FAST_MMA, CodegenError)


def warp_merge() -> bool:
    """ATLAS_ATTENTION_WARP_MERGE (default WARP_MERGE): 1 has the sequence split's last run merge the runs with a
    warp per query row (attention.cu WMERGE), 0 with a thread per row; CodegenError unless 0 or 1."""
    return env_switch(WARP_MERGE_ENV, WARP_MERGE, CodegenError)


def early_kv_setting() -> bool:
    """ATLAS_ATTENTION_EARLY_KV (default EARLY_KV, off): 1 has each decode attention_decode kernel (one query
    position) prefetch the K / V rows it will read into L2 before it waits for the kernel before it; CodegenError
    unless 0 or 1."""
    return env_switch(EARLY_KV_ENV, EARLY_KV, CodegenError)


def mma_fits(dtype: str, d: int, r: int) -> bool:
    """The tensor-core decode path serves float16 at head dim 64 or 128 with tiles of at most 8 query rows."""
    return dtype == "float16" and d in MMA_HEAD_DIMS and r <= 8


def decode_template_tail(split: int, keys: bool, mma: bool = False, target: int = FAST_SPLIT_TARGET) -> str:
    """The template arguments of attention_decode after its flags: SPLIT, KEYS, MIN_KEYS, VPF, MMA, WMERGE, TARGET,
    each given only up to the last one that differs from attention.cu's default (FAST_SPLIT_MIN_KEYS,
    FAST_VPREFETCH, WARP_MERGE and FAST_SPLIT_TARGET equal ATT_SPLIT_MIN_KEYS, VPF, WMERGE and ATT_SPLIT_TARGET
    there: the text names only what a switch changes; WMERGE and TARGET only with a split)."""
    args = [str(split), "true" if keys else "false", str(split_min_keys()), "true" if v_prefetch() else "false",
            "true" if mma else "false", "true" if (warp_merge() if split > 1 else WARP_MERGE) else "false",
            str(target if split > 1 else FAST_SPLIT_TARGET)]
    defaults = ["1", "false", str(FAST_SPLIT_MIN_KEYS), "true" if FAST_VPREFETCH else "false", "false",
                "true" if WARP_MERGE else "false", str(FAST_SPLIT_TARGET)]
    while args and args[-1] == defaults[len(args) - 1]:
        args.pop()
    return "".join(f", {a}" for a in args)


def fast_split(rows_up: int, r: int, items_up: int, d: int) -> int:
    """SPLIT of attention_decode: the most runs a (batch, kv head) item's keys may be cut into. Decode
    shapes only (one row tile per item: a whole GQA group at one query position); 1 elsewhere (prefill
    has tiles enough), and halved until the scratch fits FAST_SPLIT_SCRATCH. ATLAS_ATTENTION_SPLIT
    (1 to FAST_MAX_SPLIT) replaces FAST_MAX_SPLIT, e.g. 1 to time the kernel without the split."""
    if rows_up > r:
        return 1
    split = split_max()
    while split > 1 and 4 * items_up * split * r * (d + 2) > FAST_SPLIT_SCRATCH:
        split //= 2
    return split


def _bind_key_mask(ctx: KernelContext, node: Node, args: str, q: str, mask_v: Value) -> None:
    """key_mask=1 (mask-as-lengths): args.mask is attention_mask [B, T] viewed as [B, Hq, Sq, T] (stride 0
    on heads and queries) and the kernel applies causal / window itself (attention.cu key_bias_of)."""
    if mask_v is None or len(mask_v.shape) != 2 or mask_v.dtype not in ("int64", "int32", "bool"):
        raise CodegenError(f"{node.name}: Attention key_mask needs attention_mask [B, T] of int64, int32 or bool")
    if len(node.inputs) > 4:
        raise CodegenError(f"{node.name}: Attention key_mask with past inputs")
    src = ctx.view(mask_v, "mask_src")
    dims = [(f"{q}.shape[0]", f"{src}.stride[0]"), (f"{q}.shape[1]", "0LL"), (f"{q}.shape[2]", "0LL"),
            (f"{src}.shape[1]", f"{src}.stride[1]")]
    ctx.lines.append(f"  {args}.mask = {_declare4(ctx, 'mask', c_type(mask_v.dtype), f'{src}.p', dims)};")
    attrs = node.attrs
    fill = float(attrs.get("mask_fill", float("-inf")))
    ctx.lines.append(f"  {args}.keys_causal = {int(bool(attrs.get('causal', 0)))}; "
                     f"{args}.keys_window = {int(attrs.get('window', 0) or 0)}LL; "
                     f"{args}.keys_fill = {'-INFINITY' if fill == float('-inf') else _float_literal(fill)};")


@emitter("Attention")
def emit_attention(ctx: KernelContext, node: Node) -> KernelCode:
    ins = list(node.inputs) + [None] * (6 - len(node.inputs))
    q_v, k_v, v_v, mask_v, pk_v, pv_v = ins[:6]
    outs = list(node.outputs) + [None] * (4 - len(node.outputs))
    y_v, presk_v, presv_v, qk_v = outs[:4]
    attrs = node.attrs
    dt = q_v.dtype
    path = path_choice()
    if dt not in FLOATS:
        raise CodegenError(f"{node.name}: Attention on {dt} (supported: {', '.join(FLOATS)})")
    if (pk_v is None) != (pv_v is None):
        raise CodegenError(f"{node.name}: Attention needs both past_key and past_value, or neither")
    t = c_type(dt)
    rank3 = len(q_v.shape) == 3
    hq = int(attrs.get("q_num_heads", 0) or 0) if rank3 else None
    hk = int(attrs.get("kv_num_heads", 0) or 0) if rank3 else None
    if rank3:
        dv_dim = S.floordiv(v_v.shape[2], hk)
        dk_dim = S.floordiv(k_v.shape[2], hk)
    else:
        dv_dim, dk_dim = v_v.shape[3], k_v.shape[3]
    dk_up, dv_up = ctx.upper(dk_dim), ctx.upper(dv_dim)
    if max(dk_up, dv_up) > MAX_HEAD_DIM:
        raise CodegenError(f"{node.name}: Attention head dim up to {max(dk_up, dv_up)} exceeds {MAX_HEAD_DIM}")
    acc = max(1, -(-dv_up // 32))

    args = "args"
    ctx.lines.append(f"  atlas::AttnArgs<{t}, {c_type(mask_v.dtype) if mask_v is not None else 'bool'}> {args};")
    q = _bhsd(ctx, q_v, "q", hq)
    k = _bhsd(ctx, k_v, "k", hk)
    v = _bhsd(ctx, v_v, "v", hk)
    y = _bhsd(ctx, y_v, "y", hq if rank3 else (q_v.shape[1] if attrs.get("out_bshd") else None))
    for field, name in (("q", q), ("k", k), ("v", v), ("y", y)):
        ctx.lines.append(f"  {args}.{field} = {name};")
    has_past = pk_v is not None
    if has_past:
        ctx.lines.append(f"  {args}.pk = {ctx.view(pk_v, 'pk', rank=4)};")
        ctx.lines.append(f"  {args}.pv = {ctx.view(pv_v, 'pv', rank=4)};")
        ctx.lines.append(f"  {args}.past = pk.shape[2];")
    else:
        ctx.lines.append(f"  {args}.pk = k; {args}.pv = v; {args}.past = 0;")
    present = 0
    for bit, (field, value) in enumerate((("present_k", presk_v), ("present_v", presv_v))):
        if _placed(ctx, value):
            present |= 1 << bit
            ctx.lines.append(f"  {args}.{field} = {ctx.view(value, field, rank=4)};")
        else:
            ctx.lines.append(f"  {args}.{field} = y;")
    qk_mode = -1
    if _placed(ctx, qk_v):
        qk_mode = int(attrs.get("qk_matmul_output_mode", 0) or 0)
        if qk_mode not in (0, 1, 2, 3):
            raise CodegenError(f"{node.name}: Attention qk_matmul_output_mode {qk_mode} (0..3 supported)")
        ctx.lines.append(f"  {args}.qk = {ctx.view(qk_v, 'qk', rank=4)};")
    else:
        ctx.lines.append(f"  {args}.qk = y;")
    has_mask = mask_v is not None
    keys = bool(attrs.get("key_mask", 0))
    if keys:
        _bind_key_mask(ctx, node, args, q, mask_v)
    elif has_mask:
        if mask_v.dtype not in ("bool", dt):
            raise CodegenError(f"{node.name}: Attention mask dtype {mask_v.dtype} (bool or {dt} supported)")
        mr = len(mask_v.shape)
        if not 1 <= mr <= 4:
            raise CodegenError(f"{node.name}: Attention mask of rank {mr}")
        msrc = ctx.view(mask_v, "mask_src")
        mt = c_type(mask_v.dtype)
        target = [f"{q}.shape[0]", f"{q}.shape[1]", f"{q}.shape[2]"]
        dims = []
        for i in range(3):
            j = i - (4 - mr)
            if j < 0 or mask_v.shape[j] == 1:
                dims.append((target[i], "0LL"))
            else:
                dims.append((target[i], f"{msrc}.stride[{j}]"))
        # the last dim never broadcasts: keys beyond its length are masked (padding, like the reference)
        dims.append((f"{msrc}.shape[{mr - 1}]", f"{msrc}.stride[{mr - 1}]"))
        ctx.lines.append(f"  {args}.mask = {_declare4(ctx, 'mask', mt, f'{msrc}.p', dims)};")
    else:
        ctx.lines.append(f"  {args}.mask.p = nullptr;")
    ctx.lines.append(f"  {args}.scale = {_float_literal(attrs.get('scale', 0.0) or 0.0)};")
    ctx.lines.append(f"  {args}.softcap = {_float_literal(attrs.get('softcap', 0.0) or 0.0)};")
    mask_t = c_type(mask_v.dtype) if has_mask else "bool"
    causal = bool(attrs.get("is_causal", 0))
    flags = (mask_t, str(has_past).lower(), str(has_mask).lower(), str(causal).lower())
    fa2_declined = None
    if flash_attention.prefill_choice() == "fa2":
        fa2_declined = flash_attention.fa2_decline(ctx, node)
        if fa2_declined is None:
            return flash_attention.emit_fa2(ctx, node, flags, acc, keys)
    if path == "fast" and fast_decline(ctx, node) is None:
        code = _emit_fast(ctx, node, flags, acc, dk_up, dv_up, keys)
        if fa2_declined:
            code.choice = {"attention": "fast", "fa2_declined": fa2_declined}
        return code
    tmpl = (f"{t}, {mask_t}, {acc}, {str(has_past).lower()}, {str(has_mask).lower()}, "
            f"{str(causal).lower()}, {present}, {qk_mode}{', true' if keys else ''}")
    body = f"  atlas::attention_rows<{tmpl}>({args});"
    rows = ctx.numel_upper(y_v) // max(1, dv_up)
    smem = 4 * (((dk_up + 3) // 4) * 4 + (ATT_THREADS // 32) * (dv_up + 2))
    choice = {"attention": "rows", "fa2_declined": fa2_declined} if fa2_declined else None
    # dims_late: holding the dims from before the wait spilled this kernel (fp32, qk and present outputs: 16 bytes
    # on sm80, tests/test_codegen_matmul_attention.py::test_attention_decode_compiles_without_spills)
    return KernelCode(body, ctx.grid_for(rows, 1), (ATT_THREADS, 1, 1), smem, choice=choice, dims_late=True)


@emitter("RotaryEmbedding")
def emit_rotary(ctx: KernelContext, node: Node) -> KernelCode:
    x_v, cos_v, sin_v = node.inputs[:3]
    pos_v = node.inputs[3] if len(node.inputs) > 3 else None
    out_v = node.outputs[0]
    attrs = node.attrs
    if x_v.dtype not in FLOATS:
        raise CodegenError(f"{node.name}: RotaryEmbedding on {x_v.dtype} (supported: {', '.join(FLOATS)})")
    t = c_type(x_v.dtype)
    ct = c_type(cos_v.dtype)
    views = []
    for value, name in ((x_v, "x"), (out_v, "out")):
        if len(value.shape) == 4:  # [B, H, S, D] -> [B, S, H, D]
            src = ctx.view(value, f"{name}_src")
            dims = [(f"{src}.shape[{i}]", f"{src}.stride[{i}]") for i in (0, 2, 1, 3)]
        elif len(value.shape) == 3:
            heads = int(attrs.get("num_heads", 0) or 0)
            if not heads:
                raise CodegenError(f"{node.name}: rank-3 RotaryEmbedding needs num_heads")
            src = ctx.view(value, f"{name}_src")
            hd = f"({src}.shape[2] / {heads}LL)"
            dims = [(f"{src}.shape[0]", f"{src}.stride[0]"), (f"{src}.shape[1]", f"{src}.stride[1]"),
                    (f"{heads}LL", f"{hd} * {src}.stride[2]"), (hd, f"{src}.stride[2]")]
        else:
            raise CodegenError(f"{node.name}: RotaryEmbedding input must be rank 3 or 4")
        views.append(_declare4(ctx, name, t, f"{src}.p", dims))
    has_pos = pos_v is not None
    for value, name in ((cos_v, "cs"), (sin_v, "sn")):
        src = ctx.view(value, f"{name}_src")
        if has_pos:
            if len(value.shape) != 2:
                raise CodegenError(f"{node.name}: cos/sin caches must be [max_pos, rot/2] with position_ids")
            dims = [(f"{src}.shape[0]", f"{src}.stride[0]"), ("1LL", "0LL"), (f"{src}.shape[1]", f"{src}.stride[1]")]
        else:
            if len(value.shape) != 3:
                raise CodegenError(f"{node.name}: cos/sin must be [B, S, rot/2] without position_ids")
            dims = [(f"{src}.shape[{i}]", f"{src}.stride[{i}]") for i in range(3)]
        _declare4(ctx, name, ct, f"{src}.p", dims)
    if has_pos:
        if pos_v.dtype != "int64":
            raise CodegenError(f"{node.name}: position_ids must be int64, got {pos_v.dtype}")
        ctx.view(pos_v, "pos", rank=2)
    else:
        ctx.lines.append("  atlas::View<long long, 2> pos; pos.p = nullptr;")
    rot_attr = int(attrs.get("rotary_embedding_dim", 0) or 0)
    rot = f"{rot_attr}LL" if rot_attr else "out.shape[3]"
    interleaved = bool(attrs.get("interleaved", 0))
    body = (f"  atlas::rotary<{t}, {ct}, {str(has_pos).lower()}, {str(interleaved).lower()}>"
            f"(x, out, cs, sn, pos, {rot});")
    return KernelCode(body, ctx.grid_for(ctx.numel_upper(out_v)))


def kv_slot_offset(kv: dict, layer: int, kind: str) -> int:
    """Arena byte offset of cache[layer, kind, 0, 0, 0, 0]."""
    slot = kv["max_batch"] * kv["kv_heads"] * kv["max_seq"] * kv["head_dim"]
    return kv["offset"] + (layer * 2 + KINDS.index(kind)) * slot * to_numpy(kv["dtype"]).itemsize


@emitter("KVAppend")
def emit_kv_append(ctx: KernelContext, node: Node) -> KernelCode:
    x_v, out_v = node.inputs[0], node.outputs[0]
    kv = ctx.kv_cache
    if kv is None:
        raise CodegenError(f"{node.name}: KVAppend without a KV cache in the module")
    layer, kind = int(node.attrs["layer"]), node.attrs["kind"]
    if kind not in KINDS or not 0 <= layer < kv["layers"]:
        raise CodegenError(f"{node.name}: KVAppend layer {layer} kind {kind!r} outside the cache")
    if x_v.dtype != kv["dtype"]:
        raise CodegenError(f"{node.name}: KVAppend of {x_v.dtype} into a {kv['dtype']} cache")
    for axis, key in ((1, "kv_heads"), (3, "head_dim")):
        d = x_v.shape[axis]
        if not S.is_symbolic(d) and int(d) != kv[key]:
            raise CodegenError(f"{node.name}: KVAppend input dim {axis} is {d}, the cache's {key} is {kv[key]}")
    _check_cache_view(ctx, node, out_v, layer, kind)
    t = c_type(x_v.dtype)
    ctx.view(x_v, "x", rank=4)
    ctx.view(out_v, "present", rank=4)
    past = ctx.dim(node.attrs["past"])
    body = f"  atlas::kv_append<{t}>(x, present, {past}, {kv['max_batch']}LL, {kv['max_seq']}LL);"
    return KernelCode(body, ctx.grid_for(ctx.numel_upper(x_v)))


def _check_cache_view(ctx: KernelContext, node: Node, out_v: Value, layer: int, kind: str) -> None:
    """out_v must be placed on the cache slot of (layer, kind) with the cache's strides."""
    kv = ctx.kv_cache
    placement = ctx.plan.placement(out_v)
    want = kv_slot_offset(kv, layer, kind)
    if placement.offset != want:
        raise CodegenError(f"{node.name}: {node.op} output {out_v.name} must be placed on the cache slot "
                           f"(offset {want}), found offset {placement.offset}")
    strides = (kv["kv_heads"] * kv["max_seq"] * kv["head_dim"], kv["max_seq"] * kv["head_dim"], kv["head_dim"], 1)
    if placement.strides is None or tuple(S.dim(s) for s in placement.strides) != tuple(S.dim(s) for s in strides):
        raise CodegenError(f"{node.name}: {node.op} output {out_v.name} must be a cache view with strides "
                           f"{strides}, found {placement.strides}")


def bind_qkv_rotary(ctx: KernelContext, node: Node, dtype: str, cos_v: Value | None, sin_v: Value | None,
                    q_v: Value, pk_v: Value, pv_v: Value) -> tuple[int, int, int, int, str]:
    """Check a QKVRotary-like node against the module's cache and declare the views cs, sn (cos / sin:
    empty tables without rotary), q, pk and pv; returns (q_heads, kv_heads, head_dim, layer, past)."""
    kv = ctx.kv_cache
    if kv is None:
        raise CodegenError(f"{node.name}: {node.op} without a KV cache in the module")
    if dtype not in FLOATS or dtype != kv["dtype"]:
        raise CodegenError(f"{node.name}: {node.op} of {dtype} into a {kv['dtype']} cache")
    hq, hk, d, layer = (int(node.attrs[k]) for k in ("q_heads", "kv_heads", "head_dim", "layer"))
    if hk != kv["kv_heads"] or d != kv["head_dim"] or not 0 <= layer < kv["layers"]:
        raise CodegenError(f"{node.name}: {node.op} heads {hk} x {d} of layer {layer} do not fit the cache")
    for out_v, kind in ((pk_v, "key"), (pv_v, "value")):
        _check_cache_view(ctx, node, out_v, layer, kind)
    t = c_type(dtype)
    if cos_v is not None:
        ctx.view(cos_v, "cs", rank=3)
        ctx.view(sin_v, "sn", rank=3)
    else:  # no rotary: rotary width 0, the tables are never read
        for name in ("cs", "sn"):
            ctx.lines.append(f"  atlas::View<{t}, 3> {name}; {name}.p = nullptr;")
            ctx.lines.append(f"  for (int i = 0; i < 3; ++i) {{ {name}.shape[i] = i == 2 ? 0 : 1; "
                             f"{name}.stride[i] = 0; }}")
    ctx.view(q_v, "q", rank=4)
    ctx.view(pk_v, "pk", rank=4)
    ctx.view(pv_v, "pv", rank=4)
    return hq, hk, d, layer, ctx.dim(node.attrs["past"])


@emitter("QKVRotary")
def emit_qkv_rotary(ctx: KernelContext, node: Node) -> KernelCode:
    qkv_v = node.inputs[0]
    cos_v, sin_v = (node.inputs[1], node.inputs[2]) if len(node.inputs) > 1 else (None, None)
    q_v, pk_v, pv_v = node.outputs
    hq, hk, d, _, past = bind_qkv_rotary(ctx, node, qkv_v.dtype, cos_v, sin_v, q_v, pk_v, pv_v)
    kv = ctx.kv_cache
    t = c_type(qkv_v.dtype)
    ctx.view(qkv_v, "qkv", rank=3)
    body = (f"  atlas::qkv_rotary<{t}>(qkv, cs, sn, q, pk, pv, {hq}LL, {hk}LL, {d}LL, {past}, "
            f"{kv['max_batch']}LL, {kv['max_seq']}LL);")
    return KernelCode(body, ctx.grid_for(ctx.numel_upper(qkv_v)))
