"""NormLinear, NormLinearQ and ElementwiseLinear: linear.cu's / quant.cu's decode paths reading an x that
the kernel itself computed and staged in shared memory.

Only the decode paths (GEMV and MMA decode, M <= 32) are emitted: fuse-linear-prologue makes these
ops only where the rows are few (PROLOGUE_MAX_M). The x source (linear.cu) is
- NormLinear: lin_norm_stage reads a (and b) once, keeping h = a (+ b) in shared memory and each
  row's sum of squares in registers (block 0 also writes the sum s, the second output), reduces all
  rows at once, then scales the staged rows to x = T(h * inv * g); 16-byte reads where the rows allow;
- with the attribute `epilogue` (gate/up halves, e.g. SwiGLU), the decode paths read weight rows j and
  H + j together (linear.cu's gated GEMV / MMA decode) and store epi(gate, up) [.., H] through the
  device lambda `lin_epi` (fused.py's statements over the two halves rounded as the Linear stores them);
- XFn for ElementwiseLinear: a device lambda evaluating the FusedElementwise program at (m, k) with
  fused.py's statements (the same per-step rounding as the FusedElementwise kernel).
Each block stages all of x (M x K values) in dynamic shared memory (the pass limits it to staging_limit
of the archs), then the decode loops read x from there (XSmem): x is computed once per block, not once
per warp and K step. The batch-1 float projections stage after each warp has issued its first weight loads
and the kernel has waited for the previous one (early weights: linear.py early_pro, linear.cu LinPro), so the
reads overlap the wait and the staging; other float projections and quantized ones with float x stage first
(overlapping it measured slower for the latter in the lab, docs/perf.md v13); int8-x ones (act_int8.cu) stage
after their first weight loads. The grid is capped (grid_cap: by the rows and the kind of weights) so that few
blocks repeat the staging (ATLAS_PROLOGUE_MAX_GRID replaces the cap). The 16-byte path needs K % V == 0, an
aligned weight and (XNorm) aligned unit-stride rows of a, b and g; the MMA decode additionally float16, K % 32 == 0
and sm80+. Otherwise the scalar GEMV runs.
"""

from __future__ import annotations

import os

from atlasc.codegen import linear_tma
from atlasc.codegen.attention import bind_qkv_rotary
from atlasc.codegen.cexpr import c_type, compute_type
from atlasc.codegen.elementwise import _align
from atlasc.codegen.fused import fused_lines
from atlasc.codegen.generate import MAX_GRID, CodegenError, KernelCode, KernelContext, emitter, weight_prefetch
from atlasc.codegen.linear import (GEMV_MAX_M, THREADS, WARPS, bind_bias, decode_calls, decode_choice,
                                   decode_grid, early_min_blocks, early_pro, gemv_variants,
                                   red_floats)
from atlasc.codegen.quant import bind_quant_weights, ofs_room, one_row_min_blocks, quant_calls
from atlasc.codegen.act_int8 import act8_calls, act8_smem
from atlasc.errors import env_switch
from atlasc.ir.graph import Node, Value
from atlasc.ir.ops import TensorType
from atlasc.ir.ops.fused import sliced_types, step_types
from atlasc.ir.ops.prologue import PROLOGUE_MAX_M, staging_bytes
from atlasc.ir.ops.quant import act_int8

PROLOGUE_MAX_GRID = 264  # blocks of a fused kernel (2 per SM of an H200): each one computes and stages all of x
# A capped grid makes blocks loop over items, each item's loads waiting behind the last, while every extra
# block stages x once more. Measured on the H200 at one row (docs/perf.md v12; quant_lab.py / kernel_lab.py
# --ms 1 --variant norm,gated with ATLAS_PROLOGUE_MAX_GRID=264 against uncapped):
# - quantized weights, float x: uncapped is faster (8B QKV 11.50 -> 9.58 us, gate/up norm 29.48 -> 25.59,
#   gated 28.48 -> 28.82);
# - float16 weights: uncapped is faster at 384 blocks (8B QKV 17.22 -> 16.34 us) and slower at 1024 / 1792
#   (1B gate/up 18.94 -> 19.80, 8B gate/up 57.54 -> 60.41): FLOAT_MAX_GRID_ONE_ROW between them;
# - int8 x (W4A8 / W8A8, each block also quantizes x): slower uncapped (8B gate/up 23.39 -> 28.22 us).
# At 8 rows the cap wins (int4 8B gate/up 45.11 against 58.13 us uncapped).
FLOAT_MAX_GRID_ONE_ROW = 2 * PROLOGUE_MAX_GRID
GRID_ENV = "ATLAS_PROLOGUE_MAX_GRID"  # =N: the cap for every kernel and row count (A/B timing)
# The one-row cap of the gate/up + SwiGLU kernels with int8 x: 3 blocks per SM of an H200, what their ~80 registers
# allow, all resident at once. H200 (docs/perf.md v37 run 6 lab, us at 264 / 396): 8B gate/up + SwiGLU int4 24.7 /
# 23.1, int8 34.9 / 33.4; 8B LM head (not gated) int4 76.0 / 78.7, int8 130.2 / 124.1. The 8-layer int4 step with
# every int8-x kernel at 396 (v38 run 1): gate/up 27.9 -> 26.4 us a layer, the LM head 75.8 -> 85.2 us.
ACT8_GATED_GRID_ONE_ROW = 3 * 132
# =N: the one-row cap of every kernel with int8 x (A/B timing in a decode step, where GRID_ENV would also cap the
# one-row float-x kernels).
ACT8_GRID_ENV = "ATLAS_PROLOGUE_ACT8_GRID"


NORM_AHEAD_ENV = "ATLAS_NORM_LOADS_AHEAD"
# lin_norm_stage's AHEAD: each thread issues all its 16-byte chunks of a row of a (and b), and of g, before it uses
# any (registers: 4 per chunk and operand), where a row is at most NORM_AHEAD_MAX chunks per thread: K <= 4096
# float16 values at 256 threads. The loop form pays a memory latency per chunk of a / b and again per chunk of g
# (cuobjdump: each pass issues its load just before its use), on the decode step's critical path (the staging reads
# what the previous kernel wrote). Opt-in: in the 8-layer 8B steps at batch 1 (docs/perf.md v38) int4 lost 1.9%
# (its QKV + rotary kernels 2.7 us slower a layer) and int8 gained 1.5%, both less than ACT8_GATED_GRID_ONE_ROW,
# whose third block per SM the form's registers do not leave room for.
NORM_AHEAD_MAX = 2


def norm_ahead_choice() -> bool:
    """ATLAS_NORM_LOADS_AHEAD (default 0); CodegenError unless 0 or 1. Recorded in the artifact's codegen choices."""
    return env_switch(NORM_AHEAD_ENV, False, CodegenError)


def norm_ahead(dtype: str, k) -> int:
    """lin_norm_stage's AHEAD for rows of k `dtype` values: the 16-byte chunks per thread whose loads go out together,
    or 0 (the loop form) with the switch off, k not static, or more than NORM_AHEAD_MAX chunks per thread."""
    per_chunk = {"float16": 8, "float32": 4}.get(dtype)  # LinVec<T>::N
    if not norm_ahead_choice() or per_chunk is None or not isinstance(k, int) or k <= 0:
        return 0
    chunks = -(-k // (THREADS * per_chunk))
    return chunks if chunks <= NORM_AHEAD_MAX else 0


def _env_blocks(env: str) -> int:
    """The block count the variable `env` sets, 0 when unset; CodegenError unless a positive integer."""
    value = os.environ.get(env, "")
    if value and (not value.isdigit() or int(value) <= 0):
        raise CodegenError(f"{env}={value!r} is not a block count (expected a positive integer)")
    return int(value) if value else 0


def grid_cap(m_upper: int, weights: str = "quantized", gated: bool = False) -> int:
    """The fused kernel's block cap for at most m_upper rows, its kind of weights ("quantized" with float x,
    "float", "act8": int8 x) and epilogue (gated: SwiGLU): ATLAS_PROLOGUE_MAX_GRID when set, else
    PROLOGUE_MAX_GRID except at one row (quantized: no cap, float: FLOAT_MAX_GRID_ONE_ROW, act8:
    ATLAS_PROLOGUE_ACT8_GRID when set, else ACT8_GATED_GRID_ONE_ROW for gated kernels); CodegenError for a set
    value that is not a positive integer."""
    forced = _env_blocks(GRID_ENV) or (m_upper == 1 and weights == "act8" and _env_blocks(ACT8_GRID_ENV))
    if forced:
        return forced
    if m_upper > 1:
        return PROLOGUE_MAX_GRID
    if weights == "act8":
        return ACT8_GATED_GRID_ONE_ROW if gated else PROLOGUE_MAX_GRID
    return MAX_GRID if weights == "quantized" else FLOAT_MAX_GRID_ONE_ROW


def act8_grid_choice() -> int:
    """ATLAS_PROLOGUE_ACT8_GRID as an int (0 when unset), validated: recorded in the artifact's codegen choices."""
    return _env_blocks(ACT8_GRID_ENV)


def _rows_only_y(ctx: KernelContext, t: str, x_shape) -> None:
    """Declare `y` for a kernel whose epilogue stores elsewhere (rotary): x's rows, no storage."""
    r = len(x_shape)
    ctx.lines.append(f"  atlas::View<{t}, {r}> y;  // rows only: the epilogue writes q and the KV cache")
    ctx.lines.append("  y.p = nullptr;")
    ctx.lines += [f"  y.shape[{i}] = {ctx.dim(d)}; y.stride[{i}] = 0;" for i, d in enumerate(x_shape)]


def decode_head(ctx: KernelContext, node: Node, x_shape, dtype: str, w_v: Value, b_v: Value | None, y_v: Value | None):
    """Common declarations: w, bias, y (rows only when y_v is None), N, K, M (rows of x_shape); returns
    (t, r, variants, runs, has_bias, the rows' upper bound)."""
    if dtype not in ("float32", "float16"):
        raise CodegenError(f"{node.name}: {node.op} on {dtype} has no CUDA kernel (supported: float32, float16)")
    if ctx.plan.placement(w_v).strides is not None:
        raise CodegenError(f"{node.name}: {node.op} needs a contiguous weight, {w_v.name} is a strided view")
    t, r = c_type(dtype), len(x_shape)
    m_upper = 1
    for d in x_shape[:-1]:
        m_upper *= ctx.upper(d)
    if m_upper > GEMV_MAX_M:
        raise CodegenError(f"{node.name}: {node.op} has only decode paths (rows <= {GEMV_MAX_M}), "
                           f"its rows may reach {m_upper}")
    if y_v is None:
        _rows_only_y(ctx, t, x_shape)
    else:
        ctx.view(y_v, "y", rank=r)
    ctx.lines.append(f"  const {t}* w = reinterpret_cast<const {t}*>({ctx.address(w_v)});")
    has_bias = bind_bias(ctx, b_v, t)
    variants = gemv_variants(m_upper)
    runs = decode_choice(dtype, w_v.shape[1], w_v.shape[0], variants)
    ctx.lines.append(f"  const long long N = {ctx.dim(w_v.shape[0])}, K = {ctx.dim(w_v.shape[1])};")
    ctx.lines.append("  long long M = 1;")
    ctx.lines += [f"  M *= y.shape[{i}];" for i in range(r - 1)]
    ctx.lines.append(f"  __shared__ long long lin_yoff[{GEMV_MAX_M}];")
    if runs:
        ctx.lines.append(f"  __shared__ float lin_red[{red_floats(runs)}];")
    ctx.lines.append("  atlas::lin_offsets(y, M, lin_yoff);")
    return t, r, variants, runs, has_bias, m_upper


def _tail(ctx: KernelContext, t: str, r: int, variants, runs, has_bias: str, w_v: Value, smem: int,
          stage: str, m_upper: int, epi: str = "") -> KernelCode:
    """The kernel body after the declarations in ctx.lines (which define `vec`): `stage` (statements
    filling lin_xbuf, x in dynamic shared memory), the mma flag and the decode calls reading x from
    there; the launch geometry."""
    early = early_pro(m_upper, "  " + stage)  # the staging after the first weight loads (linear.cu LinPro)
    body = [
        "  extern __shared__ __align__(16) unsigned char lin_dyn[];",
        f"  {t}* lin_xbuf = reinterpret_cast<{t}*>(lin_dyn);",
        *(early or [stage]),
        f"  const atlas::XSmem<{t}> xsm{{lin_xbuf, K}};",
    ]
    if runs:
        body.append(f"  const bool mma = vec && K % 32 == 0 && atlas::LinVec<{t}>::MMA && atlas::lin_sm80();")
    body += decode_calls(t, r, variants, runs, has_bias, prefix="  ", src="xsm", epi=epi,
                         pro="lin_pro" if early else "")
    # every block stages all of x: enough blocks to stream the weights, not one per feature group
    blocks = min(decode_grid(ctx.upper(w_v.shape[0]), variants, runs, w_v.shape[0], paired=bool(epi)),
                 grid_cap(m_upper, "float"))
    grid = max(1, min(MAX_GRID, blocks))
    return KernelCode("\n".join(body), (grid, 1, 1), (THREADS, 1, 1), smem=smem, prefetch=weight_prefetch(ctx, w_v),
                      waits_inside=bool(early), min_blocks=early_min_blocks(grid) if early else 0)


def _norm_source(ctx: KernelContext, node: Node, t: str, r: int, s_v: Value | None) -> str:
    """Declare the views of a (Add)RMSNorm prologue (a, b, g and the sum s_v), its row offsets, `lin_svec`
    (16-byte staging applies) and the source `xs`; returns the statement staging x into lin_xbuf."""
    a_v, b_v, g_v = node.inputs[:3]
    add = str(b_v is not None).lower()
    ctx.view(a_v, "a", rank=r)
    ctx.view(b_v if b_v is not None else a_v, "b", rank=r)
    ctx.view(g_v, "g", rank=1)
    if s_v is not None:
        ctx.view(s_v, "s", rank=r)
    vec_s = " && atlas::lin_vec_rows(s)" if s_v is not None else ""
    ctx.lines += [
        f"  __shared__ long long lin_aoff[{GEMV_MAX_M}], lin_boff[{GEMV_MAX_M}];",
        f"  __shared__ float lin_scratch[{(WARPS + 1) * PROLOGUE_MAX_M}];",
        "  atlas::lin_offsets(a, M, lin_aoff);",
        "  atlas::lin_offsets(b, M, lin_boff);",
        "  __syncthreads();",
        f"  const bool lin_svec = K % atlas::LinVec<{t}>::N == 0 && atlas::lin_vec_rows(a) && "
        f"atlas::lin_vec_rows(b) && atlas::lin_vec_rows(g){vec_s};",
        f"  const atlas::XNorm<{t}, {add}> xs{{a.p, b.p, g.p, lin_aoff, lin_boff, a.stride[{r - 1}], "
        f"b.stride[{r - 1}], g.stride[0]}};",
    ]
    eps = float(node.attrs["epsilon"])
    s_arg = "s, true" if s_v is not None else "a, false"  # the sum output, or none (a: any View of the rank)
    ahead = norm_ahead(a_v.dtype, a_v.shape[-1])
    targs = f"{t}, {add}, {r}" + (f", {ahead}" if ahead else "")  # (the default form's source unchanged)
    return f"  atlas::lin_norm_stage<{targs}>(xs, M, K, {eps!r}f, lin_xbuf, {s_arg}, lin_scratch, lin_svec);"


def _chain_norm_views(ctx: KernelContext, node: Node, r: int, s_v: Value | None) -> None:
    """A chain phase's norm operands: the views a, b, g (and s) and the XNorm `xs` of one row (eligible_norm checks
    them contiguous and aligned), its row offsets the constant atlas::qb_row0, not _norm_source's lin_offsets, whose
    block-wide barrier the producer warp would not reach in step."""
    a_v, b_v, g_v = node.inputs[:3]
    ctx.view(a_v, "a", rank=r)
    b = "b" if b_v is not None else "a"
    if b_v is not None:
        ctx.view(b_v, "b", rank=r)
    ctx.view(g_v, "g", rank=1)
    if s_v is not None:
        ctx.view(s_v, "s", rank=r)
    add = str(b_v is not None).lower()
    ctx.lines.append(f"  const atlas::XNorm<__half, {add}> xs{{a.p, {b}.p, g.p, atlas::qb_row0, atlas::qb_row0, "
                     f"a.stride[{r - 1}], {b}.stride[{r - 1}], g.stride[0]}};")


def _parts(node: Node) -> tuple[list, Value | None, Value | None, str]:
    """(the projection's inputs after x, y or None, the residual sum s or None, the epilogue: "" / gated /
    rotary) of a NormLinear, NormLinearQ or NormLinearRotary."""
    if node.op == "NormLinearRotary":
        s_v = node.outputs[3] if len(node.outputs) > 3 else None
        return list(node.inputs[5:]), None, s_v, "rotary"
    s_v = node.outputs[1] if len(node.outputs) > 1 else None
    return list(node.inputs[3:]), node.outputs[0], s_v, ("gated" if node.attrs.get("epilogue") else "")


def _epilogue(ctx: KernelContext, node: Node, kind: str, dtype: str) -> str:
    """Declare the epilogue object `lin_epi` of kind gated / rotary; returns its name ("" for none)."""
    if kind == "gated":
        gated_epilogue(ctx, node, dtype)
    elif kind == "rotary":
        rotary_epilogue(ctx, node, dtype, node.inputs[3], node.inputs[4])
    return "lin_epi" if kind else ""


def _quantized(node: Node) -> bool:
    return node.op == "NormLinearQ" or (node.op == "NormLinearRotary" and node.attrs["linear"] != "Linear")


@emitter("NormLinear", "NormLinearQ", "NormLinearRotary")
def emit_norm_linear(ctx: KernelContext, node: Node) -> KernelCode:
    """The norm staged in shared memory, then linear.cu's decode paths (float) or quant.cu's kernels
    (quantized: tensor-core path or fallback, x read through a View of the staged rows)."""
    if _quantized(node):
        return _emit_quantized(ctx, node)
    tma = linear_tma.try_emit(ctx, node)  # 9..32 rows of an sm90-only compile: the copy-engine path (linear_tma.py)
    if tma is not None:
        return tma
    a_v = node.inputs[0]
    proj, y_v, s_v, kind = _parts(node)
    w_v, bias_v = proj[0], (proj[1] if len(proj) > 1 else None)
    t, r, variants, runs, has_bias, m_upper = decode_head(ctx, node, a_v.shape, a_v.dtype, w_v, bias_v, y_v)
    if m_upper > PROLOGUE_MAX_M:
        raise CodegenError(f"{node.name}: {node.op} stages at most {PROLOGUE_MAX_M} rows")
    stage = _norm_source(ctx, node, t, r, s_v)
    ctx.lines.append("  const bool vec = lin_svec && reinterpret_cast<uintptr_t>(w) % 16 == 0;")
    epi = _epilogue(ctx, node, kind, a_v.dtype)
    smem = staging_bytes(m_upper, ctx.upper(a_v.shape[-1]), a_v.dtype)
    return _tail(ctx, t, r, variants, runs, has_bias, w_v, smem, stage, m_upper, epi)


def _emit_quantized(ctx: KernelContext, node: Node) -> KernelCode:
    a_v = node.inputs[0]
    proj, y_v, s_v, kind = _parts(node)
    dt = a_v.dtype
    if dt not in ("float32", "float16"):
        raise CodegenError(f"{node.name}: {node.op} on {dt} has no CUDA kernel (supported: float32, float16)")
    t, r = c_type(dt), len(a_v.shape)
    m_upper = 1
    for d in a_v.shape[:-1]:
        m_upper *= ctx.upper(d)
    if m_upper > PROLOGUE_MAX_M:
        raise CodegenError(f"{node.name}: {node.op} stages at most {PROLOGUE_MAX_M} rows, "
                           f"its rows may reach {m_upper}")
    if y_v is None:
        _rows_only_y(ctx, t, a_v.shape)
    else:
        ctx.view(y_v, "y", rank=r)
    bits, f8, zp, group, has_bias, k_static, n_upper = bind_quant_weights(ctx, node, proj, t)
    ctx.lines.append("  long long M = 1;")
    ctx.lines += [f"  M *= y.shape[{i}];" for i in range(r - 1)]
    from atlasc.codegen import quant_bulk

    chain = ctx.chain_phase is not None  # a chain's phase (quant_chain.py): one row, no block-wide barrier
    if chain:
        _chain_norm_views(ctx, node, r, s_v)
    else:
        stage = _norm_source(ctx, node, t, r, s_v)
    epi = _epilogue(ctx, node, kind, dt)
    if quant_bulk.eligible_norm(ctx, node, proj[0], m_upper, zp, group, k_static, n_upper, kind, s_v):
        # ATLAS_QUANT_BULK (quant_bulk.serves; float x): the copy engine streams the weights while the consumers stage
        # the norm
        early_g = quant_bulk.g_early(node)
        src = quant_bulk.norm_source(node.inputs[1] is not None, float(node.attrs["epsilon"]),
                                     "s.p" if s_v is not None else "nullptr", early_g, coherent=chain)
        return quant_bulk.emit(ctx, node, has_bias, k_static, n_upper, [], src=src, epi=epi, norm_k=k_static,
                               early_g=early_g)
    if chain:
        raise CodegenError(f"{node.name}: planned as a chain's phase, but the copy-engine path does not serve it")
    xv = [f"  atlas::View<{t}, {r}> xv;", "  xv.p = lin_xbuf;"]
    for i in range(r - 1):
        xv.append(f"  xv.shape[{i}] = {'M' if i == 0 else '1'}; xv.stride[{i}] = K;")
    xv.append(f"  xv.shape[{r - 1}] = K; xv.stride[{r - 1}] = 1;")
    smem = staging_bytes(m_upper, ctx.upper(a_v.shape[-1]), dt)
    act8 = act_int8(node.attrs.get("act", ""), m_upper)
    early: list[str] = []
    if act8:  # W4A8 / W8A8: the staged rows quantized again, to int8, after them
        # (the stage runs inside: W4A8 on tensor cores reads its first weights before it)
        calls, blocks = act8_calls(node.name, t, r, bits, group, zp, has_bias, k_static, m_upper, "xv", smem, epi,
                                   pro=stage, n_upper=n_upper)
        blocks = blocks or -(-(n_upper // 2 if epi else n_upper) // WARPS)
        smem += act8_smem(m_upper, k_static)
        stages = []
    else:  # staged first (overlapping it with the first weight loads measured slower: docs/perf.md v13), or with
        # ATLAS_EARLY_QUANT=1 (opt-in) after the first weight loads and the wait (linear.py early_pro)
        early = early_pro(m_upper, "  " + stage, quantized=True)
        calls, blocks = quant_calls(t, r, dt, bits, f8, zp, group, has_bias, k_static, n_upper, m_upper, x="xv",
                                    xsmem=True, epi=epi, pro="lin_pro" if early else "",
                                    room=ofs_room(ctx.archs, smem))
        stages = early or [stage]
    body = ["  extern __shared__ __align__(16) unsigned char lin_dyn[];",
            f"  {t}* lin_xbuf = reinterpret_cast<{t}*>(lin_dyn);", *stages, *xv, *calls]
    cap = grid_cap(m_upper, "act8" if act8 else "quantized", gated=kind == "gated")
    grid = max(1, min(MAX_GRID, blocks, cap))
    bound = early_min_blocks(grid) if early else 0
    return KernelCode("\n".join(body), (grid, 1, 1), (THREADS, 1, 1), smem=smem,
                      prefetch=weight_prefetch(ctx, *proj[:2], *proj[3:4]), waits_inside=bool(early),
                      min_blocks=bound if act8 else one_row_min_blocks(m_upper, bound))


def rotary_epilogue(ctx: KernelContext, node: Node, dtype: str, cos_v: Value | None, sin_v: Value | None) -> None:
    """Declare `lin_epi`: LinRotary over q and the layer's cache views (outputs 0-2 of node; QKVRotary's checks),
    the tables cos_v / sin_v (None: no rotary)."""
    q_v, pk_v, pv_v = node.outputs[:3]
    hq, hk, d, _, past = bind_qkv_rotary(ctx, node, dtype, cos_v, sin_v, q_v, pk_v, pv_v)
    kv = ctx.kv_cache
    ctx.lines.append(f"  const atlas::LinRotary<{c_type(dtype)}> lin_epi{{cs, sn, q, pk, pv, {hq}LL, {hk}LL, {d}LL, "
                     f"cs.shape[2], q.shape[2], {past}, {kv['max_batch']}LL, {kv['max_seq']}LL}};")


def gated_epilogue(ctx: KernelContext, node: Node, dtype: str) -> None:
    """Declare `lin_epi`: LinGated over the epilogue program of the two rounded halves (fused.py's steps)."""
    program, gate = node.attrs["epilogue"], int(node.attrs["gate_input"])
    half = TensorType(dtype, (1,))
    steps = step_types([half, half], program)
    ct = compute_type(dtype)
    binds = [f"    const {ct} a{gate} = gate;", f"    const {ct} a{1 - gate} = up;"]
    ctx.lines += [
        "  auto lin_epi_f = [&](float gate, float up) -> float {",
        *binds,
        *fused_lines(node, program, [dtype, dtype], [s.dtype for s in steps], "    "),
        f"    return float(t{len(program) - 1});",
        "  };",
        "  const atlas::LinGated<decltype(lin_epi_f)> lin_epi{lin_epi_f};",
    ]


@emitter("ElementwiseLinear")
def emit_elementwise_linear(ctx: KernelContext, node: Node) -> KernelCode:
    n_in = int(node.attrs["n_in"])
    ins, w_v = node.inputs[:n_in], node.inputs[n_in]
    bias_v = node.inputs[n_in + 1] if len(node.inputs) > n_in + 1 else None
    y_v = node.outputs[0]
    program, slices = node.attrs["program"], node.attrs.get("slices") or ()
    x_dtype = node.attrs["out_dtype"]
    x_v = Value(f"{node.name}__x", x_dtype, tuple(node.attrs["out_shape"]))  # never stored: shapes only
    steps = step_types(sliced_types([TensorType(v.dtype, v.shape) for v in ins], slices), program)
    t, r, variants, runs, has_bias, m_upper = decode_head(ctx, node, x_v.shape, x_dtype, w_v, bias_v, y_v)
    names = [_align(ctx, v, x_v, f"in{k}") for k, v in enumerate(ins)]
    for name, sl in zip(names, slices):
        if sl is not None:  # a last-axis slice: same strides, the start offset added
            ctx.lines.append(f"  {name}.p += {int(sl[0])}LL * {name}_src.stride[{r - 1}];")
    ctx.lines.append(f"  __shared__ long long lin_ioff[{n_in}][{GEMV_MAX_M}];")
    ctx.lines += [f"  atlas::lin_offsets({name}, M, lin_ioff[{k}]);" for k, name in enumerate(names)]
    ctx.lines.append("  __syncthreads();")
    in_dtypes = [v.dtype for v in ins]
    body = [f"    const {compute_type(dt)} a{k} = "
            f"atlas::load({name}.p + lin_ioff[{k}][m] + k * {name}.stride[{r - 1}]);"
            for k, (name, dt) in enumerate(zip(names, in_dtypes))]
    body += fused_lines(node, program, in_dtypes, [s.dtype for s in steps], "    ")
    last = f"t{len(program) - 1}"
    value = f"atlas::round_f16(float({last}))" if x_dtype == "float16" else f"float({last})"
    ctx.lines += [
        "  auto lin_x = [&](int m, long long k) -> float {",
        *body,
        f"    return {value};",
        "  };",
        f"  const atlas::XFn<{t}, decltype(lin_x)> xs{{lin_x}};",
        f"  const bool vec = K % atlas::LinVec<{t}>::N == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0;",
    ]
    return _tail(ctx, t, r, variants, runs, has_bias, w_v, staging_bytes(m_upper, ctx.upper(x_v.shape[-1]), x_dtype),
                 "  atlas::lin_stage(xs, M, K, lin_xbuf, vec);", m_upper)
