"""atlasc.ir: the typed SSA graph, its op table, verifier and numpy reference interpreter.

Depends on numpy only (and atlasc.errors)."""

from atlasc.ir import ops  # noqa: F401  (registers every op)
from atlasc.ir.graph import Graph, Node, SymbolInfo, Value, constant
from atlasc.ir.interpreter import bind_symbols, interpret
from atlasc.ir.ops import OPS, TensorType
from atlasc.ir.printer import format_graph
from atlasc.ir.verify import verify

__all__ = ["Graph", "Node", "SymbolInfo", "Value", "constant", "interpret", "bind_symbols", "OPS", "TensorType",
           "format_graph", "verify"]
