"""split-decode: a second decode entry for small batches, so they get the fusions that need few rows.

Matches a decoder whose `decode` entry may run more than SMALL_BATCH sequences (`--max-batch` above 8).
Adds the entry `decode_small`: a copy of `decode` with the batch bounded by SMALL_BATCH. The passes after
this one see both: fuse-linear-prologue (rows <= 8) and choose-decode-path fuse and specialize only
`decode_small`; each entry gets its own memory plan (entries never run at once: they share the
activations) and kernels. The artifact marks `decode_small` as narrowing `decode` (EntrySpec.narrows /
narrow_upper), and the runtimes (runtime/bind.py bind_call) run it whenever `decode` is called with
at most SMALL_BATCH sequences. Without it a `--max-batch 32` build would run batch 1 unfused.
ATLAS_SPLIT_DECODE=0 turns it off (small batches then run decode's batch-bucket kernels, unfused).

Requires: entry-points. Guarantees: `decode_small` computes what `decode` computes for every batch it
serves (it is the same graph until the later passes rewrite it, each of them equivalence-preserving).
"""

from __future__ import annotations

from atlasc.errors import env_switch
from atlasc.ir.graph import SymbolInfo
from atlasc.ir.ops.prologue import PROLOGUE_MAX_M
from atlasc.ir.program import Program
from atlasc.passes.rewrite import RewriteStats

SMALL_BATCH = PROLOGUE_MAX_M  # the most rows the decode fusions serve
SMALL = "decode_small"
RULE = "decode (batch > 8) => + decode_small (batch <= 8)"
ENV = "ATLAS_SPLIT_DECODE"


def split_decode(program: Program) -> tuple[Program, RewriteStats]:
    """Add `decode_small` when decode's batch bound exceeds SMALL_BATCH (fusion on; a no-op otherwise)."""
    stats = RewriteStats()
    batch = program.roles.get("batch")
    decode = program.entries.get("decode")
    if program.kind != "decoder" or decode is None or batch is None or SMALL in program.entries:
        return program, stats
    upper = program.bounds.get("decode", {}).get(batch)
    if upper is None or upper <= SMALL_BATCH:
        return program, stats
    if not program.options.fusion:
        stats.declined[RULE] = "fusion is off (nothing would differ)"
        return program, stats
    if not env_switch(ENV, True):
        stats.declined[RULE] = f"{ENV}=0"
        return program, stats
    small = decode.clone(SMALL)
    info = small.symbols[batch]
    small.symbols[batch] = SymbolInfo(info.lower, SMALL_BATCH)
    program.entries[SMALL] = small
    program.bounds[SMALL] = {**program.bounds["decode"], batch: SMALL_BATCH}
    program.bindings[SMALL] = dict(program.bindings.get("decode", {}))
    program.narrows[SMALL] = ("decode", {batch: SMALL_BATCH})
    stats.applied[RULE] = 1
    return program, stats
