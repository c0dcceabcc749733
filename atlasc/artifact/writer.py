"""Writing an `.atlas` file: a zip of STORED members, deterministic and atomic.

Layout, in this order (the order is fixed so the same inputs give a byte-identical file):

    manifest.json          sort_keys, indent=1, with the sha256 and size of every other member
    kernels.cu             the generated CUDA source
    cubin/<arch>.cubin     per target arch, sorted by name: the module, or the first of a chunked build's
    cubin/<arch>.<i>.cubin   modules (i = 1, 2, ...: cubin_member; the runtime loads them all)
    <other members>        e.g. report.json, sorted by name
    weights.bin            the weights image; its data starts at a multiple of WEIGHTS_ALIGNMENT

Every member has date_time 1980-01-01 00:00:00 and permissions 0644. The weights' alignment is done
as Android's zipalign does: the local file header of weights.bin gets an extra block (header id
0xD935: a uint16 alignment, then zero padding) just long enough for its data to start aligned, so the
runtime can `mmap` the image and upload it in one copy. The central directory carries no padding.

The file is written to a temporary file in the target's folder, fsynced, then `os.replace`d onto the
target; on any failure the temporary file is removed and the target is left as it was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
import struct
import zipfile
from pathlib import Path

import numpy as np

from atlasc.errors import ArtifactError

from .manifest import CUBIN_RE, Manifest, MemberSpec

WEIGHTS_ALIGNMENT = 4096
ZIPALIGN_EXTRA_ID = 0xD935
DATE_TIME = (1980, 1, 1, 0, 0, 0)
PERMISSIONS = 0o100644 << 16  # regular file, rw-r--r--
CHUNK = 16 << 20  # bytes hashed / written per step, so an 8 GB image is never copied whole

MANIFEST = "manifest.json"
SOURCE = "kernels.cu"
WEIGHTS = "weights.bin"


def cubin_member(arch: str, part: int = 0) -> str:
    """The member name of part `part` of arch's cubins: cubin/<arch>.cubin, then cubin/<arch>.<part>.cubin."""
    return f"cubin/{arch}.cubin" if part == 0 else f"cubin/{arch}.{part}.cubin"


def manifest_bytes(manifest: Manifest) -> bytes:
    """The exact bytes of manifest.json."""
    return (json.dumps(manifest.to_json(), sort_keys=True, indent=1) + "\n").encode("utf-8")


def check_member_name(name: str) -> str | None:
    """Why `name` cannot be an archive member (absolute, `..`, empty parts, backslashes), or None."""
    if not name or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        return "member path escapes the archive"
    parts = name.replace("\\", "/").split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "member path escapes the archive"
    return None


def _as_bytes_view(data: bytes | bytearray | memoryview | np.ndarray) -> memoryview:
    """A flat uint8 memoryview of `data`, without copying unless an array is not C-contiguous."""
    if isinstance(data, np.ndarray):
        arr = np.ascontiguousarray(data)
        return memoryview(arr.reshape(-1).view(np.uint8))
    view = memoryview(data)
    if not view.c_contiguous:
        raise ArtifactError("weights: the buffer is not contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class WeightsImage:
    """A weights image given as arrays placed at byte offsets (zeros elsewhere), produced chunk by chunk:
    write_artifact hashes it in one pass and writes it in a second, so the image is never assembled
    in memory, and an array that is a view (a transposed weight, a memory-mapped initializer) is laid
    out a block of rows at a time."""

    def __init__(self, size: int, pieces: list[tuple[int, np.ndarray]]):
        self.size = int(size)
        self.pieces = sorted(((int(o), a) for o, a in pieces), key=lambda p: p[0])
        end = 0
        for offset, arr in self.pieces:
            if offset < end or offset + arr.nbytes > self.size:
                raise ArtifactError(f"weights image: a piece at byte {offset} ({arr.nbytes} bytes) overlaps "
                                    f"another or ends past the image ({self.size} bytes)")
            end = offset + arr.nbytes

    def __len__(self) -> int:
        return self.size

    def chunks(self):
        pos = 0
        for offset, arr in self.pieces:
            yield from _zeros(offset - pos)
            rows = arr.reshape(arr.shape[0], -1) if arr.ndim > 1 else arr.reshape(1, -1)
            step = max(1, CHUNK // max(1, rows.shape[1] * arr.itemsize))
            for r0 in range(0, rows.shape[0], step):
                yield memoryview(np.ascontiguousarray(rows[r0:r0 + step]).reshape(-1).view(np.uint8))
            pos = offset + arr.nbytes
        yield from _zeros(self.size - pos)


def _zeros(n: int):
    block = bytes(min(n, CHUNK))
    while n > 0:
        yield memoryview(block)[:min(n, CHUNK)]
        n -= CHUNK


def _chunks(data):
    if isinstance(data, WeightsImage):
        yield from data.chunks()
        return
    for start in range(0, len(data), CHUNK):
        yield data[start:start + CHUNK]


def _sha256(data) -> str:
    h = hashlib.sha256()
    for chunk in _chunks(data):
        h.update(chunk)
    return h.hexdigest()


def _zipinfo(name: str, size: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=DATE_TIME)
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = PERMISSIONS
    info.create_system = 3  # unix, whatever the host
    info.file_size = size
    return info


def _member_order(members: dict[str, bytes], archs: tuple[str, ...]) -> list[str]:
    for name in members:
        why = check_member_name(name)
        if why:
            raise ArtifactError(f"cannot write member {name!r}: {why}")
        if name in (MANIFEST, WEIGHTS):
            raise ArtifactError(f"cannot write member {name!r}: the writer makes it (pass weights= for weights.bin)")
        if name.startswith("cubin/"):
            m = CUBIN_RE.fullmatch(name)
            if not m:
                raise ArtifactError(f"cannot write member {name!r}: cubins are named cubin/sm<NN>.cubin "
                                    "(and cubin/sm<NN>.<i>.cubin for the parts of a chunked build)")
            if m.group(1) not in archs:
                raise ArtifactError(f"member {name} is for an arch the manifest does not list (archs: "
                                    f"{', '.join(archs) or 'none'})")
    missing = [a for a in archs if cubin_member(a) not in members]
    if missing:
        raise ArtifactError(f"the manifest lists arch {missing[0]} but no member cubin/{missing[0]}.cubin was given")
    for name in members:
        m = CUBIN_RE.fullmatch(name)
        if m and m.group(2) and cubin_member(m.group(1), int(m.group(2)) - 1) not in members:
            raise ArtifactError(f"cannot write member {name!r}: part {int(m.group(2)) - 1} of {m.group(1)} is missing "
                                "(parts are numbered without gaps)")
    cubins = sorted(n for n in members if n.startswith("cubin/"))
    others = sorted(n for n in members if n != SOURCE and not n.startswith("cubin/"))
    return ([SOURCE] if SOURCE in members else []) + cubins + others


def _write_member(zf: zipfile.ZipFile, fp, name: str, view, align: int | None = None) -> None:
    """One STORED member; with `align`, padded (zipalign-style) so its data starts at a multiple of it."""
    info = _zipinfo(name, len(view))
    zip64 = len(view) * 1.05 > zipfile.ZIP64_LIMIT  # the rule zipfile itself applies
    if align:
        start = fp.tell()  # where zipfile will put the local header (it keeps fp at the archive's end)
        header = 30 + len(name.encode("utf-8")) + (20 if zip64 else 0)
        pad = -(start + header + 6) % align  # 6: the extra block's id, size and alignment fields
        info.extra = struct.pack("<HHH", ZIPALIGN_EXTRA_ID, 2 + pad, align) + bytes(pad)
    with zf.open(info, "w", force_zip64=zip64) as dest:
        if align and fp.tell() % align:
            raise AssertionError(f"zipalign: data of {name} at {fp.tell()}, not a multiple of {align}")
        for chunk in _chunks(view):
            dest.write(chunk)
    info.extra = b""  # the local header keeps its padding; the central directory needs none


def write_artifact(path: str | os.PathLike, manifest: Manifest, members: dict[str, bytes],
                   weights: bytes | np.ndarray | memoryview | WeightsImage) -> Manifest:
    """Write the `.atlas` file at `path` atomically; returns the manifest as written (with `members` filled).

    `members` maps archive names to bytes: `kernels.cu`, `cubin/<arch>.cubin` (one per `manifest.archs`,
    then `cubin/<arch>.1.cubin`, ... for the parts of a chunked build, numbered without gaps), and any
    others (`report.json` ...). `weights` is the weights image in arena order: a C-contiguous buffer, or a
    WeightsImage of placed arrays; hashed and written in chunks, never copied whole.
    """
    path = Path(path)
    views = {name: _as_bytes_view(data) for name, data in members.items()}
    order = _member_order(members, manifest.archs)
    wview = weights if isinstance(weights, WeightsImage) else _as_bytes_view(weights)
    specs = {name: MemberSpec(sha256=_sha256(views[name]), size=len(views[name])) for name in order}
    specs[WEIGHTS] = MemberSpec(sha256=_sha256(wview), size=len(wview))
    manifest = dataclasses.replace(manifest, members=specs)
    manifest.check()
    mbytes = manifest_bytes(manifest)

    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
    except OSError as e:
        raise ArtifactError(f"cannot write {path}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as fp:
            with zipfile.ZipFile(fp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
                _write_member(zf, fp, MANIFEST, memoryview(mbytes))
                for name in order:
                    _write_member(zf, fp, name, views[name])
                _write_member(zf, fp, WEIGHTS, wview, align=WEIGHTS_ALIGNMENT)
            fp.flush()
            os.fsync(fp.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):
            raise ArtifactError(f"cannot write {path}: {e.strerror or e}") from None
        raise
    _fsync_dir(path.parent)
    return manifest


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable (best effort: not every platform can open a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
