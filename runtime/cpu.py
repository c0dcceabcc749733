"""Run an artifact on the CPU: the launch schedule executed by the op table's numpy references over a
numpy arena laid out exactly as the artifact's memory plan says.

Every value is read from and written to its planned offset (KV-cache views with their strides), so
a memory-plan bug corrupts results here just as it would on the GPU. This is the reference backend of
`atlasc run --device cpu` and of the artifact tests; it shares the entry-point interface of the GPU
runtime (`run`, `reset`), so the generation loop drives either.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from atlasc.artifact import Artifact
from atlasc.errors import InputError
from atlasc.ir import symbolic as S
from atlasc.ir.interpreter import evaluate_attrs
from atlasc.ir.ops import get
from atlasc.ir.serialize import decode_attrs
from atlasc.runtime.bind import bind_call


class CpuModel:
    """An artifact loaded into a numpy arena."""

    device = "cpu"

    def __init__(self, artifact: Artifact):
        m = artifact.manifest
        self.manifest = m
        try:
            self.arena = np.zeros(m.memory.arena_bytes, np.uint8)
        except (MemoryError, ValueError):
            raise InputError(f"the artifact's arena of {m.memory.arena_bytes} bytes does not fit in this machine's "
                             f"memory", hint="recompile with a smaller --max-batch or --max-seq") from None
        w = artifact.weights_array()
        self.arena[: w.size] = w
        self.weights = {w.name: w for w in m.weights}
        self.symbols = [s.name for s in m.symbols]
        self.bounds = {s.name: (s.lower, s.upper) for s in m.symbols}
        self.nodes = {name: [(n, decode_attrs(n.op, n.attrs)) for n in e.nodes] for name, e in m.entries.items()}

    # -- arena views --------------------------------------------------------------------------
    def view(self, offset: int, dtype: str, shape: tuple, strides: tuple | None = None) -> np.ndarray:
        dt = np.dtype(dtype)
        if strides is None:
            n = int(np.prod(shape, dtype=np.int64))
            return self.arena[offset: offset + n * dt.itemsize].view(dt).reshape(shape)
        base = self.arena[offset:].view(np.uint8)
        return np.lib.stride_tricks.as_strided(base.view(dt) if base.size % dt.itemsize == 0 else
                                               base[: base.size - base.size % dt.itemsize].view(dt),
                                               shape, tuple(s * dt.itemsize for s in strides))

    def kv_cache(self) -> np.ndarray | None:
        kv = self.manifest.kv_cache
        if kv is None:
            return None
        shape = (kv.layers, 2, kv.max_batch, kv.kv_heads, kv.max_seq, kv.head_dim)
        return self.view(kv.offset, kv.dtype, shape)

    def reset(self) -> None:
        """Forget the KV cache contents (a new generation starts)."""
        cache = self.kv_cache()
        if cache is not None:
            cache[...] = 0

    # -- execution ----------------------------------------------------------------------------
    def run(self, entry_name: str, inputs: Mapping[str, np.ndarray], symbols: Mapping[str, int] | None = None,
            outputs: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
        """Execute one entry point (or the narrower twin that serves the call: bind_call); returns its
        outputs (copies) by name (only `outputs` if given)."""
        entry_name, env = bind_call(self.manifest, entry_name, inputs, symbols or {}, self.bounds)
        entry = self.manifest.entries[entry_name]
        dims = self.view(self.manifest.memory.dims_offset, "int64", (len(self.symbols),))
        dims[:] = [env.get(s, 0) for s in self.symbols]
        values = {v.name: v for v in entry.values}

        def tensor(name: str) -> np.ndarray:
            if name in self.weights:
                w = self.weights[name]
                return self.view(w.offset, w.dtype, w.shape)
            v = values[name]
            shape = tuple(S.evaluate(S.from_json(d), env) for d in v.shape)
            strides = None if v.strides is None else tuple(S.evaluate(S.from_json(d), env) for d in v.strides)
            return self.view(v.offset, v.dtype, shape, strides)

        for spec in entry.inputs:
            tensor(spec.name)[...] = inputs[spec.name]
        state = {"kv_cache": self.kv_cache()}
        for node, attrs in self.nodes[entry_name]:
            op = get(node.op)
            args = [None if i is None else tensor(i) for i in node.inputs]
            attrs = evaluate_attrs(node.op, attrs, env)
            outs = op.reference(args, attrs, state) if op.stateful else op.reference(args, attrs)
            for name, arr in zip(node.outputs, outs):
                dst = tensor(name)
                if dst.shape != arr.shape:
                    raise InputError(f"node {node.name}: output {name} is {arr.shape}, planned {dst.shape}")
                np.copyto(dst, arr)
        return {spec.name: tensor(spec.name).copy() for spec in entry.outputs
                if outputs is None or spec.name in outputs}
