"""The copy-engine + wgmma decode projection (linear_tma.cu) for the batch-9..32 kernels of an sm90-only compile.

linear.cu's MMA decode holds each round of weights in registers: at 32 rows it streams the Llama-3-8B projections
at 52-76% of 4.30 TB/s, where cuBLAS reaches 72-92% (docs/perf.md v30). linear_tma_decode keeps up to ~200 KB of
weights in flight per SM in shared-memory stages the copy engine fills, multiplied there by wgmma; the H200 lab
(examples/wgmma_lab.py: the same pipeline, plain outputs only) measured it at 1.05-1.35x the MMA decode's speed on
every 8B shape.

The producer warp's lanes return as soon as the block starts, so each block lets the next kernel launch
(atlas::pdl_leave in the wrapper) at its start rather than at its end: the dependent kernel's blocks still wait in
pdl_enter, and it launches only once the last wave of this grid is resident (the trigger counts per block).
Measured as such (docs/perf.md v30).

It serves a float16 Linear, LinearGated (SwiGLU pairs) or LinearRotary (the pairs of 128-dim heads rotated
whole or not at all), and NormLinear / NormLinearRotary (the same with the (Add)RMSNormalization of x as the
kernel's prologue: linear_tma.cu's NORM; fuse-linear-prologue makes them at these rows only where this path
serves them, fold-norm-scale moves their norms' scales into the weights: ATLAS_TMA_NORM), whose kernel runs only
above 8 rows and at most 32 (the decode step's batch-9..32 kernels:
KernelContext's lower bound), when the compile targets sm90 alone (the cubin is built for sm_90a: nvcc.py), x is a
contiguous [rows, K] activation, K % 64 == 0 and the weight is contiguous. Its tensor maps (weight and x) are
written into the arena by the runtime at load (generate.TensorMapTable). ATLAS_LINEAR_TMA=0 turns it off (the MMA
decode as before); ATLAS_LINEAR_TMA_PLAIN / _GATED / _HEADS=NC-CH-S override a layout's configuration (A/B timing);
ATLAS_LINEAR_TMA_HEADS_KS=1|2|4 sets the heads layout's K runs (default 2), ATLAS_LINEAR_TMA_KS_MIN_STEPS the plain
layout's rule below, ATLAS_LINEAR_TMA_PIPE=1 keeps a stage's wgmma group in flight (opt-in; measured neutral).

Configurations (NC consumer warpgroups, CH chains of 64 rows, S stages; the lab's best per 8B shape at M = 32):
plain 1-1-8 (QKV 16.44 us, o 14.61, LM head 254.67; down 38.38 with its K split 4 ways), gated 2-2-3 (gate/up
59.94), heads 1-2-10 (QKV 18.91). A plain projection splits K into KS runs when each run keeps >= KS_MIN_STEPS
64-k steps and the grid stays <= KS_MAX_BLOCKS (down: 4; o: 2; the LM head: 1). The lab's splits lost on o; in the
8-layer decode step (examples/step_ab.sh, docs/perf.md v32) o's 2 runs won (-1.5% a step), as did the heads
layout's 2 runs (QKV + rotary, 48 -> 96 blocks: -0.8%).
"""

from __future__ import annotations

import os

import numpy as np

from atlasc.codegen.generate import CodegenError, KernelCode, KernelContext
from atlasc.codegen.nvcc import SM90A_MARKER  # a kernel using wgmma carries it (nvcc.py builds it for sm_90a)
from atlasc.errors import env_switch
from atlasc.ir.archs import COPY_ENGINE_ENV, copy_engine, copy_engine_switch

TMA_ENV = COPY_ENGINE_ENV
OPS = ("Linear", "LinearGated", "LinearRotary", "NormLinear", "NormLinearRotary")
NORM_OPS = ("NormLinear", "NormLinearRotary")
NORM_NAMES = {0: "atlas::TMA_NONE", 1: "atlas::TMA_RMS", 2: "atlas::TMA_ADD_RMS"}
PLAIN, GATED, HEADS = 0, 1, 2
CONFIG = {PLAIN: (1, 1, 8), GATED: (2, 2, 3), HEADS: (1, 2, 10)}  # NC, CH, STAGES
# per-layout overrides for A/B timing, "NC-CH-S" (e.g. ATLAS_LINEAR_TMA_GATED=2-2-4), checked by config()
CONFIG_ENVS = {PLAIN: "ATLAS_LINEAR_TMA_PLAIN", GATED: "ATLAS_LINEAR_TMA_GATED", HEADS: "ATLAS_LINEAR_TMA_HEADS"}
SMEM_LIMIT = 227 * 1024 - 1024  # an sm90 block's shared memory, less 1 KB for the kernel's static arrays (~170 B)
LAYOUT_NAMES = {PLAIN: "atlas::TMA_PLAIN", GATED: "atlas::TMA_GATED", HEADS: "atlas::TMA_HEADS"}
HEADS_KS_ENV = "ATLAS_LINEAR_TMA_HEADS_KS"  # K runs of the heads layout without a norm (default 2)
PIPE_ENV = "ATLAS_LINEAR_TMA_PIPE"  # 1: a stage's wgmma group stays in flight while the next stage's issues
KS_MIN_STEPS = 32
KS_MIN_STEPS_ENV = "ATLAS_LINEAR_TMA_KS_MIN_STEPS"  # override of KS_MIN_STEPS (A/B timing)
KS_MAX_BLOCKS = 264
MIN_ROWS = 8  # the path serves kernels that run only above this many rows
MAX_ROWS = 32  # wgmma's N: the x rows of a stage
HEAD_DIM = 128


def tma_choice() -> bool:
    """ATLAS_LINEAR_TMA (default 1); an error (exit 2) for a value not 0 or 1 (atlasc/ir/archs.py)."""
    return copy_engine_switch()


def targets(archs: tuple[str, ...]) -> bool:
    """Whether a compile for `archs` may use the path: sm90 alone, the switch on."""
    return copy_engine(archs)


def config(layout: int) -> tuple[int, int, int]:
    """(NC, CH, STAGES) of a layout: CONFIG's, or its CONFIG_ENVS override. CodegenError for an override that is not
    NC-CH-S, whose tile would exceed a tensor-map box (256 rows), whose paired layout has CH != 2, or whose stages
    do not fit a block's shared memory."""
    name = CONFIG_ENVS[layout]
    value = os.environ.get(name, "")
    if not value:
        return CONFIG[layout]
    parts = value.split("-")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise CodegenError(f"{name}={value!r} is not NC-CH-STAGES (e.g. 2-2-4)")
    nc, ch, stages = (int(p) for p in parts)
    box = 64 * ch * nc if layout == PLAIN else 64 * nc if layout == GATED else HEAD_DIM * nc
    if (layout != PLAIN and ch != 2) or box > 256 or nc > 7 or smem_bytes(nc, ch, stages) > SMEM_LIMIT:
        raise CodegenError(f"{name}={value!r}: needs {'CH = 2, ' if layout != PLAIN else ''}a box of at most 256 "
                           f"rows (has {box}) and at most {SMEM_LIMIT} bytes of stages (has "
                           f"{smem_bytes(nc, ch, stages)})")
    return nc, ch, stages


def heads_ks() -> int:
    """ATLAS_LINEAR_TMA_HEADS_KS (default 2): K runs of a heads-layout projection without a norm prologue (one run
    leaves 48 blocks on the 8B QKV; two measured -0.8% a decode step: docs/perf.md v32); CodegenError unless 1, 2
    or 4."""
    value = os.environ.get(HEADS_KS_ENV, "") or "2"
    if value not in ("1", "2", "4"):
        raise CodegenError(f"{HEADS_KS_ENV}={value!r} is not 1, 2 or 4")
    return int(value)


def pipe() -> int:
    """ATLAS_LINEAR_TMA_PIPE (default 0): 1 keeps one stage's wgmma group in flight while the consumers wait for the
    next stage and issue its group, releasing a stage one step later (linear_tma.cu PIPE); 0 waits for every
    group before the next stage. CodegenError unless 0 or 1."""
    return int(env_switch(PIPE_ENV, False, CodegenError))


def config_choice() -> dict:
    """The configurations in use, for the artifact's codegen choices: {"plain": [NC, CH, S], ..., "heads_ks": n}."""
    layouts = ((PLAIN, "plain"), (GATED, "gated"), (HEADS, "heads"))
    choice: dict = {name: list(config(layout)) for layout, name in layouts}
    choice["heads_ks"] = heads_ks()
    choice["pipe"] = pipe()
    choice["ks_min_steps"] = ks_min_steps()
    return choice


def smem_bytes(nc: int, ch: int, stages: int, x_tiles: int = 1) -> int:
    """Dynamic shared memory of a configuration (linear_tma.cu tma_smem_bytes; x_tiles 2: a and b of an
    AddRMSNormalization prologue)."""
    return stages * (64 * ch * nc * 128 + x_tiles * MAX_ROWS * 128) + 1024


def fitted_stages(nc: int, ch: int, stages: int, x_tiles: int) -> int:
    """The configuration's stages, fewer where x_tiles x tiles per stage would not fit SMEM_LIMIT."""
    while stages > 2 and smem_bytes(nc, ch, stages, x_tiles) > SMEM_LIMIT:
        stages -= 1
    return stages


def map_capacity(entries: dict, buckets: dict | None, archs: tuple[str, ...]) -> int:
    """Tensor-map slots to reserve for a module (two per projection node and kernel variant; 0 where the path
    cannot be used)."""
    if not targets(archs):
        return 0
    slots = 0
    for entry, (graph, _) in entries.items():
        kernels = 1 + len((buckets or {}).get(entry, ("", ()))[1])
        slots += kernels * sum(2 + (n.op in NORM_OPS) for n in graph.nodes if n.op in OPS)
    return slots


def ks_min_steps() -> int:
    """KS_MIN_STEPS, or ATLAS_LINEAR_TMA_KS_MIN_STEPS (a positive integer; CodegenError otherwise)."""
    value = os.environ.get(KS_MIN_STEPS_ENV, "") or str(KS_MIN_STEPS)
    if not value.isdigit() or int(value) < 1:
        raise CodegenError(f"{KS_MIN_STEPS_ENV}={value!r} is not a positive integer")
    return int(value)


def ks_split(tiles: int, steps: int) -> int:
    """K runs of a plain projection of `tiles` blocks and `steps` 64-k steps (the module docstring's rule)."""
    ks, min_steps = 1, ks_min_steps()
    while ks < 4 and tiles * ks * 2 <= KS_MAX_BLOCKS and steps // (ks * 2) >= min_steps:
        ks *= 2
    return ks


def rows_bounds(ctx: KernelContext, x_v) -> tuple[int, int]:
    """(lower, upper) of x's rows (its leading dims flattened) for this kernel."""
    lo, hi = 1, 1
    for d in x_v.shape[:-1]:
        lo *= ctx.lower(d)
        hi *= ctx.upper(d)
    return lo, hi


def _contiguous_like(ctx: KernelContext, v, x_v) -> bool:
    """v is a contiguous float16 value of x's shape at 16-byte aligned bytes (a norm prologue's b or sum)."""
    return (v.dtype == "float16" and len(v.shape) == len(x_v.shape) and ctx.plan.placement(v).strides is None
            and ctx.plan.placement(v).offset % 16 == 0
            and all(ctx.upper(p) == ctx.upper(q) for p, q in zip(v.shape, x_v.shape)))


def eligible(ctx: KernelContext, x_v, w_v, layout: int, whole_heads: bool = False, norm: tuple = ()) -> bool:
    """Whether linear_tma_decode can serve this node's kernel (the module docstring's conditions; whole_heads: a
    LinearRotary's heads are HEAD_DIM wide and rotated whole or not at all, so its pairs are dims (i, i + 64);
    norm: a NormLinear's (b or None, g, the sum or None): b and the sum contiguous like x, 16-byte aligned; g a
    constant of ones, its scale folded into w by fold-norm-scale)."""
    if ctx.tensor_maps is None or x_v.dtype != "float16" or w_v.dtype != "float16":
        return False
    if norm:
        b_v, g_v, s_v = norm
        if any(v is not None and not _contiguous_like(ctx, v, x_v) for v in (b_v, s_v)):
            return False
        if not g_v.is_constant or not np.all(g_v.data == 1):
            return False
    lo, hi = rows_bounds(ctx, x_v)
    if lo < MIN_ROWS or hi > MAX_ROWS or len(w_v.shape) != 2 or not all(isinstance(d, int) for d in w_v.shape):
        return False
    n, k = w_v.shape
    if k % 64 or ctx.plan.placement(x_v).strides is not None or ctx.plan.placement(w_v).strides is not None:
        return False
    if ctx.upper(x_v.shape[-1]) != k:
        return False
    if layout == GATED and n % 2:
        return False
    if layout == HEADS and (not whole_heads or n % HEAD_DIM):
        return False
    return True


def _emit(ctx: KernelContext, layout: int, x_v, w_v, has_bias: str, t: str, r: int, m_expr: str,
          norm: tuple = (), eps: float = 0.0) -> KernelCode:
    """The kernel body calling linear_tma_decode (eligible() said yes; try_emit declared `bias`, `bias_stride`, the
    View `y` and, for a paired layout, the epilogue `lin_epi`), with its grid, block, shared memory and scratch;
    norm: a NormLinear's (b or None, g, the sum or None) and its epsilon."""
    nc, ch, stages = config(layout)
    x_tiles = 2 if norm and norm[0] is not None else 1
    stages = fitted_stages(nc, ch, stages, x_tiles)
    n, k = w_v.shape
    rows = rows_bounds(ctx, x_v)[1]
    if layout == PLAIN:
        box, tiles = 64 * ch * nc, -(-n // (64 * ch * nc))
    elif layout == GATED:
        box, tiles = 64 * nc, -(-(n // 2) // (64 * nc))
    else:
        box, tiles = HEAD_DIM * nc, -(-(n // HEAD_DIM) // nc)
    ks = 1 if norm or layout == GATED else ks_split(tiles, k // 64) if layout == PLAIN else heads_ks()
    ks = min(ks, k // 64)
    tw = ctx.tensor_map_address(w_v, n, box)
    tx = ctx.tensor_map_address(x_v, rows, MAX_ROWS)
    nrm = f"atlas::TmaNorm<{t}>{{}}"
    if norm:
        b_v, _, s_v = norm
        tb = ctx.tensor_map_address(b_v, rows, MAX_ROWS) if b_v is not None else "nullptr"
        s_arg = f"reinterpret_cast<{t}*>({ctx.address(s_v)}), {k}LL" if s_v is not None else "nullptr, 0LL"
        nrm = f"atlas::TmaNorm<{t}>{{{tb}, {float(eps)!r}f, {s_arg}}}"
    counters, scratch = (tiles, tiles * ks * nc * ch * 16 * 128 * 4) if ks > 1 else (0, 0)
    ws = f"reinterpret_cast<float*>({ctx.scratch_address(0)})" if ks > 1 else "nullptr"
    cnt = f"reinterpret_cast<unsigned int*>({ctx.counters_address()})" if ks > 1 else "nullptr"
    body = "\n".join([
        f"  {SM90A_MARKER}",
        f"  atlas::linear_tma_decode<{t}, {r}, {LAYOUT_NAMES[layout]}, {nc}, {ch}, {stages}, {has_bias}, "
        f"{NORM_NAMES[x_tiles if norm else 0]}, {pipe()}>({tw}, {tx}, bias, bias_stride, y, {m_expr}, {n}LL, {k}LL, "
        f"{'atlas::LinNoEpi()' if layout == PLAIN else 'lin_epi'}, {ws}, {cnt}, {ks}LL, {nrm});",
    ])
    choice = {"path": "tma", "layout": ["plain", "gated", "heads"][layout], "config": [nc, ch, stages], "ks": ks}
    if norm:
        choice["norm"] = ["rms", "add_rms"][x_tiles - 1]
    return KernelCode(body, (tiles * ks, 1, 1), (128 * nc + 32, 1, 1), smem=smem_bytes(nc, ch, stages, x_tiles),
                      scratch=scratch, counters=counters, choice=choice, min_blocks=1)


def _operands(node) -> tuple[int, list, tuple, tuple]:
    """(layout, the projection's inputs after x without Nones, (cos, sin) or (), the norm's (b, g, sum) or ()) of a
    node of OPS; x is its input 0 (a NormLinear's a)."""
    norm: tuple = ()
    if node.op in NORM_OPS:
        s_v = node.outputs[3 if node.op == "NormLinearRotary" else 1] if len(node.outputs) in (2, 4) else None
        norm = (node.inputs[1], node.inputs[2], s_v)
    if node.op in ("LinearRotary", "NormLinearRotary"):
        at = 1 if node.op == "LinearRotary" else 3
        return HEADS, [v for v in node.inputs[at + 2:] if v is not None], tuple(node.inputs[at:at + 2]), norm
    proj = [v for v in node.inputs[3 if norm else 1:] if v is not None]
    gated = node.op == "LinearGated" or (node.op == "NormLinear" and bool(node.attrs.get("epilogue")))
    return (GATED if gated else PLAIN), proj, (), norm


def try_emit(ctx: KernelContext, node) -> KernelCode | None:
    """The whole kernel of a Linear / LinearGated / LinearRotary / NormLinear / NormLinearRotary (float16
    projection) node on this path, or None where eligible() says no (the caller then emits linear.cu's paths)."""
    if node.op not in OPS or not targets(ctx.archs) or node.attrs.get("linear", "Linear") != "Linear":
        return None
    from atlasc.codegen.cexpr import c_type
    from atlasc.codegen.linear import bind_bias
    from atlasc.codegen.linear_prologue import _rows_only_y, gated_epilogue, rotary_epilogue

    x_v = node.inputs[0]
    layout, proj, tables, norm = _operands(node)
    w_v, b_v = proj[0], (proj[1] if len(proj) > 1 else None)
    whole_heads = False
    if layout == HEADS:
        rot_dim = 0 if tables[0] is None else ctx.upper(tables[0].shape[-1])
        whole_heads = int(node.attrs["head_dim"]) == HEAD_DIM and rot_dim in (0, HEAD_DIM)
    if not eligible(ctx, x_v, w_v, layout, whole_heads, norm):
        return None
    t, r = c_type(x_v.dtype), len(x_v.shape)
    if layout == HEADS:
        _rows_only_y(ctx, t, x_v.shape)
    else:
        ctx.view(node.outputs[0], "y", rank=r)
    has_bias = bind_bias(ctx, b_v, t)
    if layout == HEADS:
        rotary_epilogue(ctx, node, x_v.dtype, *tables)
    elif layout == GATED:
        gated_epilogue(ctx, node, x_v.dtype)
    m_expr = " * ".join(f"({ctx.dim(d)})" for d in x_v.shape[:-1]) or "1LL"
    return _emit(ctx, layout, x_v, w_v, has_bias, t, r, m_expr, norm, float(node.attrs.get("epsilon", 0.0)))
