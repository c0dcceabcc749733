"""A program: the entry-point graphs of one model, plus what they share (weights, KV cache, options).

The pass manager threads a Program through every pass. Before the entry-points pass there is one
entry, "main"; a decoder then has "prefill" and "decode", an encoder "forward". Constants are
shared by reference between entries, so one weights image serves them all.
"""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from atlasc.errors import AtlasError
from atlasc.ir.graph import Graph
from atlasc.ir.memory import MemoryPlan


SPILL_MIN_BYTES = 1 << 20  # smaller constants stay in memory (Program.new_array)


class SpillError(AtlasError):
    """The spill directory has no room for a constant a pass makes."""


@dataclass(frozen=True)
class CompileOptions:
    """What `atlasc compile` was asked for (also read by passes)."""

    archs: tuple[str, ...] = ("sm80", "sm90")
    dtype: str = "auto"  # auto (the model's), fp32 or fp16
    max_batch: int = 8
    max_seq: int = 2048
    fusion: bool = True
    verify: bool = False
    quant: str = "none"  # none | int8 | int4 (weight-only, passes/quantize.py)
    group_size: int = 128  # int4: weights per fp16 scale along K
    zero_points: bool = False  # int4: asymmetric groups (a uint8 zero point per group), else symmetric
    quant_skip: tuple[str, ...] = ()  # fnmatch patterns of linear layers kept in float
    calib: str | None = None  # .npz of calibration token ids for the quantization report (and --gptq)
    gptq: bool = False  # int4: GPTQ rounding on the calibration prompts' activations (passes/gptq.py)
    smooth: float = 0.0  # int8: SmoothQuant's migration strength alpha on the calibration prompts (0: off)
    prefill_logits: str = "all"  # decoders: "all" positions' logits from prefill, or only the "last"


@dataclass(frozen=True)
class KVCacheInfo:
    """The persistent cache `[layers, 2, max_batch, kv_heads, max_seq, head_dim]`."""

    layers: int
    kv_heads: int
    head_dim: int
    max_batch: int
    max_seq: int
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.layers, 2, self.max_batch, self.kv_heads, self.max_seq, self.head_dim)


@dataclass
class Program:
    entries: dict[str, Graph]
    options: CompileOptions = field(default_factory=CompileOptions)
    kind: str = "unknown"  # decoder | encoder | unknown
    kv_cache: KVCacheInfo | None = None
    roles: dict[str, str] = field(default_factory=dict)  # batch / seq / past -> symbol name
    bounds: dict[str, dict[str, int]] = field(default_factory=dict)  # entry -> symbol -> upper bound
    bindings: dict[str, dict[str, int]] = field(default_factory=dict)  # entry -> symbols fixed (decode: seq=1)
    # entry -> (the entry it narrows, symbol -> tighter upper bound): runs it serves instead (split-decode)
    narrows: dict[str, tuple[str, dict[str, int]]] = field(default_factory=dict)
    plans: dict[str, MemoryPlan] = field(default_factory=dict)
    stats: dict[str, dict[str, int]] = field(default_factory=dict)  # pass -> rule -> rewrites
    # quantized node name -> its float weight Value (a merged layer: the tuple of its parts)
    float_weights: dict[str, object] = field(default_factory=dict)
    quantization: dict | None = None  # the quantize pass's report (mode, per-layer errors, bytes)
    smoothing: dict | None = None  # smooth-quant's report (alpha, the inputs it smoothed), into quantization's
    # "int4" / "int8" -> {"paths": rows bucket -> decode path, "source": why} (choose-decode-path)
    decode_paths: dict[str, dict] = field(default_factory=dict)
    # progress of long passes: (stage, detail, (done, total) or None); set by the compile driver
    progress: Callable[..., None] | None = field(default=None, repr=False, compare=False)
    # where passes put the large constants they make (quantized and merged weights): set by the compile
    # driver to a temporary directory that outlives the artifact's write; None keeps them in memory
    spill_dir: Path | None = field(default=None, repr=False, compare=False)

    def decode_steps(self) -> list[str]:
        """The entries that run one decode step per generated token: split-decode's narrow twins of "decode"
        first, then "decode" (empty for a program without one)."""
        if "decode" not in self.entries:
            return []
        return [e for e, (wide, _) in self.narrows.items() if wide == "decode" and e in self.entries] + ["decode"]

    def new_array(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """An uninitialized array for a constant a pass makes. With spill_dir set and at least
        SPILL_MIN_BYTES, a file-backed np.memmap there: its pages are written back and evictable, so
        the compile's own (anonymous) memory stays bounded by the layer in hand, not the model.
        Otherwise np.empty. Either way the caller fills every element."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if self.spill_dir is None or nbytes < SPILL_MIN_BYTES:
            return np.empty(shape, dtype)
        path = Path(self.spill_dir) / f"{uuid.uuid4().hex}.bin"
        with open(path, "wb") as f:
            try:  # reserve the blocks now: a full disk is this error, not a SIGBUS when the map is written
                os.posix_fallocate(f.fileno(), 0, nbytes)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise SpillError(f"no room for {nbytes / 2**20:.0f} MiB of compile spill files in "
                                     f"{self.spill_dir}: {e.strerror}",
                                     hint="point TMPDIR at a disk with room for the quantized weights "
                                     "(a RAM-backed /tmp gives no memory relief)") from None
                f.truncate(nbytes)  # no fallocate on this filesystem: a sparse file
        return np.memmap(path, dtype=dtype, mode="r+", shape=tuple(shape))


def narrowed_lower(program: Program) -> dict[str, dict[str, int]]:
    """{entry: {symbol: value}}: the values an entry runs only above because a narrower twin serves the runs
    up to them (split-decode: `decode` runs batches above decode_small's bound), for generate_module and
    fuse-linear-prologue. Only twins narrowing one symbol count (a call goes to a twin when all its bounds hold,
    so with two the wide entry could still run small values of either); the largest bound over such twins."""
    lower: dict[str, dict[str, int]] = {}
    for wide, bounds in program.narrows.values():
        if len(bounds) == 1:
            (symbol, value), = bounds.items()
            entry = lower.setdefault(wide, {})
            entry[symbol] = max(value, entry.get(symbol, value))
    return lower
