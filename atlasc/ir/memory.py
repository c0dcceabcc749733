"""The memory plan's data: where every value of a scheduled graph lives in the one arena.

Produced by `passes/plan_memory.py`, read by codegen (kernels address `arena + offset`), by the
artifact writer and by the CPU executor. The arena is one allocation made at load time:

    | weights (read-only) | kv cache (persistent) | io (inputs, outputs, dims) | activations (reused) |

Offsets are bytes from the arena's start, every one a multiple of ALIGNMENT. A value is stored
contiguously (row-major in its runtime shape) unless `strides` is set: then element (i0, i1, ...)
lives at offset + itemsize * sum(i_k * strides[k]), strides being dims over the graph's symbols
(a KV-cache view, for instance, walks the cache with max_seq as its row stride).

An alias (a Reshape/Unsqueeze/Squeeze/Flatten/Identity output over a contiguous input) shares its
input's bytes: `aliases` maps it to its root value, and codegen emits no kernel for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALIGNMENT = 256
REGIONS = ("weights", "kv_cache", "io", "activations")


def align(n: int, a: int = ALIGNMENT) -> int:
    """n rounded up to a multiple of a."""
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Placement:
    """Where one value lives: region, byte offset in the arena, byte size reserved, element strides."""

    region: str
    offset: int
    nbytes: int
    strides: tuple | None = None  # None: contiguous in the value's runtime shape


@dataclass(frozen=True)
class Region:
    name: str
    offset: int
    nbytes: int


@dataclass
class MemoryPlan:
    """Placements by value name for one entry point, plus the arena's regions and statistics."""

    regions: dict[str, Region] = field(default_factory=dict)
    placements: dict[str, Placement] = field(default_factory=dict)
    arena_bytes: int = 0
    activation_peak: int = 0  # bytes of the activations region (the planned peak)
    activation_naive: int = 0  # bytes if every activation had its own buffer
    dims_offset: int = 0  # int64[len(symbols)] holding the symbol values at run time
    symbols: tuple[str, ...] = ()  # order of the dims buffer
    lifetimes: dict[str, tuple[int, int]] = field(default_factory=dict)  # activation -> (first, last) step
    aliases: dict[str, str] = field(default_factory=dict)  # value -> the value whose bytes it reuses (no kernel)

    def needs_kernel(self, node) -> bool:
        """False for a reshape whose outputs all alias their input's bytes (nothing to launch)."""
        return not (node.outputs and all(o.name in self.aliases for o in node.outputs))

    def placement(self, value) -> Placement:
        """The placement of a Value (or a value name)."""
        name = value if isinstance(value, str) else value.name
        return self.placements[name]
