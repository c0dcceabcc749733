"""Reading an `.atlas` file, with the standard library and numpy only.

`open_artifact` checks everything before handing the artifact out, and every failure is one
`ArtifactError` line that names the file: missing, not a zip, truncated, a member path that escapes
the archive, a compressed or encrypted member, no or malformed manifest, wrong magic, newer format,
a member missing, unlisted or of the wrong size, a manifest whose zip CRC-32 does not match, and (with
verify=True) any sha256 mismatch.

Members are read straight from the file at their data offsets (they are STORED), so the weights can
be memory-mapped in place: `Artifact.weights_array()`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np

from atlasc.errors import ArtifactError

from .manifest import Manifest
from .writer import CHUNK, CUBIN_RE, MANIFEST, SOURCE, WEIGHTS, check_member_name, cubin_member

LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # signature ... name length, extra length (30 bytes)
LOCAL_MAGIC = b"PK\x03\x04"


def arch_name(arch: str) -> str:
    """'sm_86', 'sm86', '86', 'compute_86' -> 'sm86'."""
    m = re.fullmatch(r"(?:sm_?|compute_?)?(\d+[a-z]?)", arch.strip().lower())
    if not m:
        raise ArtifactError(f"not a GPU arch: {arch!r} (expected e.g. sm90)")
    return f"sm{m.group(1)}"


class Artifact:
    """An opened, validated `.atlas` file. Use as a context manager, or call `close()`."""

    def __init__(self, path: Path, fp, manifest: Manifest, layout: dict[str, tuple[int, int]]):
        self.path = path
        self.manifest = manifest
        self._fp = fp
        self._layout = layout  # member name -> (data offset in the file, size)

    # --- members --------------------------------------------------------------------------
    @property
    def member_names(self) -> tuple[str, ...]:
        return tuple(self._layout)

    def read_member(self, name: str) -> bytes:
        """The bytes of one member."""
        if name not in self._layout:
            raise ArtifactError(f"{self.path}: no member {name!r} in this artifact")
        if self._fp is None:
            raise ArtifactError(f"{self.path}: the artifact is closed")
        offset, size = self._layout[name]
        self._fp.seek(offset)
        data = self._fp.read(size)
        if len(data) != size:
            raise ArtifactError(f"{self.path}: member {name} is truncated (the file changed after it was opened)")
        return data

    def cubin(self, arch: str) -> bytes:
        """The (first) cubin for `arch` ('sm90', 'sm_90' or '90'); cubins() gives every part."""
        return self.cubins(arch)[0]

    def cubins(self, arch: str) -> list[bytes]:
        """Every cubin for `arch`, in part order: one, or one per chunk of a chunked build (each loads as
        its own module; together they hold every kernel)."""
        want = arch_name(arch)
        if cubin_member(want) not in self._layout:
            have = sorted({m.group(1) for n in self._layout if (m := CUBIN_RE.fullmatch(n))})
            raise ArtifactError(
                f"{self.path}: no cubin for sm_{want[2:]} in this artifact (it has: {', '.join(have) or 'none'}); "
                f"recompile with --arch {want}")
        parts = []
        while cubin_member(want, len(parts)) in self._layout:
            parts.append(self.read_member(cubin_member(want, len(parts))))
        return parts

    def source(self) -> str:
        """The generated CUDA source (kernels.cu)."""
        return self.read_member(SOURCE).decode("utf-8")

    # --- weights --------------------------------------------------------------------------
    @property
    def weights_file_offset(self) -> int:
        """Byte offset of weights.bin's data in the file (a multiple of 4096 in files atlasc writes)."""
        return self._layout[WEIGHTS][0]

    @property
    def weights_nbytes(self) -> int:
        return self._layout[WEIGHTS][1]

    def weights_array(self) -> np.ndarray:
        """The weights image as a read-only uint8 array, memory-mapped from the file (no copy)."""
        offset, size = self._layout[WEIGHTS]
        if size == 0:
            empty = np.zeros(0, np.uint8)
            empty.flags.writeable = False
            return empty
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=offset, shape=(size,))

    # --- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        if self._fp is not None:
            self._fp.close()
            self._fp = None

    def __enter__(self) -> Artifact:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        m = self.manifest
        return f"Artifact({str(self.path)!r}, archs={list(m.archs)}, entries={list(m.entries)})"


def open_artifact(path: str | os.PathLike, verify: bool = True) -> Artifact:
    """Open and validate an `.atlas` file; with verify=True every member's sha256 is checked too."""
    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"{path}: no such file")
    if path.is_dir():
        raise ArtifactError(f"{path}: is a directory, not an .atlas file")
    try:
        fp = open(path, "rb")
    except OSError as e:
        raise ArtifactError(f"{path}: cannot open: {e.strerror}") from None
    try:
        manifest, layout = _validate(path, fp, verify)
    except BaseException:
        fp.close()
        raise
    return Artifact(path, fp, manifest, layout)


def _validate(path: Path, fp, verify: bool) -> tuple[Manifest, dict[str, tuple[int, int]]]:
    def fail(msg: str, hint: str | None = None):
        return ArtifactError(f"{path}: {msg}", hint)

    truncated = "truncated or corrupt .atlas file"
    total = os.fstat(fp.fileno()).st_size
    head = fp.read(4)
    looks_zip = head == LOCAL_MAGIC or (0 < len(head) < 4 and LOCAL_MAGIC.startswith(head))
    if not looks_zip:
        raise fail("not an .atlas file (not a zip archive)")
    try:
        fp.seek(0)
        zf = zipfile.ZipFile(fp)
        infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError, struct.error) as e:
        raise fail(f"{truncated} ({e})") from None

    layout: dict[str, tuple[int, int]] = {}
    crcs: dict[str, int] = {}
    for info in infos:
        name = info.orig_filename
        why = check_member_name(name)
        if why:
            raise fail(f"{why}: {name!r}")
        if name in layout:
            raise fail(f"duplicate member {name!r}")
        if info.flag_bits & 0x1:
            raise fail(f"member {name} is encrypted")
        if info.compress_type != zipfile.ZIP_STORED:
            raise fail(f"member {name} is compressed; .atlas members are stored uncompressed")
        if info.compress_size != info.file_size:
            raise fail(f"{truncated} (member {name}: stored size {info.compress_size} != size {info.file_size})")
        fp.seek(info.header_offset)
        raw = fp.read(LOCAL_HEADER.size)
        if len(raw) < LOCAL_HEADER.size or raw[:4] != LOCAL_MAGIC:
            raise fail(f"{truncated} (bad local header of member {name})")
        name_len, extra_len = LOCAL_HEADER.unpack(raw)[-2:]
        offset = info.header_offset + LOCAL_HEADER.size + name_len + extra_len
        if offset + info.file_size > total:
            raise fail(f"{truncated} (member {name} ends past the end of the file)")
        layout[name] = (offset, info.file_size)
        crcs[name] = info.CRC

    if MANIFEST not in layout:
        raise fail("no manifest.json (not an .atlas file)")
    offset, size = layout[MANIFEST]
    fp.seek(offset)
    text = fp.read(size)
    # the manifest lists every other member's sha256; its own integrity is the zip's CRC-32
    if zlib.crc32(text) != crcs[MANIFEST]:
        raise fail("checksum mismatch in member manifest.json: the file is corrupt or was modified")
    try:
        data = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise fail(f"manifest.json is not valid JSON ({e})") from None
    try:
        manifest = Manifest.from_json(data)
    except ArtifactError as e:
        raise fail(e.message, e.hint) from None

    for name, spec in manifest.members.items():
        if name not in layout:
            raise fail(f"member {name} listed in the manifest is missing from the archive")
        if layout[name][1] != spec.size:
            raise fail(f"{truncated} (member {name} is {layout[name][1]} bytes, the manifest says {spec.size})")
    for name in layout:
        if name != MANIFEST and name not in manifest.members:
            raise fail(f"member {name} is not listed in the manifest: the file was modified")
    if WEIGHTS not in layout:
        raise fail(f"no member {WEIGHTS} (not an .atlas file)")

    if verify:
        for name, spec in manifest.members.items():
            offset, size = layout[name]
            if _sha256_at(fp, offset, size) != spec.sha256:
                raise fail(f"checksum mismatch in member {name}: the file is corrupt or was modified")
    return manifest, layout


def _sha256_at(fp, offset: int, size: int) -> str:
    h = hashlib.sha256()
    fp.seek(offset)
    left = size
    while left:
        chunk = fp.read(min(CHUNK, left))
        if not chunk:
            break  # cannot happen after the size checks, unless the file shrank meanwhile
        h.update(chunk)
        left -= len(chunk)
    return h.hexdigest()
