"""MatMul and Gemm: the shared-memory tiled kernel of matmul.cu, operands addressed through strides.

The emitter normalizes both ops to `C[batch..., M, N] = A[batch..., M, K] @ B[batch..., K, N]` over
rank-R Views (R = output batch rank + 2, at least 2): numpy matmul's 1-D rules insert a size-1 M or N
dim with stride 0, broadcast batch dims get stride 0, Gemm's transA/transB swap the two strides, and
Gemm's bias C is a [M, N] View with stride 0 on broadcast dims. Device code: matmul.cu.
"""

from __future__ import annotations

from atlasc.codegen.cexpr import c_type
from atlasc.codegen.generate import CodegenError, KernelCode, KernelContext, emitter
from atlasc.ir.graph import Node, Value

TILE = 64
THREADS = 256
NUMERIC = ("float32", "float16", "float64", "int32", "int64")


def _declare(ctx: KernelContext, name: str, t: str, base: str, dims: list[tuple[str, str]]) -> str:
    """Declare `atlas::View<t, len(dims)> name` at pointer `base` with (shape, stride) C expressions."""
    ctx.lines.append(f"  atlas::View<{t}, {len(dims)}> {name};")
    ctx.lines.append(f"  {name}.p = {base};")
    for i, (shape, stride) in enumerate(dims):
        ctx.lines.append(f"  {name}.shape[{i}] = {shape}; {name}.stride[{i}] = {stride};")
    return name


def _batch_dims(ctx: KernelContext, src: str, value: Value, batch_rank: int, out_batch: list[str]):
    """(shape, stride) of value's batch dims right-aligned to the output batch (stride 0 where broadcast)."""
    own = list(value.shape[:-2]) if len(value.shape) > 2 else []
    dims = []
    for i in range(batch_rank):
        j = i - (batch_rank - len(own))
        if j < 0 or own[j] == 1:
            dims.append((out_batch[i], "0LL"))
        else:
            dims.append((out_batch[i], f"{src}.stride[{j}]"))
    return dims


def _check_dtype(node: Node) -> str:
    dt = node.inputs[0].dtype
    if dt not in NUMERIC:
        raise CodegenError(f"{node.name}: {node.op} on {dt} has no CUDA kernel (supported: {', '.join(NUMERIC)})")
    return dt


def _grid(ctx: KernelContext, batch_upper: int, m_upper: int, n_upper: int) -> tuple[int, int, int]:
    tiles = batch_upper * -(-m_upper // TILE) * -(-n_upper // TILE)
    return ctx.grid_for(tiles, 1)


def _acc_literal(dt: str, x: float) -> str:
    if dt in ("float32", "float16"):
        return f"{float(x)!r}f"
    if dt == "float64":
        return repr(float(x))
    return str(int(x))


@emitter("MatMul")
def emit_matmul(ctx: KernelContext, node: Node) -> KernelCode:
    a_v, b_v = node.inputs
    out_v = node.outputs[0]
    dt = _check_dtype(node)
    t = c_type(dt)
    a1, b1 = len(a_v.shape) == 1, len(b_v.shape) == 1
    a = ctx.view(a_v, "a_src")
    b = ctx.view(b_v, "b_src")
    c = ctx.view(out_v, "c_src")
    batch_rank = len(out_v.shape) - (0 if a1 else 1) - (0 if b1 else 1)
    out_batch = [f"{c}.shape[{i}]" for i in range(batch_rank)]
    r = batch_rank + 2
    ra, rb = len(a_v.shape), len(b_v.shape)
    # A: [batch, M, K]
    a_dims = _batch_dims(ctx, a, a_v, batch_rank, out_batch)
    if a1:
        a_dims += [("1LL", "0LL"), (f"{a}.shape[0]", f"{a}.stride[0]")]
    else:
        a_dims += [(f"{a}.shape[{ra - 2}]", f"{a}.stride[{ra - 2}]"), (f"{a}.shape[{ra - 1}]", f"{a}.stride[{ra - 1}]")]
    # B: [batch, K, N]
    b_dims = _batch_dims(ctx, b, b_v, batch_rank, out_batch)
    if b1:
        b_dims += [(f"{b}.shape[0]", f"{b}.stride[0]"), ("1LL", "0LL")]
    else:
        b_dims += [(f"{b}.shape[{rb - 2}]", f"{b}.stride[{rb - 2}]"), (f"{b}.shape[{rb - 1}]", f"{b}.stride[{rb - 1}]")]
    # C: [batch, M, N]
    c_dims = [(f"{c}.shape[{i}]", f"{c}.stride[{i}]") for i in range(batch_rank)]
    k = batch_rank
    c_dims.append(("1LL", "0LL") if a1 else (f"{c}.shape[{k}]", f"{c}.stride[{k}]"))
    k += 0 if a1 else 1
    c_dims.append(("1LL", "0LL") if b1 else (f"{c}.shape[{k}]", f"{c}.stride[{k}]"))
    _declare(ctx, "A", t, f"{a}.p", a_dims)
    _declare(ctx, "B", t, f"{b}.p", b_dims)
    _declare(ctx, "C", t, f"{c}.p", c_dims)
    ctx.lines.append(f"  atlas::View<{t}, 2> bias; bias.p = nullptr;")
    body = f"  atlas::matmul_tiled<{t}, {r}, false, false>(A, B, C, bias, 1, 1);"
    batch_upper = 1
    for d in out_v.shape[:batch_rank]:
        batch_upper *= ctx.upper(d)
    m_upper = 1 if a1 else ctx.upper(a_v.shape[-2])
    n_upper = 1 if b1 else ctx.upper(b_v.shape[-1])
    return KernelCode(body, _grid(ctx, batch_upper, m_upper, n_upper), (THREADS, 1, 1))


@emitter("Gemm")
def emit_gemm(ctx: KernelContext, node: Node) -> KernelCode:
    a_v, b_v = node.inputs[0], node.inputs[1]
    bias_v = node.inputs[2] if len(node.inputs) > 2 else None
    out_v = node.outputs[0]
    dt = _check_dtype(node)
    t = c_type(dt)
    if len(a_v.shape) != 2 or len(b_v.shape) != 2:
        raise CodegenError(f"{node.name}: Gemm operands must be 2-D")
    a = ctx.view(a_v, "a_src")
    b = ctx.view(b_v, "b_src")
    c = ctx.view(out_v, "c_src")
    ta, tb = int(node.attrs.get("transA", 0)), int(node.attrs.get("transB", 0))
    a_dims = [(f"{a}.shape[{i}]", f"{a}.stride[{i}]") for i in ((1, 0) if ta else (0, 1))]
    b_dims = [(f"{b}.shape[{i}]", f"{b}.stride[{i}]") for i in ((1, 0) if tb else (0, 1))]
    _declare(ctx, "A", t, f"{a}.p", a_dims)
    _declare(ctx, "B", t, f"{b}.p", b_dims)
    _declare(ctx, "C", t, f"{c}.p", [(f"{c}.shape[{i}]", f"{c}.stride[{i}]") for i in range(2)])
    has_bias = bias_v is not None
    if has_bias:
        if bias_v.dtype != dt:
            raise CodegenError(f"{node.name}: Gemm bias dtype {bias_v.dtype} differs from {dt}")
        rank = len(bias_v.shape)
        if rank > 2:
            raise CodegenError(f"{node.name}: Gemm bias of rank {rank}")
        src = ctx.view(bias_v, "bias_src") if rank else None
        dims = []
        for i in range(2):
            j = i - (2 - rank)
            if j < 0 or bias_v.shape[j] == 1:
                dims.append((f"C.shape[{i}]", "0LL"))
            else:
                dims.append((f"C.shape[{i}]", f"{src}.stride[{j}]"))
        _declare(ctx, "bias", t, f"reinterpret_cast<{t}*>({ctx.address(bias_v)})", dims)
    else:
        ctx.lines.append(f"  atlas::View<{t}, 2> bias; bias.p = nullptr;")
    alpha = _acc_literal(dt, node.attrs.get("alpha", 1.0))
    beta = _acc_literal(dt, node.attrs.get("beta", 1.0))
    body = f"  atlas::matmul_tiled<{t}, 2, true, {str(has_bias).lower()}>(A, B, C, bias, {alpha}, {beta});"
    m_upper = ctx.upper(out_v.shape[0])
    n_upper = ctx.upper(out_v.shape[1])
    return KernelCode(body, _grid(ctx, 1, m_upper, n_upper), (THREADS, 1, 1))
