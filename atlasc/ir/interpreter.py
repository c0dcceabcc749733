"""The reference interpreter: runs any IR graph with numpy, op by op, from the op table.

It is the ground truth every later test compares against, and the engine of `atlasc run --device cpu`.
Inputs are bound by name; every symbolic dim is bound from the input shapes and checked, and every
node's outputs are checked against the shapes the graph claims for them.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from atlasc.errors import InputError, ShapeError
from atlasc.ir import symbolic as S
from atlasc.ir.dtypes import to_numpy
from atlasc.ir.graph import Graph, Node
from atlasc.ir.ops import get


def bind_symbols(graph: Graph, inputs: Mapping[str, np.ndarray],
                 symbols: Mapping[str, int] | None = None) -> dict[str, int]:
    """Check `inputs` against the graph's signature; return symbol -> int bound from their shapes.

    `symbols` pre-binds symbols no input shape carries (a decoder entry's `past_seq`: the cache
    length is state, not an input). Raises InputError naming the first offending input (missing,
    unknown, wrong dtype/rank/dim) or an unbound or out-of-bounds symbol.
    """
    names = [v.name for v in graph.inputs]
    missing = [n for n in names if n not in inputs]
    unknown = [n for n in inputs if n not in names]
    if missing or unknown:
        parts = []
        if missing:
            parts.append("missing " + ", ".join(missing))
        if unknown:
            parts.append("unknown " + ", ".join(unknown))
        raise InputError(f"inputs do not match the graph: {'; '.join(parts)}",
                         hint="expected inputs: " + ", ".join(names))
    env: dict[str, int] = dict(symbols or {})
    deferred = []
    for v in graph.inputs:
        arr = np.asarray(inputs[v.name])
        if arr.dtype != to_numpy(v.dtype):
            raise InputError(f"input '{v.name}' has dtype {arr.dtype}, expected {v.dtype}")
        if arr.ndim != len(v.shape):
            raise InputError(f"input '{v.name}' has rank {arr.ndim}, expected {len(v.shape)} {S.shape_str(v.shape)}")
        for axis, (d, actual) in enumerate(zip(v.shape, arr.shape)):
            name = S.as_symbol(d)
            if name is not None:
                if name in env and env[name] != actual:
                    raise InputError(f"input '{v.name}' dim {axis} is {actual}, but {name} = {env[name]} elsewhere")
                env[name] = actual
            else:
                deferred.append((v.name, axis, d, actual))
    for name, axis, d, actual in deferred:
        try:
            expected = S.evaluate(d, env)
        except KeyError as e:
            raise InputError(f"input '{name}' dim {axis} ({d}) uses unbound symbol {e}") from None
        if expected != actual:
            raise InputError(f"input '{name}' dim {axis} is {actual}, expected {d} = {expected}")
    unbound = [s for s in graph.symbols if s not in env]
    if unbound:
        raise InputError(f"symbol(s) {', '.join(unbound)} not bound by any input shape; pass them explicitly")
    for name, value in env.items():
        info = graph.symbols.get(name)
        if info is not None and (value < info.lower or (info.upper is not None and value > info.upper)):
            raise InputError(f"symbol {name} = {value} outside its bounds [{info.lower}, {info.upper}]")
    return env


def eval_attrs(node: Node, env: Mapping[str, int]) -> dict:
    """The node's attributes with defaults filled and every symbolic dim evaluated with env."""
    return evaluate_attrs(node.op, node.attrs, env)


def evaluate_attrs(op_name: str, attrs: dict, env: Mapping[str, int]) -> dict:
    """Attributes of an `op_name` node with defaults filled and symbolic dims evaluated with env."""
    op = get(op_name)
    attrs = op.fill_attrs(attrs)
    for key in op.dim_attrs:
        attrs[key] = _eval_dims(attrs[key], env)
    return attrs


def _eval_dims(x, env):
    if isinstance(x, (tuple, list)):
        return tuple(_eval_dims(d, env) for d in x)
    if isinstance(x, S.Expr):
        return S.evaluate(x, env)
    return x


def run_node(node: Node, args: list, env: Mapping[str, int], state: dict | None = None) -> list[np.ndarray]:
    """Execute one node with the reference and check its outputs' dtypes and shapes."""
    op = get(node.op)
    if op.stateful and state is None:
        raise InputError(f"node {node.name} ({node.op}) needs persistent state (a KV cache); none was given")
    try:
        outs = op.reference(args, eval_attrs(node, env), *((state,) if op.stateful else ()))
    except (InputError, ShapeError) as e:  # a reference refusing its operands (an out-of-range Gather index)
        cls = InputError if isinstance(e, InputError) else ShapeError  # subclasses (DimMismatch) take other args
        raise cls(f"node {node.name} ({node.op}): {e.message}", e.hint) from None
    for out_value, arr in zip(node.outputs, outs):
        expected = tuple(S.evaluate(d, env) for d in out_value.shape)
        if arr.shape != expected or arr.dtype != to_numpy(out_value.dtype):
            raise ShapeError(f"node {node.name} ({node.op}) produced {arr.dtype}{list(arr.shape)} for "
                             f"'{out_value.name}', the graph says {out_value.dtype}{list(expected)}")
    return outs


def interpret(graph: Graph, inputs: Mapping[str, np.ndarray], *, state: dict | None = None,
              symbols: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """Run `graph` on named numpy inputs; return {output name: array}.

    `state` holds persistent arrays stateful ops update in place (`{"kv_cache": array}`); `symbols`
    binds symbols that no input shape carries. Guarantees: outputs are exactly what the op
    references compute, in graph order; every intermediate is checked against the dtype and shape
    the graph declares for it.
    """
    env = bind_symbols(graph, inputs, symbols)
    vals: dict[int, np.ndarray] = {id(v): np.asarray(inputs[v.name]) for v in graph.inputs}
    remaining = graph.use_counts()
    for node in graph.nodes:
        args = []
        for i in node.inputs:
            if i is None:
                args.append(None)
            elif i.is_constant:
                args.append(i.data)
            else:
                args.append(vals[id(i)])
        outs = run_node(node, args, env, state)
        for v, arr in zip(node.outputs, outs):
            vals[id(v)] = arr
        for i in node.inputs:  # free intermediates as soon as their last reader ran
            if i is not None and not i.is_constant:
                remaining[id(i)] -= 1
                if remaining[id(i)] == 0:
                    vals.pop(id(i), None)
    result = {}
    for o in graph.outputs:
        result[o.name] = o.data if o.is_constant else vals[id(o)]
    return result
