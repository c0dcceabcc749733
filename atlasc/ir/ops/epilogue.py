"""Linear with its only reader fused in as an epilogue, where no prologue was fused (decode rows up to 32).

- `LinearGated(x, w[, bias])`: z = Linear(x, w, bias) [.., 2H], y = program(z[.., :H], z[.., H:]) [.., H] with
  the attributes `epilogue` (a FusedElementwise program of two inputs, e.g. SwiGLU) and `gate_input` (0 or 1:
  which program input reads the first half), as NormLinear's gated epilogue.
- `LinearRotary(x, cos | None, sin | None, w[, bias])`: the merged QKV projection with QKVRotary as its epilogue:
  outputs (q, present_k, present_v), attributes those of QKVRotary (q_heads, kv_heads, head_dim, layer, past).
  Stateful: it writes the layer's new keys and values into the KV cache as QKVRotary does.

Shape rules and references are those of the two ops composed (the references call the registered ones), so a
fused pair computes bit-identically to the pair it replaced on the CPU. The pass passes/fuse_linear_epilogue.py
makes them; codegen/linear_epilogue.py emits them.
"""

from __future__ import annotations

from atlasc.errors import ShapeError
from atlasc.ir.ops.prologue import ROTARY_ATTRS, epilogue_attrs
from atlasc.ir.ops.registry import OPS, Attr, register

EPILOGUE_MAX_M = 32  # most rows: linear.cu's decode paths (GEMV and MMA decode) hold the paired epilogues


def _linear_ins(ins: list) -> list:
    """x, w and the bias when given (an omitted bias may be None)."""
    return [v for v in ins if v is not None]


def _gated_infer(ins, attrs):
    z = OPS["Linear"].infer(_linear_ins(ins), {})[0]
    return OPS["FusedElementwise"].infer([z, z], epilogue_attrs(z.shape, z.dtype, attrs))


def _gated_ref(ins, attrs):
    z = OPS["Linear"].reference(_linear_ins(ins), {})[0]
    return OPS["FusedElementwise"].reference([z, z], epilogue_attrs(z.shape, str(z.dtype), attrs))


register("LinearGated", inputs=(2, 3), kind="opaque",
         attrs={"epilogue": Attr("any"), "gate_input": Attr("int", 0)},
         infer=_gated_infer, reference=_gated_ref,
         doc="a Linear whose output halves feed an elementwise program (SwiGLU on the merged gate/up), one kernel")


def _rot_parts(ins: list, attrs: dict) -> tuple[list, list, dict]:
    """(the Linear's inputs, QKVRotary's table inputs, its attributes) of a LinearRotary."""
    x, cos, sin = ins[:3]
    if (cos is None) != (sin is None):
        raise ShapeError("LinearRotary: give both cos and sin, or neither (no rotary)")
    lin = _linear_ins([x, *ins[3:]])
    return lin, ([] if cos is None else [cos, sin]), OPS["QKVRotary"].fill_attrs({k: attrs[k] for k in ROTARY_ATTRS})


def _rotary_infer(ins, attrs):
    lin, tables, rot_attrs = _rot_parts(ins, attrs)
    qkv = OPS["Linear"].infer(lin, {})[0]
    return OPS["QKVRotary"].infer([qkv, *tables], rot_attrs)


def _rotary_ref(ins, attrs, state):
    lin, tables, rot_attrs = _rot_parts(ins, attrs)
    qkv = OPS["Linear"].reference(lin, {})[0]
    return OPS["QKVRotary"].reference([qkv, *tables], rot_attrs, state)


register("LinearRotary", inputs=(4, 5), outputs=3, kind="opaque", stateful=True,
         attrs={"q_heads": Attr("int"), "kv_heads": Attr("int"), "head_dim": Attr("int"), "layer": Attr("int"),
                "past": Attr("dim")},
         infer=_rotary_infer, reference=_rotary_ref,
         doc="the merged QKV Linear with QKVRotary as its epilogue: inputs (x, cos | None, sin | None, w[, bias]); "
             "outputs q, present_k, present_v")
