"""The manifest of an `.atlas` file: frozen dataclasses, the only types the compiler and runtime share.

Everything the runtime needs is written here, never inferred from a file name: the entry points with
their I/O signatures, the kernel table and launch schedule with arena offsets, the memory plan, the
KV-cache geometry, where each weight sits in the weights image, and the sha256 of every member.

JSON form: `Manifest.to_json()` gives a dict of plain JSON values (tuples become lists), and
`Manifest.from_json(d)` checks every field's type and raises `ArtifactError` naming the first bad
field by its path (`entries.decode.nodes[3].grid`). `Manifest.from_json(m.to_json()) == m`.

Dims (in shapes, grids and strides) are opaque JSON here: an int, or the dict that
`atlasc.ir.symbolic.to_json` makes of a symbolic dim. Free-form fields (`options`, `report`,
`attrs`) hold any JSON object; they are normalized on construction (tuples -> lists, numpy scalars
and arrays -> Python values) so that a round trip through JSON compares equal.
"""

from __future__ import annotations

import importlib.metadata
import re
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Union

from atlasc.errors import ArtifactError

MAGIC = "ATLAS"
ARCH_RE = re.compile(r"sm\d+[a-z]?")  # a target arch as the manifest names it: sm80, sm90, sm90a
CUBIN_RE = re.compile(rf"cubin/({ARCH_RE.pattern})(?:\.([1-9]\d*))?\.cubin")  # cubin/<arch>[.<part>].cubin
FORMAT_VERSION = 7  # 2: NodeSpec.symbol / variants (kernels specialized per batch bucket); 3: EntrySpec.narrows;
# 4: a chunked build's cubins as parts cubin/<arch>.<i>.cubin (modules loaded side by side, no nvlink);
# 5: NodeSpec.args / VariantSpec.args (the arena offsets a kernel shared by several nodes takes);
# 6: MemorySpec.tensor_maps (the runtime must write them before any launch);
# 7: NodeSpec.co_resident (the runtime must launch such a kernel on at most one block per SM: an older one would not,
# and a chain's grid barrier would never complete on a GPU of fewer SMs than its grid)
KV_LAYOUT = "[layers, 2, max_batch, kv_heads, max_seq, head_dim]"


def _atlasc_version() -> str:
    """The installed atlasc's version (`atlasc.__version__`, read from package metadata: tests/test_layering.py
    lets this layer import only atlasc.errors from the project, and `atlasc` itself is not a leaf)."""
    try:
        return importlib.metadata.version("atlasc")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"

Dim = Union[int, dict]  # an int or symbolic.to_json's dict; opaque to this module
Json = dict  # a free-form JSON object


def _canon_json(v: Any, where: str) -> Any:
    """v as plain JSON values: tuples -> lists, numpy scalars/arrays -> Python; refuses anything else."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return float(v)
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise ArtifactError(f"manifest field {where}: key {k!r} is not a string")
            out[k] = _canon_json(x, f"{where}.{k}")
        return out
    if isinstance(v, (list, tuple)):
        return [_canon_json(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if hasattr(v, "tolist") and type(v).__module__ == "numpy":  # numpy scalar or array
        return _canon_json(v.tolist(), where)
    raise ArtifactError(f"manifest field {where}: {type(v).__name__} is not JSON-able")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _describe(tp: Any) -> str:
    if tp is Json:
        return "a JSON object"
    if tp == Dim:
        return "a dim (an int or a symbolic-dim object)"
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_describe(args[0])}"
        return f"a list of {len(args)} items"
    if origin is dict:
        return "an object"
    if tp is type(None):
        return "null"
    if is_dataclass(tp):
        return "an object"
    return {int: "an int", str: "a string", bool: "a bool"}.get(tp, getattr(tp, "__name__", str(tp)))


def _got(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _decode(tp: Any, v: Any, where: str) -> Any:
    """The typed value of JSON value v for annotation tp; ArtifactError naming `where` if it does not fit."""
    bad = ArtifactError(f"manifest field {where}: expected {_describe(tp)}, got {_got(v)}")
    if tp is Json:
        if not isinstance(v, dict):
            raise bad
        return _canon_json(v, where)
    if tp == Dim:
        if _is_int(v):
            return v
        if isinstance(v, dict):
            return _canon_json(v, where)
        raise bad
    if tp is int:
        if not _is_int(v):
            raise bad
        return v
    if tp is str:
        if not isinstance(v, str):
            raise bad
        return v
    if tp is bool:
        if not isinstance(v, bool):
            raise bad
        return v
    if tp is type(None):
        if v is not None:
            raise bad
        return None
    if is_dataclass(tp):
        if not isinstance(v, dict):
            raise bad
        return _decode_dataclass(tp, v, where)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _decode(a, v, where)
            except ArtifactError:
                if len([x for x in args if x is not type(None)]) == 1:
                    raise
        raise bad
    if origin is tuple:
        if not isinstance(v, (list, tuple)):
            raise bad
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], x, f"{where}[{i}]") for i, x in enumerate(v))
        if len(v) != len(args):
            raise bad
        return tuple(_decode(a, x, f"{where}[{i}]") for i, (a, x) in enumerate(zip(args, v)))
    if origin is dict:
        if not isinstance(v, dict):
            raise bad
        return {k: _decode(args[1], x, f"{where}.{k}") for k, x in v.items()}
    raise TypeError(f"manifest: no decoder for annotation {tp!r}")  # a bug in this module


def _decode_dataclass(cls: type, d: dict, where: str) -> Any:
    hints = _hints(cls)
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ArtifactError(f"manifest field {where + '.' if where else ''}{unknown[0]}: unknown field")
    kwargs = {}
    for f in fields(cls):
        sub = f"{where}.{f.name}" if where else f.name
        if f.name not in d:
            if f.default is not MISSING or f.default_factory is not MISSING:
                continue  # optional: the dataclass default applies
            raise ArtifactError(f"manifest field {sub}: missing")
        kwargs[f.name] = _decode(hints[f.name], d[f.name], sub)
    return cls(**kwargs)


def _encode(v: Any) -> Any:
    if is_dataclass(v):
        return {f.name: _encode(getattr(v, f.name)) for f in fields(v)}
    if isinstance(v, (tuple, list)):
        return [_encode(x) for x in v]
    if isinstance(v, dict):
        return {k: _encode(x) for k, x in v.items()}
    return v


def _tuple(v: Any, where: str) -> tuple:
    if isinstance(v, tuple):
        return v
    if isinstance(v, list):
        return tuple(v)
    raise ArtifactError(f"manifest field {where}: expected a list, got {_got(v)}")


def _dim(v: Any, where: str) -> Any:
    if _is_int(v):
        return v
    if hasattr(v, "item") and type(v).__module__ == "numpy":
        return int(v)
    if isinstance(v, dict):
        return _canon_json(v, where)
    raise ArtifactError(f"manifest field {where}: expected a dim (int or symbolic-dim object), got {_got(v)}")


def _dims(v: Any, where: str) -> tuple:
    return tuple(_dim(x, f"{where}[{i}]") for i, x in enumerate(_tuple(v, where)))


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


class _Spec:
    """Shared JSON methods of the manifest dataclasses."""

    def to_json(self) -> dict:
        """Plain JSON values (dicts, lists, str, int, float, bool, None)."""
        return _encode(self)

    @classmethod
    def from_json(cls, d: Any, where: str = ""):
        """The dataclass from its JSON form; ArtifactError naming the first bad field."""
        if not isinstance(d, dict):
            raise ArtifactError(f"manifest{' field ' + where if where else ''}: expected an object, got {_got(d)}")
        return _decode_dataclass(cls, d, where)


@dataclass(frozen=True)
class SourceInfo(_Spec):
    """The model the artifact was compiled from."""

    name: str  # the ONNX file's name (informational only)
    sha256: str  # hex digest of the ONNX file (+ external data, if any)


@dataclass(frozen=True)
class SymbolSpec(_Spec):
    """A run-time dim; `Manifest.symbols`' order is the order of the dims buffer in the arena."""

    name: str
    lower: int
    upper: int  # the compile-time maximum the memory plan is sized for


@dataclass(frozen=True)
class RegionSpec(_Spec):
    offset: int  # bytes from the arena's start
    nbytes: int


TENSOR_MAP_BYTES = 128  # a CUtensorMap
TENSOR_MAP_ITEMSIZE = {"float16": 2, "uint8": 1}  # the element types a tensor map may have, and their bytes


@dataclass(frozen=True)
class TensorMapSpec(_Spec):
    """A copy-engine tensor map (cuTensorMapEncodeTiled) the runtime writes into the 128 bytes at arena offset
    `slot` after the weights are in: the row-major `dtype` matrix of `rows` x `cols` at arena offset `address`
    (rows `row_bytes` apart), boxes of `box_rows` x `box_cols`: float16 with the 128-byte swizzle
    (codegen/linear_tma.cu), uint8 (the bytes of packed int4 or int8 weight rows) without (codegen/quant_bulk.cu)."""

    slot: int
    address: int
    rows: int
    cols: int
    row_bytes: int
    box_rows: int
    box_cols: int
    dtype: str


@dataclass(frozen=True)
class MemorySpec(_Spec):
    """The static memory plan: one arena, four regions (weights, kv_cache, io, activations)."""

    alignment: int
    arena_bytes: int
    regions: dict[str, RegionSpec]
    dims_offset: int  # arena offset of the int64 dims buffer (one per `Manifest.symbols`)
    activation_peak: int  # planned activation bytes (with reuse)
    activation_naive: int  # sum of all activation sizes (no reuse), for the report
    tensor_maps: tuple[TensorMapSpec, ...] = ()  # written at load, in the region "tensor_maps"


@dataclass(frozen=True)
class KVCacheSpec(_Spec):
    """The persistent KV cache, laid out as `layout` says, at `offset` in the arena."""

    layers: int
    kv_heads: int
    head_dim: int
    max_batch: int
    max_seq: int
    dtype: str
    offset: int
    layout: str = KV_LAYOUT


@dataclass(frozen=True)
class WeightSpec(_Spec):
    """One weight: `nbytes` at `offset` within the weights image (weights.bin), row-major."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def __post_init__(self):
        _set(self, "shape", _tuple(self.shape, f"weights.{self.name}.shape"))


@dataclass(frozen=True)
class IOSpec(_Spec):
    """An entry point's input or output: its staging buffer in the arena's io region."""

    name: str
    dtype: str
    shape: tuple[Dim, ...]
    offset: int
    nbytes: int  # at the symbols' upper bounds

    def __post_init__(self):
        _set(self, "shape", _dims(self.shape, f"{self.name}.shape"))


@dataclass(frozen=True)
class ValueSpec(_Spec):
    """A value of the schedule and where it lives (strides None: contiguous, row-major)."""

    name: str
    dtype: str
    shape: tuple[Dim, ...]
    offset: int
    nbytes: int
    strides: tuple[Dim, ...] | None = None

    def __post_init__(self):
        _set(self, "shape", _dims(self.shape, f"{self.name}.shape"))
        if self.strides is not None:
            _set(self, "strides", _dims(self.strides, f"{self.name}.strides"))


@dataclass(frozen=True)
class VariantSpec(_Spec):
    """A node's launch for runs whose bucket symbol is at most `upto` (a kernel generated for them)."""

    upto: int
    kernel: str
    grid: tuple[Dim, Dim, Dim]
    block: tuple[int, int, int]
    smem: int
    args: tuple[int, ...] = ()  # as NodeSpec.args

    def __post_init__(self):
        _set(self, "grid", _dims(self.grid, f"{self.kernel}.grid"))
        _set(self, "block", _tuple(self.block, f"{self.kernel}.block"))
        _set(self, "args", _tuple(self.args, f"{self.kernel}.args"))


@dataclass(frozen=True)
class NodeSpec(_Spec):
    """One launch of the schedule: the op it computes, its kernel and launch geometry (valid for every
    run-time size), and `variants` (tightest first) for runs whose `symbol` is at most their `upto`."""

    name: str
    op: str
    inputs: tuple[str | None, ...]  # value names; None for an omitted optional input
    outputs: tuple[str, ...]
    attrs: Json
    kernel: str  # symbol name in the cubin; "" for a reshape whose output aliases its input (no launch)
    grid: tuple[Dim, Dim, Dim]
    block: tuple[int, int, int]
    smem: int  # dynamic shared memory, bytes
    symbol: str = ""  # the bucket symbol of the variants ("" when none)
    variants: tuple[VariantSpec, ...] = ()
    # the arena offsets passed after the arena pointer: a kernel shared by nodes whose code differs only in
    # them (a model's layers) takes them as a parameter; () for a kernel of one node (offsets in its code)
    args: tuple[int, ...] = ()
    # every block of the launch must be resident at once (a chain's grid barrier, codegen/quant_chain.py): the
    # runtime launches at most one block per SM of the GPU (runtime/gpu.py co_resident_caps)
    co_resident: bool = False

    def __post_init__(self):
        _set(self, "variants", _tuple(self.variants, f"{self.name}.variants"))
        _set(self, "args", _tuple(self.args, f"{self.name}.args"))
        _set(self, "inputs", _tuple(self.inputs, f"{self.name}.inputs"))
        _set(self, "outputs", _tuple(self.outputs, f"{self.name}.outputs"))
        _set(self, "attrs", _canon_json(self.attrs, f"{self.name}.attrs"))
        _set(self, "grid", _dims(self.grid, f"{self.name}.grid"))
        _set(self, "block", _tuple(self.block, f"{self.name}.block"))


@dataclass(frozen=True)
class EntrySpec(_Spec):
    """An entry point (`prefill`, `decode`, `forward`): its signature, values and launch schedule."""

    name: str
    inputs: tuple[IOSpec, ...]
    outputs: tuple[IOSpec, ...]
    bindings: dict[str, int]  # symbols fixed for this entry, e.g. {"seq": 1} for decode
    values: tuple[ValueSpec, ...]
    nodes: tuple[NodeSpec, ...]  # in launch order
    # a narrower twin of another entry (passes/split_decode.py): calls of `narrows` whose symbols are within
    # narrow_upper run this entry instead (runtime/bind.py bind_call)
    narrows: str = ""
    narrow_upper: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        for name in ("inputs", "outputs", "values", "nodes"):
            _set(self, name, _tuple(getattr(self, name), f"entries.{self.name}.{name}"))


@dataclass(frozen=True)
class MemberSpec(_Spec):
    sha256: str  # hex digest of the member's bytes
    size: int  # bytes


@dataclass(frozen=True, kw_only=True)
class Manifest(_Spec):
    """manifest.json of an `.atlas` file."""

    magic: str = MAGIC
    format_version: int = FORMAT_VERSION
    atlasc_version: str = field(default_factory=_atlasc_version)
    source: SourceInfo
    options: Json  # compile options as given (free-form)
    archs: tuple[str, ...]  # e.g. ("sm80", "sm90"): a cubin/<arch>.cubin member each (+ parts .1, .2, ...)
    symbols: tuple[SymbolSpec, ...]
    memory: MemorySpec
    kv_cache: KVCacheSpec | None
    weights: tuple[WeightSpec, ...]
    entries: dict[str, EntrySpec]
    members: dict[str, MemberSpec] = field(default_factory=dict)  # filled in by write_artifact
    report: Json = field(default_factory=dict)  # compile report, accuracy numbers (free-form)

    def __post_init__(self):
        _set(self, "archs", _tuple(self.archs, "archs"))
        _set(self, "symbols", _tuple(self.symbols, "symbols"))
        _set(self, "weights", _tuple(self.weights, "weights"))
        _set(self, "options", _canon_json(self.options, "options"))
        _set(self, "report", _canon_json(self.report, "report"))

    @classmethod
    def from_json(cls, d: Any, where: str = "") -> Manifest:
        """Checks magic and format version first, so a newer format is refused before its fields are read."""
        if not isinstance(d, dict):
            raise ArtifactError(f"manifest: expected an object, got {_got(d)}")
        magic = d.get("magic")
        if magic != MAGIC:
            raise ArtifactError(f"not an .atlas manifest (magic {_got(magic)}, expected {MAGIC!r})")
        version = d.get("format_version")
        if not _is_int(version):
            raise ArtifactError(f"manifest field format_version: expected an int, got {_got(version)}")
        if version > FORMAT_VERSION:
            raise ArtifactError(
                f"artifact format version {version} is newer than this atlasc supports ({FORMAT_VERSION}); "
                "upgrade atlasc")
        if version < 1:
            raise ArtifactError(f"manifest field format_version: {version} is not a valid format version")
        m = _decode_dataclass(cls, d, where)
        m.check()
        return m

    def check(self) -> None:
        """Consistency beyond types: entry keys match entry names, bounds are sane, weights fit."""
        for key, entry in self.entries.items():
            if entry.name != key:
                raise ArtifactError(f"manifest field entries.{key}.name: is {entry.name!r}, expected {key!r}")
        self._check_archs()
        names = {s.name for s in self.symbols}
        for key, entry in self.entries.items():
            if len({n.symbol for n in entry.nodes if n.variants}) > 1:
                raise ArtifactError(f"manifest field entries.{key}.nodes: kernel variants over several symbols")
            for i, n in enumerate(entry.nodes):
                uptos = [v.upto for v in n.variants]
                if n.variants and (n.symbol not in names or uptos != sorted(set(uptos)) or not n.kernel):
                    raise ArtifactError(f"manifest field entries.{key}.nodes[{i}].variants: need a known symbol "
                                        f"(got {n.symbol!r}) and strictly increasing upto values (got {uptos})")
                if n.co_resident and (not n.kernel or n.variants):
                    raise ArtifactError(f"manifest field entries.{key}.nodes[{i}].co_resident: only a kernel "
                                        "without variants may need its blocks resident at once")
        self._check_args()
        region = self.memory.regions.get("tensor_maps")
        for i, t in enumerate(self.memory.tensor_maps):
            where = f"manifest field memory.tensor_maps[{i}]"
            last = region.offset + region.nbytes - TENSOR_MAP_BYTES if region else -1
            if region is None or not region.offset <= t.slot <= last or t.slot % 64:
                raise ArtifactError(f"{where}: slot {t.slot} is not a 64-byte aligned slot of the region tensor_maps")
            if min(t.address, t.rows, t.cols) < 0 or t.address + t.rows * t.row_bytes > self.memory.arena_bytes:
                raise ArtifactError(f"{where}: its matrix lies outside the arena (0..{self.memory.arena_bytes})")
            size = TENSOR_MAP_ITEMSIZE.get(t.dtype, 0)
            if not size or t.address % 16 or t.row_bytes % 16 or t.row_bytes < size * t.cols or \
                    not 0 < t.box_rows <= 256 or not 0 < t.box_cols * size <= 128:
                raise ArtifactError(f"{where}: not a float16 or uint8 matrix with 16-byte aligned rows read in boxes "
                                    f"of at most 256 rows x 128 bytes")
        for i, s in enumerate(self.symbols):
            if not 0 <= s.lower <= s.upper:
                raise ArtifactError(f"manifest field symbols[{i}]: bounds {s.lower}..{s.upper} are not valid")
        for i, w in enumerate(self.weights):
            if w.offset < 0 or w.nbytes < 0:
                raise ArtifactError(f"manifest field weights[{i}] ({w.name}): negative offset or size")
            if any(not _is_int(n) or n < 0 for n in w.shape):
                raise ArtifactError(f"manifest field weights[{i}].shape: expected non-negative ints")
        wb = self.members.get("weights.bin")
        if wb is not None:
            for i, w in enumerate(self.weights):
                if w.offset + w.nbytes > wb.size:
                    raise ArtifactError(
                        f"manifest field weights[{i}] ({w.name}): bytes {w.offset}..{w.offset + w.nbytes} "
                        f"lie outside weights.bin ({wb.size} bytes)")

    def _check_archs(self) -> None:
        """Arch names are well formed and distinct, and (once members are recorded) each has its cubin and no
        cubin is for an arch not listed: a manifest edited to name another arch would load the wrong code."""
        for a in self.archs:
            if not isinstance(a, str) or not ARCH_RE.fullmatch(a):
                raise ArtifactError(f"manifest field archs: {a!r} is not an arch name such as 'sm90'")
        if len(set(self.archs)) != len(self.archs):
            raise ArtifactError(f"manifest field archs: {list(self.archs)} names an arch twice")
        if self.members:
            have = {m.group(1) for name in self.members if (m := CUBIN_RE.fullmatch(name))}
            if have != set(self.archs):
                raise ArtifactError(f"manifest field archs: lists {', '.join(self.archs) or 'none'} but the cubins are "
                                    f"for {', '.join(sorted(have)) or 'none'}")

    def _check_args(self) -> None:
        """Every launch's offsets lie in the arena, and every launch of one kernel passes as many (its
        parameter list is fixed: a launch with others would read garbage or be refused)."""
        counts: dict[str, int] = {}
        for key, entry in self.entries.items():
            for i, n in enumerate(entry.nodes):
                for launch in (n, *n.variants):
                    where = f"entries.{key}.nodes[{i}] ({launch.kernel})"
                    if not all(_is_int(a) and 0 <= a <= self.memory.arena_bytes for a in launch.args):
                        raise ArtifactError(f"manifest field {where}.args: expected arena offsets in "
                                            f"0..{self.memory.arena_bytes}")
                    if counts.setdefault(launch.kernel, len(launch.args)) != len(launch.args):
                        raise ArtifactError(f"manifest field {where}.args: {len(launch.args)} offsets, but another "
                                            f"launch of the kernel passes {counts[launch.kernel]}")

    def kernels(self) -> list[str]:
        """The distinct kernels the entries launch (defaults and variants), sorted: what the cubins hold. Fewer
        than the launches where nodes share a kernel (a model's layers, NodeSpec.args)."""
        return sorted({launch.kernel for e in self.entries.values() for n in e.nodes if n.kernel
                       for launch in (n, *n.variants)})

    def weight(self, name: str) -> WeightSpec:
        for w in self.weights:
            if w.name == name:
                return w
        raise ArtifactError(f"no weight named {name!r} in this artifact")
