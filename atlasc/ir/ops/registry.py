"""The op table: every IR op is declared once, here, with its contract.

An `OpDef` gives an op's arity, attribute schema, fusion kind, shape/dtype rule and numpy reference.
The verifier checks nodes against it; the reference interpreter executes it; passes read `kind` to
decide what may fuse. A fused op may be emitted by a pass only once it is registered here.

Shape rules take `TensorType`s (dtype + dims, possibly symbolic) and return the output types; they
raise `ShapeError` on inputs that do not fit, or `DimMismatch` when two dims must be equal but are
not provably so (the frontend then tries to unify the symbols). References take numpy arrays and
attributes whose symbolic dims have already been evaluated to ints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from atlasc.errors import ShapeError
from atlasc.ir.dtypes import DType

KINDS = ("elementwise", "reduction", "movement", "opaque", "source")


class TensorType(NamedTuple):
    dtype: DType
    shape: tuple


class DimMismatch(ShapeError):
    """Two dims that an op requires to be equal differ and are not provably equal."""

    def __init__(self, a, b, context: str = ""):
        self.a, self.b = a, b
        super().__init__(f"{context}dims {a} and {b} must be equal")


REQUIRED = object()


@dataclass(frozen=True)
class Attr:
    """Attribute schema: `kind` is one of int, float, str, bool, ints, dims, dim, dtype, array, any."""

    kind: str
    default: Any = REQUIRED


@dataclass(frozen=True)
class OpDef:
    name: str
    num_inputs: tuple[int, int]  # (min, max); max -1 = variadic
    num_outputs: tuple[int, int]
    attrs: dict[str, Attr]
    kind: str
    infer: Callable[[list, dict], list[TensorType]]
    reference: Callable[[list, dict], list]
    doc: str = ""
    dim_attrs: tuple[str, ...] = field(default=())  # attrs that hold dims (evaluated before reference)
    stateful: bool = False  # reference(ins, attrs, state) reads/writes persistent state (the KV cache)

    def fill_attrs(self, attrs: dict) -> dict:
        """attrs with defaults filled in; raises ShapeError on unknown or missing attributes."""
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise ShapeError(f"{self.name}: unknown attribute(s) {sorted(unknown)}")
        out = {}
        for key, spec in self.attrs.items():
            if key in attrs:
                out[key] = attrs[key]
            elif spec.default is REQUIRED:
                raise ShapeError(f"{self.name}: missing required attribute '{key}'")
            else:
                out[key] = spec.default
        return out


OPS: dict[str, OpDef] = {}


def register(
    name: str,
    *,
    inputs: int | tuple[int, int],
    outputs: int | tuple[int, int] = 1,
    attrs: dict[str, Attr] | None = None,
    kind: str = "opaque",
    infer: Callable,
    reference: Callable,
    doc: str = "",
    stateful: bool = False,
) -> OpDef:
    """Declare an op. Each name may be registered once."""
    if name in OPS:
        raise ValueError(f"op {name} registered twice")
    if kind not in KINDS:
        raise ValueError(f"bad kind {kind}")
    attrs = attrs or {}
    ins = (inputs, inputs) if isinstance(inputs, int) else inputs
    outs = (outputs, outputs) if isinstance(outputs, int) else outputs
    dim_attrs = tuple(k for k, a in attrs.items() if a.kind in ("dims", "dim"))
    op = OpDef(name, ins, outs, attrs, kind, infer, reference, doc, dim_attrs, stateful)
    OPS[name] = op
    return op


def get(name: str) -> OpDef:
    """The OpDef for `name` (KeyError if unregistered)."""
    return OPS[name]
