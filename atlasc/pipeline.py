"""The pass manager: a registry of passes, named pipelines, and one runner with the instruments.

A pass is `fn(program) -> (program, RewriteStats)`. The runner optionally verifies every entry after
every pass (`verify=True`, always on in tests), dumps the IR (`dump_ir=DIR` writes
`NN-<pass>.txt`), times passes, and collects how often each rewrite fired (`-v`) and why candidates
were declined (`-vv`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from atlasc.errors import AtlasError, VerificationError
from atlasc.ir.printer import format_graph
from atlasc.ir.program import Program
from atlasc.ir.verify import verify
from atlasc.passes.canonicalize import canonicalize
from atlasc.passes.choose_decode_path import choose_decode_path
from atlasc.passes.dce import dce
from atlasc.passes.entry_points import entry_points
from atlasc.passes.fuse_attention import fuse_attention
from atlasc.passes.fuse_residual_norm import fuse_residual_norm
from atlasc.passes.fuse_rmsnorm import fuse_rmsnorm
from atlasc.passes.fuse_rotary import fuse_rotary
from atlasc.passes.merge_linear import merge_linear
from atlasc.passes.fuse_elementwise import fuse_elementwise
from atlasc.passes.fuse_linear import fuse_linear
from atlasc.passes.fuse_linear_epilogue import fuse_linear_epilogue
from atlasc.passes.fuse_linear_prologue import fuse_linear_prologue
from atlasc.passes.mask_as_lengths import mask_as_lengths
from atlasc.passes.plan_memory import plan_memory
from atlasc.passes.quantize import quantize
from atlasc.passes.rewrite import RewriteStats
from atlasc.passes.schedule import schedule
from atlasc.passes.simplify_decode_mask import simplify_decode_mask
from atlasc.passes.smooth_quant import smooth_quant
from atlasc.passes.split_decode import split_decode

PassFn = Callable[[Program], tuple[Program, RewriteStats]]

PASSES: dict[str, PassFn] = {
    "canonicalize": canonicalize,
    "choose-decode-path": choose_decode_path,
    "dce": dce,
    "entry-points": entry_points,
    "fuse-rmsnorm": fuse_rmsnorm,
    "fuse-residual-norm": fuse_residual_norm,
    "fuse-attention": fuse_attention,
    "fuse-rotary": fuse_rotary,
    "fuse-elementwise": fuse_elementwise,
    "fuse-linear": fuse_linear,
    "fuse-linear-prologue": fuse_linear_prologue,
    "fuse-linear-epilogue": fuse_linear_epilogue,
    "mask-as-lengths": mask_as_lengths,
    "merge-linear": merge_linear,
    "quantize": quantize,
    "schedule": schedule,
    "simplify-decode-mask": simplify_decode_mask,
    "smooth-quant": smooth_quant,
    "split-decode": split_decode,
    "plan-memory": plan_memory,
}

PIPELINES: dict[str, list[str]] = {
    "default": [
        "canonicalize",
        "dce",
        "fuse-linear",
        # --smooth: the activation outliers' scales into the weights, before they are quantized
        "smooth-quant",
        "quantize",
        "merge-linear",
        "fuse-rmsnorm",
        "fuse-residual-norm",
        "entry-points",
        # again: decode's seq = 1 turns some movement ops into no-ops
        "canonicalize",
        "dce",
        # before fuse-elementwise, which would absorb the scale and NaN-guard ops the pattern reads
        "fuse-attention",
        "fuse-rotary",
        # ATLAS_MASK_LENGTHS=0 turns it off; before simplify-decode-mask, which then skips what it rewrote
        "mask-as-lengths",
        "simplify-decode-mask",
        "dce",
        "fuse-elementwise",
        "split-decode",
        "fuse-linear-prologue",
        "fuse-linear-epilogue",
        "choose-decode-path",
        "schedule",
        "plan-memory",
    ],
}


@dataclass
class PassRecord:
    name: str
    seconds: float
    applied: dict[str, int]
    declined: dict[str, str]
    nodes_after: dict[str, int]


@dataclass
class PipelineReport:
    records: list[PassRecord] = field(default_factory=list)


def run_pipeline(program: Program, names: list[str] | str = "default", *, verify_each: bool = False,
                 dump_ir: str | Path | None = None, on_pass: Callable[[str], None] | None = None
                 ) -> tuple[Program, PipelineReport]:
    """Run the passes `names` (or a named pipeline) over program; return it with a report.

    Guarantees: with verify_each, every entry verifies after every pass (VerificationError names the
    pass and the node otherwise).
    """
    if isinstance(names, str):
        names = PIPELINES[names]
    report = PipelineReport()
    dump = Path(dump_ir) if dump_ir else None
    if dump:
        try:
            dump.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise AtlasError(f"--dump-ir folder {dump} cannot be created: {e.strerror or e}") from None
        _dump(dump / "00-input.txt", program)
    for index, name in enumerate(names, start=1):
        if on_pass:
            on_pass(name)
        start = time.perf_counter()
        program, stats = PASSES[name](program)
        elapsed = time.perf_counter() - start
        if verify_each:
            for entry, graph in program.entries.items():
                try:
                    verify(graph)
                except VerificationError as e:
                    e.message = f"after pass {name}, entry {entry}: {e.message}"
                    raise
        report.records.append(PassRecord(name, elapsed, dict(stats.applied), dict(stats.declined),
                                         {k: len(g.nodes) for k, g in program.entries.items()}))
        if dump:
            _dump(dump / f"{index:02d}-{name}.txt", program)
    return program, report


def _dump(path: Path, program: Program) -> None:
    try:
        path.write_text("\n\n".join(format_graph(g) for g in program.entries.values()) + "\n")
    except OSError as e:
        raise AtlasError(f"cannot write the IR dump {path}: {e.strerror or e}") from None
