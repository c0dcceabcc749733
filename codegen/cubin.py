"""What ptxas decided per kernel, read back out of a cubin (an ELF file) without a GPU.

nvcc records, per kernel, its register count (EIATTR_REGCOUNT in the `.nv.info.<kernel>` sections) and
its static shared memory (the size of the `.nv.shared.<kernel>` section: the kernel's `__shared__`
arrays). The compiler adds the static bytes to each launch's dynamic ones to check them against every
arch's per-block limit (generate.check_shared_memory); the tests compare register counts across builds.
"""

from __future__ import annotations

import struct

EIATTR_REGCOUNT = 0x2F
EIFMT_SVAL = 0x04  # an attribute with a payload of `length` bytes after its 4-byte header
SHARED_PREFIX = ".nv.shared."
RESERVED_SMEM = 1024  # cudaDevAttrReservedSharedMemoryPerBlock on sm80+ (the CUDA driver's, per block)


def _sections(cubin: bytes) -> tuple[list[tuple], list[str], list[str]]:
    """(section headers, section names, symbol names) of a 64-bit little-endian ELF; ValueError if it is
    not one."""
    if cubin[:4] != b"\x7fELF" or len(cubin) < 0x40 or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]

    def cstr(off: int) -> str:
        return cubin[off:cubin.index(b"\0", off)].decode()

    names = [cstr(heads[shstrndx][4] + h[0]) for h in heads]
    symbols: list[str] = []
    if ".symtab" in names:
        symtab = heads[names.index(".symtab")]
        strtab = heads[symtab[6]][4]
        symbols = [cstr(strtab + struct.unpack_from("<I", cubin, symtab[4] + i * 24)[0])
                   for i in range(symtab[5] // 24)]
    return heads, names, symbols


def kernel_registers(cubin: bytes) -> dict[str, int]:
    """kernel -> registers per thread, from the EIATTR_REGCOUNT attributes of the `.nv.info` sections
    (payload: symbol index, count)."""
    heads, names, symbols = _sections(cubin)
    out = {}
    for (_, _, _, _, offset, size, *_), name in zip(heads, names):
        pos = offset
        while name.startswith(".nv.info") and pos + 4 <= offset + size:
            fmt, attr, length = struct.unpack_from("<BBH", cubin, pos)
            if fmt == EIFMT_SVAL:
                if attr == EIATTR_REGCOUNT:
                    sym, count = struct.unpack_from("<II", cubin, pos + 4)
                    out[symbols[sym]] = count
                pos += 4 + length
            else:  # the other formats hold their value in the header's 2 bytes
                pos += 4
    return out


def static_shared_bytes(cubin: bytes) -> dict[str, int]:
    """kernel -> bytes of its own static shared memory (`__shared__` arrays): the size of its
    `.nv.shared.<kernel>` section, less the driver's reserved block of shared memory where ptxas placed it
    inside that section (sm90: a `.nv.shared.reserved.*` section, with every kernel's section 1 KB larger,
    even one without arrays; the per-block limits leave that reserved KB out)."""
    heads, names, _ = _sections(cubin)
    reserved = RESERVED_SMEM if any(n.startswith(SHARED_PREFIX + "reserved.") for n in names) else 0
    return {name[len(SHARED_PREFIX):]: max(0, head[5] - reserved) for head, name in zip(heads, names)
            if name.startswith(SHARED_PREFIX) and not name.startswith(SHARED_PREFIX + "reserved.")}
