"""ONNX -> IR import.

Walks the ONNX graph (read with onnx-graphsurgeon) in topological order. Every value known at
compile time (initializers, Constant nodes, and whatever is computed only from them and from
shapes) is folded with the op table's own references, symbolically where shapes are symbolic, so
the int64 shape programs exporters emit disappear and every Reshape/Expand/Slice/Range operand
becomes an attribute of dims (expressions in the graph's symbols). Everything else becomes an IR
node whose output type comes from the op's shape rule.

Symbols come from the graph inputs' dim names (sanitized). When an op's rule needs two dims to be
equal that are not provably so, and one of them is a bare symbol, that symbol is replaced
everywhere by the other dim: this is how an attention-mask length named `total_seq` (or
`past_sequence_length + 1`) is understood to be `past_seq + seq`.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from atlasc.errors import AtlasError, InputError, ShapeError, UnsupportedModelError
from atlasc.frontend.finite import check_weights_finite, constant_data
from atlasc.frontend.signature import detect_decoder
from atlasc.frontend.symvals import Known, Undecidable, symbolic_eval
from atlasc.ir import symbolic as S
from atlasc.ir.dtypes import INTS, dtype_of_numpy
from atlasc.ir.graph import Graph, Node, SymbolInfo, Value, constant
from atlasc.ir.ops import DimMismatch, TensorType, get

# the newest default-domain (ai.onnx) opset whose op semantics the handlers know (opset 24: Attention's
# nonpad_kv_seqlen); an op whose definition changed after it may mean something else, so it is refused rather than
# misread (_check_opset), while ops unchanged since are taken at any opset
MAX_OPSET = 24
FOLD_MIN_BYTES = 1 << 20  # a folded value may always be this big ...
FOLD_GROWTH = 1  # ... or as big as its inputs together (no folding of Expand/Tile blow-ups)


def _widen_4bit(arr: np.ndarray) -> np.ndarray:
    """ONNX int4 / uint4 initializers (ml_dtypes arrays) as int8 / uint8 holding the same values."""
    name = arr.dtype.name
    if name in ("int4", "uint4"):
        return arr.astype(np.int8 if name == "int4" else np.uint8)
    return arr


def handler_key(op_type: str, domain: str | None) -> str:
    """The handler table's key: the op type for the default domain, `domain::Op` otherwise."""
    return op_type if (domain or "") in ("", "ai.onnx") else f"{domain}::{op_type}"


def _symbol_name(dim_param: str) -> str:
    name = re.sub(r"\W+", "_", dim_param.strip()).strip("_")
    return name or "dim"


class Importer:
    """One import of one ONNX model; see the module docstring. Use `import_model`."""

    def __init__(self, model: onnx.ModelProto, mapped: dict[str, np.ndarray] | None = None):
        self.model = model
        self.mapped = mapped or {}  # initializers still external in the proto: their memmapped data
        self.opsets = {(imp.domain or ""): imp.version for imp in model.opset_import}
        self.opset = self.opsets.get("", self.opsets.get("ai.onnx", 1))
        self.graph = Graph(model.graph.name or "model")
        self.values: dict[str, Value] = {}
        self.known: dict[str, Known] = {}
        self.known_names: dict[int, str] = {}
        self.materialized: dict[str, Value] = {}
        self._fresh = 0

    # -- public ---------------------------------------------------------------------------
    def run(self) -> Graph:
        from atlasc.frontend.handlers import HANDLERS

        _check_opset(self.model.graph, self.opset)
        self._check_supported(HANDLERS)
        gsg = gs.import_onnx(self.model)
        try:  # ONNX lists nodes in topological order; an exporter that does not is forgiven, a cycle is not
            with gs.logger.G_LOGGER.suppress(gs.logger.G_LOGGER.CRITICAL + 1):  # gs logs the cycle before raising
                gsg.toposort()
        except Exception as e:
            raise ShapeError(f"the ONNX graph is not a DAG: {e}") from None
        check_weights_finite(gsg, self.mapped)
        self._import_inputs(gsg)
        self._relate_decoder_dims(gsg)
        for t in gsg.tensors().values():
            if isinstance(t, gs.Constant):
                self.set_known(t.name, Known.numeric(_widen_4bit(constant_data(t, self.mapped))))
        for node in gsg.nodes:
            ins = [self._lookup(t) for t in node.inputs]
            try:
                HANDLERS[handler_key(node.op, node.domain)](self, node, ins)
            except (ShapeError, InputError) as e:  # InputError: a folded op's reference refusing its constants
                if e.message.startswith("node "):
                    raise
                cls = InputError if isinstance(e, InputError) else ShapeError  # DimMismatch takes other args
                raise cls(f"node '{node.name}' ({node.op}): {e.message}", e.hint) from None
        for out in gsg.outputs:
            v = self.tensor(out.name)
            if v in self.graph.inputs or v in self.graph.outputs or v.is_constant:
                copy = Value(out.name if v.is_constant else self.fresh(out.name), v.dtype, v.shape)
                self.graph.nodes.append(Node("Identity", [v], [copy], name=self.fresh("Identity")))
                v = copy
            self.graph.outputs.append(v)
        self.graph.metadata["onnx"] = {
            "opsets": dict(self.opsets),
            "producer": f"{self.model.producer_name} {self.model.producer_version}".strip(),
        }
        return self.graph

    # -- setup ----------------------------------------------------------------------------
    def _check_supported(self, handlers) -> None:
        seen: dict[str, tuple[str, str, str]] = {}
        for node in self.model.graph.node:
            key = handler_key(node.op_type, node.domain)
            if key in handlers:
                continue
            if key not in seen:
                seen[key] = (key, str(self.opsets.get(node.domain or "", "?")), node.name or "(unnamed)")
        if seen:
            raise UnsupportedModelError(list(seen.values()))

    def _import_inputs(self, gsg) -> None:
        initializer_names = {i.name for i in self.model.graph.initializer}
        for t in gsg.inputs:
            if t.name in initializer_names:
                continue
            if t.dtype is None:
                raise ShapeError(f"graph input '{t.name}' has no element type")
            if t.shape is None:
                raise ShapeError(f"graph input '{t.name}' has no shape (rank unknown)")
            try:
                dtype = dtype_of_numpy(t.dtype)
            except (ValueError, TypeError):
                raise ShapeError(f"graph input '{t.name}' has unsupported type {t.dtype}") from None
            shape = []
            for d in t.shape:
                if isinstance(d, str) or d is None or (isinstance(d, int) and d < 0):
                    name = _symbol_name(d) if isinstance(d, str) else self.fresh("dim")
                    if name not in self.graph.symbols:
                        self.graph.symbols[name] = SymbolInfo(lower=0 if "past" in name.lower() else 1)
                    shape.append(S.sym(name))
                else:
                    shape.append(int(d))
            v = Value(t.name, dtype, tuple(shape))
            self.graph.inputs.append(v)
            self.values[t.name] = v

    def _relate_decoder_dims(self, gsg) -> None:
        """For a decoder, state what no ONNX shape does: mask length == past_seq + seq."""
        sig = detect_decoder([v.name for v in self.graph.inputs], [t.name for t in gsg.outputs])
        if sig is None:
            return
        self.graph.metadata["decoder"] = sig
        if not (sig.input_ids and sig.attention_mask):
            return
        ids, mask = self.values[sig.input_ids], self.values[sig.attention_mask]
        past_k = self.values[sig.past[min(sig.past)][0]]
        if len(ids.shape) != 2 or len(mask.shape) != 2 or len(past_k.shape) != 4:
            raise ShapeError("decoder inputs must be input_ids [batch, seq], attention_mask [batch, past + seq] "
                             "and past keys [batch, kv_heads, past, head_dim]")
        total = S.add(past_k.shape[2], ids.shape[1])
        if mask.shape[1] != total and not self.unify(mask.shape[1], total):
            raise ShapeError(f"attention_mask length {mask.shape[1]} cannot be past + seq = {total}")

    # -- values ---------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        self._fresh += 1
        return f"{base}__{self._fresh}"

    def _lookup(self, t):
        if t is None or t.name == "":
            return None
        if t.name in self.known:
            return self.known[t.name]
        if t.name in self.values:
            return self.values[t.name]
        raise ShapeError(f"tensor '{t.name}' is used but never defined")

    def tensor(self, x, hint_name: str | None = None) -> Value:
        """The IR Value for an input: a Value as is, a Known materialized (once) as constant/DimsTensor."""
        if isinstance(x, str):
            name = x
            x = self.known.get(name) or self.values.get(name)
            if x is None:
                raise ShapeError(f"graph output '{name}' is never defined")
            if isinstance(x, Value):
                return x
            hint_name = name
        if isinstance(x, Value):
            return x
        key = hint_name or f"k{id(x)}"
        cached = self.materialized.get(key)
        if cached is not None and cached.shape == x.shape:
            return cached
        name = hint_name or self.fresh("const")
        if x.symbolic:
            out = Value(self.fresh(name) if hint_name else name, x.dtype, x.shape)
            flat = tuple(S.dim(d) for d in x.array.reshape(-1))
            if x.array.ndim <= 1:
                node = Node("DimsTensor", [], [out], {"dims": flat, "dtype": x.dtype, "scalar": x.array.ndim == 0})
                self.graph.nodes.append(node)
            else:
                flat_v = Value(self.fresh(name), x.dtype, (len(flat),))
                self.graph.nodes.append(Node("DimsTensor", [], [flat_v], {"dims": flat, "dtype": x.dtype}))
                self.graph.nodes.append(Node("Reshape", [flat_v], [out], {"shape": x.shape}))
        else:
            out = constant(name, x.array)
        self.materialized[key] = out
        return out

    def set_known(self, name: str, k: Known) -> None:
        self.known[name] = k
        self.known_names[id(k)] = name

    def find_known_name(self, k: Known) -> str | None:
        return self.known_names.get(id(k))

    @staticmethod
    def shape_of(x) -> tuple:
        return tuple(x.shape) if isinstance(x, Known) else x.shape

    @staticmethod
    def dtype_of(x) -> str:
        return x.dtype

    def operand(self, x, node, what: str) -> Known:
        """A compile-time operand (shape, axes, starts ...); ShapeError if it depends on data."""
        if x is None:
            raise ShapeError(f"{node.op} needs its {what} input")
        if not isinstance(x, Known):
            raise ShapeError(f"{node.op} {what} depends on run-time tensor data; atlasc needs it "
                             f"computable from shapes and constants")
        return x

    def scalar_operand(self, x, node, what: str):
        """The one element of a compile-time scalar operand (a dim for ints); ShapeError if it is not a scalar."""
        k = self.operand(x, node, what)
        if k.array.size != 1:
            raise ShapeError(f"{node.op} {what} must be a scalar, got shape {list(k.shape)}")
        return k.scalar()

    def bounds(self) -> dict[str, int]:
        return self.graph.bounds()

    # -- emission -------------------------------------------------------------------------
    def emit(self, node, op: str, ins: list, attrs: dict, n_out: int | None = None, out_names=None,
             fold: bool = True) -> list:
        """Fold (if every input is known, unless fold=False) or emit `op`; bind the ONNX outputs; return
        the results."""
        opdef = get(op)
        attrs = opdef.fill_attrs(attrs)
        names = out_names or [o.name for o in node.outputs]
        n_out = n_out if n_out is not None else len(names)
        folded = self._try_fold(op, ins, attrs) if fold else None
        if folded is not None:
            for name, k in zip(names, folded[:n_out]):
                if name:
                    self.set_known(name, k)
            return folded[:n_out]
        values = [None if i is None else self.tensor(i, self.find_known_name(i) if isinstance(i, Known) else None)
                  for i in ins]
        types = self._infer(node, opdef, values, attrs)
        outs = []
        for i in range(n_out):
            name = names[i] if i < len(names) and names[i] else self.fresh(f"{node.name or op}_out{i}")
            v = Value(name, types[i].dtype, types[i].shape)
            self.values[name] = v
            outs.append(v)
        self.graph.nodes.append(Node(op, values, outs, attrs, name=node.name or self.fresh(op)))
        return outs

    def _infer(self, node, opdef, values, attrs) -> list[TensorType]:
        for _ in range(16):
            tts = [None if v is None else TensorType(v.dtype, v.shape) for v in values]
            try:
                return opdef.infer(tts, attrs)
            except DimMismatch as e:
                if not self.unify(e.a, e.b):
                    raise ShapeError(f"node '{node.name}' ({node.op}): {e.message}") from None
                for key in opdef.dim_attrs:
                    attrs[key] = _subst_attr(attrs[key], self._last_subst)
        raise ShapeError(f"node '{node.name}' ({node.op}): shapes do not unify")

    def unify(self, a, b) -> bool:
        """Make dims a and b equal by eliminating a bare symbol; False if neither is one."""
        sa, sb = S.as_symbol(a), S.as_symbol(b)
        order = list(self.graph.symbols)
        if sa and sb and sa in order and sb in order:
            old, new = (sa, b) if order.index(sa) > order.index(sb) else (sb, a)
        elif sa and sa in self.graph.symbols and sa not in S.symbols_of(b):
            old, new = sa, b
        elif sb and sb in self.graph.symbols and sb not in S.symbols_of(a):
            old, new = sb, a
        else:
            return False
        mapping = {old: new}
        self._last_subst = mapping
        info = self.graph.symbols.pop(old)
        for s in S.symbols_of(new):
            self.graph.symbols.setdefault(s, info)
        for v in list(self.values.values()) + self.graph.inputs:
            v.shape = tuple(S.substitute(d, mapping) for d in v.shape)
        for name, k in list(self.known.items()):
            if k.symbolic:
                self.set_known(name, k.substitute(mapping))
        for n in self.graph.nodes:
            for o in n.outputs:
                o.shape = tuple(S.substitute(d, mapping) for d in o.shape)
            for key in get(n.op).dim_attrs:
                n.attrs[key] = _subst_attr(n.attrs[key], mapping)
        return True

    def _try_fold(self, op: str, ins: list, attrs: dict) -> list[Known] | None:
        if any(isinstance(i, Value) for i in ins):
            return None
        opdef = get(op)
        if any(_has_symbol(attrs[k]) for k in opdef.dim_attrs):
            return None
        knowns = [i for i in ins if i is not None]
        symbolic = any(k.symbolic for k in knowns)
        tts = [None if i is None else TensorType(i.dtype, tuple(i.shape)) for i in ins]
        try:
            types = opdef.infer(tts, attrs)
        except ShapeError:
            return None
        if not symbolic:
            out_bytes = sum(int(np.prod(t.shape, dtype=np.int64)) * np.dtype(_np(t.dtype)).itemsize for t in types)
            in_bytes = sum(k.array.nbytes for k in knowns)
            if out_bytes > max(FOLD_MIN_BYTES, FOLD_GROWTH * in_bytes):
                return None
            arrays = [None if i is None else i.array for i in ins]
            outs = opdef.reference(arrays, attrs)
            return [Known(np.asarray(o), t.dtype) for o, t in zip(outs, types)]
        if any(k.dtype not in INTS + ("bool",) for k in knowns) and op != "Cast":
            return None
        arrays = [None if i is None else i.array for i in ins]  # numpy mixes int and object arrays fine
        try:
            outs = symbolic_eval(op, arrays, attrs, self.bounds())
            if outs is None:
                if op == "Cast":
                    if attrs["to"] not in INTS:
                        return None
                    outs = [arrays[0]]
                else:
                    outs = opdef.reference(arrays, attrs)
        except (Undecidable, TypeError, ValueError, ZeroDivisionError):
            return None
        result = []
        for o, t in zip(outs, types):
            o = np.asarray(o)
            if t.dtype == "bool":
                result.append(Known(o.astype(bool), "bool"))
            else:
                result.append(Known(o.astype(object), t.dtype).normalized())
        return result


def _check_opset(graph: onnx.GraphProto, opset: int) -> None:
    """AtlasError naming the default-domain ops whose definition at the model's opset is newer than
    MAX_OPSET (onnx's schemas say since which version an op reads as it does), or for an opset newer than the
    installed onnx knows; unknown ops are left to the unsupported-op check."""
    if opset <= MAX_OPSET:
        return
    known = onnx.defs.onnx_opset_version()
    if opset > known:
        raise AtlasError(f"the model uses ai.onnx opset {opset}, newer than the installed onnx knows ({known}): "
                         "which of its ops changed cannot be told",
                         hint=f"re-export the model with opset {MAX_OPSET} or older")
    newer = set()
    for node in graph.node:
        if node.domain in ("", "ai.onnx"):
            try:
                if onnx.defs.get_schema(node.op_type, opset, "").since_version > MAX_OPSET:
                    newer.add(node.op_type)
            except onnx.defs.SchemaError:
                pass
    if newer:
        raise AtlasError(f"the model uses ai.onnx opset {opset}, where {', '.join(sorted(newer))} changed after "
                         f"opset {MAX_OPSET}, the newest atlasc knows",
                         hint=f"re-export the model with opset {MAX_OPSET} or older")


def _np(dtype):
    from atlasc.ir.dtypes import to_numpy

    return to_numpy(dtype)


def _has_symbol(x) -> bool:
    if isinstance(x, (tuple, list)):
        return any(_has_symbol(d) for d in x)
    return isinstance(x, S.Expr)


def _subst_attr(x, mapping):
    if isinstance(x, tuple):
        return tuple(_subst_attr(d, mapping) for d in x)
    if isinstance(x, list):
        return [_subst_attr(d, mapping) for d in x]
    if isinstance(x, S.Expr):
        return S.substitute(x, mapping)
    return x
