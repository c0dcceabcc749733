"""Linear with its producer fused in as a prologue (decode: one kernel instead of two).

- `NormLinear(a, b | None, g, w[, bias])`: x = RMSNormalization(a, g) (with b: s = a + b rounded, as
  AddRMSNormalization, x = RMSNormalization(s, g), and s is the second output), then y = Linear(x, w,
  bias). Attribute `epsilon`. Outputs (y) or (y, s). With the attribute `epilogue` (a FusedElementwise
  program of two inputs, e.g. SwiGLU), the Linear's output z [.., 2H] is gated: y = program(z[.., :H],
  z[.., H:]) [.., H], the program's input `gate_input` (0 or 1) reading the first half.
- `ElementwiseLinear(in_0 .. in_{n-1}, w[, bias])`: x = FusedElementwise(in_0 ..) with the attributes
  `program`, `out_shape`, `out_dtype`, `slices` of that op, then y = Linear(x, w, bias). Attribute
  `n_in` = n.

- `NormLinearQ(a, b | None, g, wq, scale[, bias[, zero]])`: NormLinear with the quantized projection
  named by the attribute `linear` (LinearQ8 with `act`, LinearQ4 with `group_size` and `act`, LinearF8), same epilogue.
- `NormLinearRotary(a, b | None, g, cos | None, sin | None, <projection inputs after x>)`: the merged QKV
  projection of a NormLinear (attribute `linear` = Linear) or NormLinearQ (a quantized op) with QKVRotary
  as its epilogue: outputs (q, present_k, present_v) or, with b, (q, present_k, present_v, s); attributes
  those of both (epsilon, linear, group_size, q_heads, kv_heads, head_dim, layer, past). Stateful: it
  writes the layer's new keys and values into the KV cache as QKVRotary does.

Shape rules and references are those of the two ops composed (the references call the registered
ones), so a fused pair computes bit-identically to the pair it replaced on the CPU. The pass
passes/fuse_linear_prologue.py makes them; codegen/linear_prologue.py emits them.
"""

from __future__ import annotations

from atlasc.errors import ShapeError
from atlasc.ir.archs import max_dynamic_smem
from atlasc.ir.dtypes import itemsize
from atlasc.ir.ops.registry import OPS, Attr, register

# what the kernels (codegen/linear_prologue.py) can do, which the pass checks before fusing:
PROLOGUE_MAX_M = 8  # most rows (decode batch): each block stages all of x, which costs little for a few rows
# every block stages x (rows x K) in shared memory: at most this many bytes (an sm80+ block may have up to
# 227 KB; the kernel's own arrays take a few KB)
PROLOGUE_SMEM_BYTES = 200 * 1024


def staging_limit(archs: tuple[str, ...]) -> int:
    """Bytes a fused kernel's block may stage in a compile for `archs`: PROLOGUE_SMEM_BYTES, or less where
    the smallest arch allows less shared memory per block (atlasc/ir/archs.py: sm86 / sm89 / sm120 99 KB,
    sm80 163 KB, sm75 64 KB, less the kernels' static arrays)."""
    return min(PROLOGUE_SMEM_BYTES, max_dynamic_smem(archs))


def staging_bytes(rows: int, k: int, dtype: str) -> int:
    """Shared memory a fused Linear's block needs to stage x: rows x K values of dtype, rounded up to 16."""
    return -(-rows * k * itemsize(dtype) // 16) * 16


def _norm_parts(ins: list) -> tuple[list, list]:
    """([norm inputs], [linear inputs without x]) of a NormLinear's inputs."""
    a, b, g, w = ins[0], ins[1], ins[2], ins[3]
    bias = ins[4] if len(ins) > 4 else None
    norm = [a, g] if b is None else [a, b, g]
    return norm, [w] if bias is None else [w, bias]


def _norm_op(ins: list) -> str:
    return "RMSNormalization" if ins[1] is None else "AddRMSNormalization"


def _norm_attrs(attrs: dict, op: str) -> dict:
    return OPS[op].fill_attrs({"axis": -1, "epsilon": attrs["epsilon"]})


def epilogue_attrs(z_shape, dtype: str, attrs: dict) -> dict:
    """The FusedElementwise attributes of a NormLinear's gated epilogue over its Linear output z."""
    h = z_shape[-1] // 2 if isinstance(z_shape[-1], int) else None
    if h is None or 2 * h != z_shape[-1]:
        raise ShapeError(f"NormLinear: a gated epilogue needs an even static width, got {z_shape[-1]}")
    halves = ((0, h), (h, h)) if attrs["gate_input"] == 0 else ((h, h), (0, h))
    return OPS["FusedElementwise"].fill_attrs({"program": attrs["epilogue"], "out_shape": tuple(z_shape[:-1]) + (h,),
                                               "out_dtype": dtype, "slices": halves})


def _norm_linear_infer(ins, attrs):
    if any(t is None for i, t in enumerate(ins) if i != 1 and i != 4):
        raise ShapeError("NormLinear: a, g and w are required")
    norm_ins, lin_ins = _norm_parts(ins)
    op = _norm_op(ins)
    normed = OPS[op].infer(norm_ins, _norm_attrs(attrs, op))
    y = OPS["Linear"].infer([normed[0], *lin_ins], {})[0]
    if attrs.get("epilogue"):
        y = OPS["FusedElementwise"].infer([y, y], epilogue_attrs(y.shape, y.dtype, attrs))[0]
    return [y] if ins[1] is None else [y, normed[1]]


def _norm_linear_ref(ins, attrs):
    norm_ins, lin_ins = _norm_parts(ins)
    op = _norm_op(ins)
    normed = OPS[op].reference(norm_ins, _norm_attrs(attrs, op))
    y = OPS["Linear"].reference([normed[0], *lin_ins], {})[0]
    if attrs.get("epilogue"):
        y = OPS["FusedElementwise"].reference([y, y], epilogue_attrs(y.shape, str(y.dtype), attrs))[0]
    return [y] if ins[1] is None else [y, normed[1]]


register("NormLinear", inputs=(4, 5), outputs=(1, 2), kind="opaque",
         attrs={"epsilon": Attr("float"), "epilogue": Attr("any", ()), "gate_input": Attr("int", 0)},
         infer=_norm_linear_infer, reference=_norm_linear_ref,
         doc="(Add)RMSNormalization over the last axis feeding a Linear, one kernel; outputs y (and the sum)")

_ELT_ATTRS = ("program", "out_shape", "out_dtype", "slices")


def _elt_parts(ins: list, attrs: dict) -> tuple[list, list, dict]:
    n = attrs["n_in"]
    if not 1 <= n <= len(ins) - 1:
        raise ShapeError(f"ElementwiseLinear: n_in = {n} with {len(ins)} inputs")
    elt_attrs = OPS["FusedElementwise"].fill_attrs({k: attrs[k] for k in _ELT_ATTRS if k in attrs})
    return list(ins[:n]), list(ins[n:]), elt_attrs


def _elt_linear_infer(ins, attrs):
    elt_ins, lin_ins, elt_attrs = _elt_parts(ins, attrs)
    x = OPS["FusedElementwise"].infer(elt_ins, elt_attrs)[0]
    return OPS["Linear"].infer([x, *lin_ins], {})


def _elt_linear_ref(ins, attrs):
    elt_ins, lin_ins, elt_attrs = _elt_parts(ins, attrs)
    x = OPS["FusedElementwise"].reference(elt_ins, elt_attrs)[0]
    return OPS["Linear"].reference([x, *lin_ins], {})


register("ElementwiseLinear", inputs=(3, -1), kind="opaque",
         attrs={"program": Attr("steps"), "out_shape": Attr("dims"), "out_dtype": Attr("dtype"),
                "slices": Attr("any", ()), "n_in": Attr("int")},
         infer=_elt_linear_infer, reference=_elt_linear_ref,
         doc="a FusedElementwise program computing a Linear's input, one kernel (e.g. SwiGLU into the down projection)")


# -- NormLinearQ: the same with a quantized projection -------------------------------------------
QUANTIZED = ("LinearQ8", "LinearQ4", "LinearF8")


def _q_parts(ins: list, attrs: dict) -> tuple[list, list, str, dict]:
    """([norm inputs], [projection inputs after x], projection op, its attributes) of a NormLinearQ."""
    op = attrs["linear"]
    if op not in QUANTIZED:
        raise ShapeError(f"NormLinearQ: linear must be one of {', '.join(QUANTIZED)}, got {op!r}")
    a, b, g = ins[0], ins[1], ins[2]
    norm = [a, g] if b is None else [a, b, g]
    rest = list(ins[3:])
    while rest and rest[-1] is None:  # an omitted trailing bias
        rest.pop()
    lin_attrs = {"act": attrs["act"]} if op in ("LinearQ4", "LinearQ8") else {}
    return norm, rest, op, lin_attrs | ({"group_size": attrs["group_size"]} if op == "LinearQ4" else {})


def _norm_linear_q_infer(ins, attrs):
    if any(t is None for i, t in enumerate(ins) if i in (0, 2, 3, 4)):
        raise ShapeError("NormLinearQ: a, g, wq and scale are required")
    norm_ins, rest, op, lin_attrs = _q_parts(ins, attrs)
    nop = _norm_op(ins)
    normed = OPS[nop].infer(norm_ins, _norm_attrs(attrs, nop))
    y = OPS[op].infer([normed[0], *rest], OPS[op].fill_attrs(lin_attrs))[0]
    if attrs.get("epilogue"):
        y = OPS["FusedElementwise"].infer([y, y], epilogue_attrs(y.shape, y.dtype, attrs))[0]
    return [y] if ins[1] is None else [y, normed[1]]


def _norm_linear_q_ref(ins, attrs):
    norm_ins, rest, op, lin_attrs = _q_parts(ins, attrs)
    nop = _norm_op(ins)
    normed = OPS[nop].reference(norm_ins, _norm_attrs(attrs, nop))
    y = OPS[op].reference([normed[0], *rest], OPS[op].fill_attrs(lin_attrs))[0]
    if attrs.get("epilogue"):
        y = OPS["FusedElementwise"].reference([y, y], epilogue_attrs(y.shape, str(y.dtype), attrs))[0]
    return [y] if ins[1] is None else [y, normed[1]]


register("NormLinearQ", inputs=(5, 7), outputs=(1, 2), kind="opaque",
         attrs={"epsilon": Attr("float"), "linear": Attr("str"), "group_size": Attr("int", 0),
                "act": Attr("str", ""), "epilogue": Attr("any", ()), "gate_input": Attr("int", 0)},
         infer=_norm_linear_q_infer, reference=_norm_linear_q_ref,
         doc="NormLinear with a quantized projection: inputs (a, b | None, g, then the projection's inputs "
             "after x: wq, scale[, bias[, zero]]), attribute linear = LinearQ8 / LinearQ4 / LinearF8")


# -- NormLinearRotary: the QKV projection with rotary and the KV-cache append as its epilogue -----------
ROTARY_ATTRS = ("q_heads", "kv_heads", "head_dim", "layer", "past")


def _rot_parts(ins: list, attrs: dict) -> tuple[str, list, dict, list]:
    """(inner op, its inputs, its attributes, QKVRotary's table inputs) of a NormLinearRotary."""
    a, b, g, cos, sin = ins[:5]
    rest = list(ins[5:])
    while rest and rest[-1] is None:
        rest.pop()
    inner = {"epsilon": attrs["epsilon"]}
    if attrs["linear"] == "Linear":
        op = "NormLinear"
    else:
        op = "NormLinearQ"
        inner |= {"linear": attrs["linear"], "group_size": attrs["group_size"], "act": attrs["act"]}
    return op, [a, b, g, *rest], OPS[op].fill_attrs(inner), ([] if cos is None else [cos, sin])


def _rot_attrs(attrs: dict) -> dict:
    return OPS["QKVRotary"].fill_attrs({k: attrs[k] for k in ROTARY_ATTRS})


def _norm_linear_rotary_infer(ins, attrs):
    if (ins[3] is None) != (ins[4] is None):
        raise ShapeError("NormLinearRotary: give both cos and sin, or neither (no rotary)")
    op, inner_ins, inner_attrs, tables = _rot_parts(ins, attrs)
    y = OPS[op].infer(inner_ins, inner_attrs)
    return OPS["QKVRotary"].infer([y[0], *tables], _rot_attrs(attrs)) + y[1:]


def _norm_linear_rotary_ref(ins, attrs, state):
    op, inner_ins, inner_attrs, tables = _rot_parts(ins, attrs)
    y = OPS[op].reference(inner_ins, inner_attrs)
    return OPS["QKVRotary"].reference([y[0], *tables], _rot_attrs(attrs), state) + list(y[1:])


register("NormLinearRotary", inputs=(6, 9), outputs=(3, 4), kind="opaque", stateful=True,
         attrs={"epsilon": Attr("float"), "linear": Attr("str"), "group_size": Attr("int", 0),
                "act": Attr("str", ""), "q_heads": Attr("int"), "kv_heads": Attr("int"), "head_dim": Attr("int"),
                "layer": Attr("int"),
                "past": Attr("dim")},
         infer=_norm_linear_rotary_infer, reference=_norm_linear_rotary_ref,
         doc="NormLinear / NormLinearQ on the merged QKV projection with QKVRotary as its epilogue: inputs "
             "(a, b | None, g, cos | None, sin | None, then the projection's inputs after x); outputs "
             "q, present_k, present_v (and the sum with b)")
