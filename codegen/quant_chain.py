"""Chains: consecutive copy-engine projections of a batch-1 decode step in one persistent launch (quant_bulk.cu
qb_chain_phase).

In a Llama layer's int4 decode step on the copy-engine path (quant_bulk.py) the projections after the attention, o,
the (Add)RMSNorm with gate/up and SwiGLU, and down (in the last layer also the final norm with the LM head), are
consecutive kernels with nothing else between them. Each boundary lets DRAM idle: the last blocks' tail, the next
kernel's blocks waiting for the shared memory the previous kernel's blocks hold, their first copies' latency.
examples/chain_lab.cu measured a layer's projections in one persistent launch 14-25% under one launch each (H100,
docs/perf.md v47-v48). A chain runs such a run of kernels as the phases of one kernel: one block per SM, one ring of
stages that the producer warp fills across the phases (the weights are constants), a grid barrier between the phases
for the consumers. Each phase keeps its kernel's weights, source, epilogue, K split and arithmetic, so the results
are those of the kernels it replaces.

ATLAS_QUANT_BULK_CHAIN=1 (default 0: correct on an H200 but 2.3% slower than one launch each, docs/perf.md v53)
chains every run of at least two consecutive launches of a decode step compiled for one row (--max-batch 1: the
step's default kernels are its batch-1 ones; a bucket variant is not chained) that quant_bulk.py serves, when the
copies start before the wait (ATLAS_QUANT_BULK_EARLY=1, the default) and a ring of at least 2 stages fits beside
every phase's x. The block has the most consumer warps of its phases; a phase of fewer (a rotary QKV projection,
rotary_warps: 8 for 128-dim heads against 16) uses that many of them and part of each ring slot, as its own kernel
would. So a Llama layer after the first runs as attention and one chain (o, gate/up, down, the next layer's QKV +
rotary + cache append), the LM head closing the last. The chain's launch is marked co_resident (its blocks must all
be resident: the runtime launches at most one per SM), recorded per kernel (`chain`: its nodes in order), and its
nodes after the first launch nothing (their manifest kernel is "")."""

from __future__ import annotations

from dataclasses import dataclass

from atlasc.codegen.generate import CodegenError, KernelCode
from atlasc.errors import env_switch

CHAIN_ENV = "ATLAS_QUANT_BULK_CHAIN"
LINE = 32  # counters per 128-byte line: the grid barrier's words each get one


@dataclass(frozen=True)
class ChainPhase:
    """What quant_bulk.emit needs to emit a node as a chain's phase (KernelContext.chain_phase)."""

    first: bool  # the phase that waits for the previous kernel (the others wait at the grid barrier)
    last: bool  # the phase whose producer holds to the end (HOLD)
    stages: int  # the chain's ring
    warps: int  # the block's consumer warps (the most of its phases')


def chain_choice() -> bool:
    """ATLAS_QUANT_BULK_CHAIN (default off: slower, docs/perf.md v53); CodegenError unless 0 or 1. Recorded in the
    artifact's codegen choices."""
    return env_switch(CHAIN_ENV, False, CodegenError)


def chain_runs(kernels: list[tuple[str, dict | None]]) -> list[list[int]]:
    """Index runs (at least 2 long) of consecutive launches that may form a chain: an entry's launches in order as
    (kernel, its recorded choice or None), a launch chaining with the one before it when both are copy-engine
    projections (choice path "bulk") with early copies. Aliased reshapes have no launch and so break nothing."""
    runs: list[list[int]] = []
    current: list[int] = []
    for i, (_, choice) in enumerate(kernels):
        if choice and choice.get("path") == "bulk" and choice.get("early"):
            current.append(i)
            continue
        if len(current) >= 2:
            runs.append(current)
        current = []
    if len(current) >= 2:
        runs.append(current)
    return runs


def block_warps(codes: list[KernelCode]) -> int:
    """The chain's consumer warps: the most of its phases'."""
    return max(c.choice["config"][0] for c in codes)


def _x_area(code: KernelCode, warps: int) -> int:
    """A phase's shared memory past the ring in a block of `warps` consumer warps: its kernel's less its stages, and a
    norm source's float per warp for the block's extra warps (all of them stage the norm)."""
    w, stages = code.choice["config"][:2]
    return code.smem - stages * 16 * w * 64 + (4 * (warps - w) if code.choice.get("norm") else 0)


def ring_stages(codes: list[KernelCode], limit: int) -> int:
    """The chain's stages: the most, up to the phases' own (each kernel's configured or fitted count), with which the
    ring and the largest phase's x area (a kernel's shared memory less its stages) fit `limit` bytes; 0 where not even
    2 stages do."""
    w = block_warps(codes)
    stage = 16 * w * 64
    x_area = max(_x_area(c, w) for c in codes)
    stages = min(c.choice["config"][1] for c in codes)
    while stages >= 2 and stages * stage + x_area > limit:
        stages -= 1
    return stages if stages >= 2 else 0


def smem(codes: list[KernelCode], stages: int) -> int:
    """Dynamic shared memory of a chain of these phases (as ring_stages counts it)."""
    w = block_warps(codes)
    return stages * 16 * w * 64 + max(_x_area(c, w) for c in codes)


def barrier_index(codes: list[KernelCode]) -> int:
    """The counter index of the chain's grid-barrier words: past the phases' K-split counters, on a line of its own."""
    return -(-max(c.counters for c in codes) // LINE) * LINE


def assemble(names: list[str], phases: list[KernelCode], stages: int, counters_address: str, grid: int,
             plain: list[dict]) -> KernelCode:
    """The chain's KernelCode from its phases' (emitted with KernelContext.chain_phase set, in order): the ring, each
    phase in a scope of its own (their bindings share names), the end. names: the nodes; plain: their choices as
    single kernels (recorded). CodegenError where a phase's bindings would sync the block (the producer warp does not
    reach them in step with the consumers), that is not a copy-engine phase, or that needs code outside its body."""
    for name, code in zip(names, phases):
        if "__syncthreads" in code.body or "bar.sync 0" in code.body:
            raise CodegenError(f"{name}: a chain phase's bindings sync the whole block")
        if (code.choice or {}).get("path") != "bulk" or "atlas::qb_chain_phase<" not in code.body:
            raise CodegenError(f"{name}: planned as a chain's phase, but not emitted as one")
        if code.preamble or code.prefetch or code.dims_late:
            raise CodegenError(f"{name}: a chain phase has code outside its body (a preamble, a prefetch, late dims)")
    w = block_warps(phases)
    base = barrier_index(phases)
    lines = [f"  // a chain of {len(phases)} projections (quant_chain.py): {', '.join(names)}",
             f"  auto qb_ring = atlas::qb_chain_begin<{w}, {stages}>(reinterpret_cast<unsigned int*>("
             f"{counters_address}) + {base});"]
    for name, code in zip(names, phases):
        lines += [f"  {{  // {name}", *("  " + line for line in code.body.split("\n")), "  }"]
    lines.append(f"  atlas::qb_chain_end(qb_ring, threadIdx.x < {32 * w});")
    choice = {"path": "bulk-chain", "chain": list(names), "config": [w, stages, 1],
              "phases": [{**p, **{k: v for k, v in c.choice.items() if k in ("ks", "inflight")}}
                         for p, c in zip(plain, phases)]}
    return KernelCode("\n".join(lines), (grid, 1, 1), (32 * w + 32, 1, 1), smem=smem(phases, stages),
                      scratch=max(c.scratch for c in phases), counters=base + 2 * LINE, choice=choice, min_blocks=1,
                      waits_inside=True)
