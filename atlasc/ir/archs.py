"""What each supported GPU arch allows one thread block, for passes and code generation alike.

MAX_SMEM_PER_BLOCK: the most shared memory (static + dynamic) a block can opt into, per compute
capability (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability"). A launch
asking for more fails on that GPU, so a compile for several archs must fit the smallest.
"""

from __future__ import annotations

KB = 1024
MAX_SMEM_PER_BLOCK = {
    "sm75": 64 * KB,
    "sm80": 163 * KB,
    "sm86": 99 * KB,
    "sm89": 99 * KB,
    "sm90": 227 * KB,
    "sm100": 227 * KB,
    "sm120": 99 * KB,
}
# the generated kernels' own __shared__ arrays, kept free beside the dynamic bytes (ptxas: up to 8544
# bytes, the fused W4A8 projection; docs/perf.md v12)
STATIC_SMEM_RESERVE = 16 * KB


def block_smem(archs: tuple[str, ...]) -> int:
    """The shared memory bytes (static + dynamic) one block may have in a compile for `archs`: the
    smallest arch's limit (the H200's when archs is empty)."""
    return min(MAX_SMEM_PER_BLOCK[a] for a in (archs or ("sm90",)))


def min_arch(archs: tuple[str, ...]) -> int:
    """The lowest compute capability of a compile for `archs` as a number (sm75 -> 75; 90 when empty)."""
    return min(int(a[2:]) for a in (archs or ("sm90",)))


def blocks_per_sm(archs: tuple[str, ...], block_bytes: int) -> int:
    """How many blocks of `block_bytes` shared memory (static + dynamic) one SM holds at once on every arch
    of the compile: an SM has its per-block limit plus 1 KB, and each block takes 1 KB more for the system
    (CUDA C++ Programming Guide, shared memory per SM)."""
    return min((MAX_SMEM_PER_BLOCK[a] + KB) // (block_bytes + KB) for a in (archs or ("sm90",)))


def max_dynamic_smem(archs: tuple[str, ...]) -> int:
    """The dynamic shared memory bytes a kernel may ask for in a compile for `archs`: block_smem less
    STATIC_SMEM_RESERVE (for a kernel that knows its static bytes, block_smem less those)."""
    return block_smem(archs) - STATIC_SMEM_RESERVE


# the copy-engine + wgmma decode projection of an sm90-only compile (codegen/linear_tma.py); fuse-linear-prologue
# asks too (it fuses norms into that path's kernels only)
COPY_ENGINE_ENV = "ATLAS_LINEAR_TMA"


def copy_engine_switch() -> bool:
    """ATLAS_LINEAR_TMA (default 1); UsageError (exit 2) for a value not 0 or 1."""
    from atlasc.errors import env_switch

    return env_switch(COPY_ENGINE_ENV, True)


# the copy-engine quantized projections (codegen/quant_bulk.py): 1 every eligible batch-1 int4 / int8 projection,
# auto (default) those choose-decode-path gave that path (passes/decode_paths.yaml "bulk rows 1",
# ATLAS_INT4_PATH=w4a16-bulk), 0 none
QUANT_BULK_ENV = "ATLAS_QUANT_BULK"


def quant_bulk_mode(error=None) -> str:
    """ATLAS_QUANT_BULK: "auto" (default), "0" or "1"; `error` (default UsageError, exit 2) for another value."""
    from atlasc.errors import UsageError, env_choice

    return env_choice(QUANT_BULK_ENV, "auto", ("0", "1", "auto"), "a copy-engine projection mode", error or UsageError)


def copy_engine(archs: tuple[str, ...]) -> bool:
    """Whether a compile for `archs` may use the copy-engine projection: sm90 alone, the switch on."""
    return tuple(archs) == ("sm90",) and copy_engine_switch()
