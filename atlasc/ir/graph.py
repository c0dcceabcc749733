"""The IR: values, nodes and graphs.

A `Value` is an SSA tensor (name, dtype, shape of dims). A constant is a Value that carries `data`
(a numpy array, kept by reference). A `Node` applies a registered op (see `atlasc.ir.ops`) to input
Values (None for an omitted optional input) and defines its output Values. A `Graph` holds nodes in
order, named inputs and outputs, and the symbols its dims use with their bounds.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from atlasc.ir import symbolic as S
from atlasc.ir.dtypes import DType, dtype_of_numpy


@dataclass(eq=False)
class Value:
    """An SSA tensor. `data` is set for constants (weights, folded tensors)."""

    name: str
    dtype: DType
    shape: tuple  # of dims (int | symbolic.Expr)
    data: np.ndarray | None = None

    def __post_init__(self):
        self.shape = tuple(S.dim(d) for d in self.shape)

    @property
    def is_constant(self) -> bool:
        return self.data is not None

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        kind = "const " if self.is_constant else ""
        return f"%{self.name}: {kind}{self.dtype}{S.shape_str(self.shape)}"


def constant(name: str, data: np.ndarray) -> Value:
    """A constant Value holding `data` (the array is kept by reference, not copied)."""
    data = np.asarray(data)
    return Value(name, dtype_of_numpy(data.dtype), data.shape, data)


@dataclass(eq=False)
class Node:
    """One op application. `attrs` are plain Python values, dims, tuples of dims or numpy arrays."""

    op: str
    inputs: list  # of Value | None
    outputs: list  # of Value
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str = ""

    def __post_init__(self):
        if not self.name:
            # derived from the first output's (unique, SSA) name: deterministic across compiles
            self.name = f"{self.op}:{self.outputs[0].name}" if self.outputs else self.op

    def __repr__(self) -> str:
        return f"Node({self.name}: {self.op})"


@dataclass(frozen=True)
class SymbolInfo:
    """Bounds of a symbolic dim: lower <= value <= upper (upper None: unbounded until compile)."""

    lower: int = 0
    upper: int | None = None


class Graph:
    """Ordered nodes over SSA values, with named graph inputs/outputs and symbol bounds."""

    def __init__(self, name: str = "graph"):
        self.name = name
        self.nodes: list[Node] = []
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.symbols: dict[str, SymbolInfo] = {}
        self.metadata: dict[str, Any] = {}

    # -- queries ------------------------------------------------------------------------------
    def producers(self) -> dict[int, Node]:
        """id(value) -> the node that defines it."""
        return {id(o): n for n in self.nodes for o in n.outputs}

    def users(self, value: Value) -> list[Node]:
        """Nodes that read `value`, in graph order."""
        return [n for n in self.nodes if any(i is value for i in n.inputs)]

    def use_counts(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for n in self.nodes:
            for i in n.inputs:
                if i is not None:
                    counts[id(i)] = counts.get(id(i), 0) + 1
        for o in self.outputs:
            counts[id(o)] = counts.get(id(o), 0) + 1
        return counts

    def constants(self) -> list[Value]:
        """Every constant read by a node or returned, once each, in first-use order."""
        seen: dict[int, Value] = {}
        for n in self.nodes:
            for i in n.inputs:
                if i is not None and i.is_constant:
                    seen.setdefault(id(i), i)
        for o in self.outputs:
            if o.is_constant:
                seen.setdefault(id(o), o)
        return list(seen.values())

    def input(self, name: str) -> Value:
        for v in self.inputs:
            if v.name == name:
                return v
        raise KeyError(name)

    def bounds(self) -> dict[str, int]:
        """symbol -> lower bound, for the symbolic reasoning helpers."""
        return {s: info.lower for s, info in self.symbols.items()}

    # -- transformations ----------------------------------------------------------------------
    def toposort(self) -> Graph:
        """Reorder nodes topologically, keeping the existing order where it is already valid."""
        avail = {id(v) for v in self.inputs}
        pending = list(self.nodes)
        order: list[Node] = []
        progress = True
        while pending and progress:
            progress = False
            rest = []
            for n in pending:
                if all(i is None or i.is_constant or id(i) in avail for i in n.inputs):
                    order.append(n)
                    avail.update(id(o) for o in n.outputs)
                    progress = True
                else:
                    rest.append(n)
            pending = rest
        if pending:
            raise ValueError(f"graph has a cycle or dangling inputs at {pending[0].name}")
        self.nodes = order
        return self

    def cleanup(self) -> Graph:
        """Dead-code elimination: drop nodes none of whose outputs reach a graph output.

        Stateful nodes (KV-cache writes) are always kept: their effect outlives the graph."""
        from atlasc.ir.ops import get

        live = {id(o) for o in self.outputs}
        keep = []
        for n in reversed(self.nodes):
            if get(n.op).stateful or any(id(o) in live for o in n.outputs):
                keep.append(n)
                live.update(id(i) for i in n.inputs if i is not None)
        self.nodes = list(reversed(keep))
        return self

    def replace_all_uses(self, old: Value, new: Value) -> None:
        """Make every reader of `old` (nodes and graph outputs) read `new` instead."""
        for n in self.nodes:
            n.inputs = [new if i is old else i for i in n.inputs]
        if any(o is old for o in self.outputs):
            # graph outputs keep their public names
            new_name = old.name
            self.outputs = [new if o is old else o for o in self.outputs]
            if not new.is_constant and new not in self.inputs:
                new.name = new_name

    def clone(self, name: str | None = None) -> Graph:
        """A copy with new Values and Nodes; constants (weights) are shared by reference."""
        g = Graph(name or self.name)
        g.symbols = dict(self.symbols)
        g.metadata = dict(self.metadata)
        vmap: dict[int, Value] = {}

        def cp(v: Value | None) -> Value | None:
            if v is None or v.is_constant:
                return v
            if id(v) not in vmap:
                vmap[id(v)] = Value(v.name, v.dtype, v.shape)
            return vmap[id(v)]

        g.inputs = [cp(v) for v in self.inputs]
        g.nodes = [Node(n.op, [cp(i) for i in n.inputs], [cp(o) for o in n.outputs], dict(n.attrs), n.name)
                   for n in self.nodes]
        g.outputs = [cp(v) for v in self.outputs]
        return g

    def substitute(self, mapping: dict) -> Graph:
        """Replace symbols by dims everywhere (value shapes and dim attributes); drop them from symbols."""
        from atlasc.ir.ops import get

        def sub_attr(x):
            if isinstance(x, (tuple, list)):
                return type(x)(sub_attr(d) for d in x)
            return S.substitute(x, mapping) if isinstance(x, S.Expr) else x

        for v in self.all_values():
            if not v.is_constant:
                v.shape = tuple(S.substitute(d, mapping) for d in v.shape)
        for n in self.nodes:
            for key in get(n.op).dim_attrs:
                if key in n.attrs:
                    n.attrs[key] = sub_attr(n.attrs[key])
        for s in mapping:
            self.symbols.pop(s, None)
        return self

    def all_values(self) -> Iterable[Value]:
        seen = set()
        for v in itertools.chain(self.inputs, (x for n in self.nodes for x in n.inputs + n.outputs), self.outputs):
            if v is not None and id(v) not in seen:
                seen.add(id(v))
                yield v

    def __str__(self) -> str:
        from atlasc.ir.printer import format_graph

        return format_graph(self)
