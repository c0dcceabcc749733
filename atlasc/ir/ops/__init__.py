"""The op table. Importing this package registers every op (see registry.py for the contract)."""

from atlasc.ir.ops import (  # noqa: F401  (registration side effects)
    elementwise, epilogue, fused, kvcache, linear, nn, prologue, quant, reduce, sampling, tensor)
from atlasc.ir.ops.registry import OPS, Attr, DimMismatch, OpDef, TensorType, get, register

__all__ = ["OPS", "Attr", "DimMismatch", "OpDef", "TensorType", "get", "register"]
