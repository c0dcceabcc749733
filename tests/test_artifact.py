"""The `.atlas` file format: manifest round trip, write/read, determinism, alignment, and one test per
way a file can be bad (each a one-line ArtifactError naming the file)."""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile

import numpy as np
import pytest

from atlasc.artifact import (
    FORMAT_VERSION,
    WEIGHTS_ALIGNMENT,
    EntrySpec,
    IOSpec,
    KVCacheSpec,
    Manifest,
    MemorySpec,
    NodeSpec,
    RegionSpec,
    SourceInfo,
    SymbolSpec,
    ValueSpec,
    WeightSpec,
    WeightsImage,
    open_artifact,
    write_artifact,
)
from atlasc.artifact import writer as writer_mod
from atlasc.errors import ArtifactError

SEQ = {"poly": [[1, ["seq"]]]}  # symbolic.to_json(sym("seq"))
BATCH = {"poly": [[1, ["batch"]]]}
PAST_PLUS_SEQ = {"poly": [[1, ["past_seq"]], [1, ["seq"]]]}


def _entry(name: str, seq, bindings: dict[str, int]) -> EntrySpec:
    ids = IOSpec("input_ids", "int64", (BATCH, seq), offset=4096, nbytes=8 * 4 * 64)
    logits = IOSpec("logits", "float32", (BATCH, seq, 32), offset=8192, nbytes=4 * 4 * 64 * 32)
    h = ValueSpec("h", "float32", (BATCH, seq, 16), offset=65536, nbytes=4 * 4 * 64 * 16)
    kv = ValueSpec("k_view", "float16", (BATCH, 2, PAST_PLUS_SEQ, 8), offset=1024, nbytes=8192,
                   strides=(2 * 128 * 8, 128 * 8, 8, 1))
    nodes = (
        NodeSpec("embed", "Gather", ("wte", "input_ids"), ("h",), {"axis": 0}, "gather_f32",
                 grid=(BATCH, seq, 1), block=(128, 1, 1), smem=0),
        NodeSpec("lm_head", "MatMul", ("h", "lm_head.weight", None), ("logits",),
                 {"transB": 1, "scale": 0.125, "perm": [0, 2, 1]}, "matmul_f32",
                 grid=({"poly": [[1, ["batch", "seq"]]]}, 1, 1), block=(16, 16, 1), smem=2048),
    )
    return EntrySpec(name, (ids,), (logits,), bindings, (h, kv), nodes)


def make_manifest() -> Manifest:
    return Manifest(
        source=SourceInfo("tiny.onnx", "ab" * 32),
        options={"arch": ["sm80", "sm90"], "dtype": "fp32", "max_batch": 4, "max_seq": 64},
        archs=("sm80", "sm90"),
        symbols=(SymbolSpec("batch", 1, 4), SymbolSpec("seq", 1, 64), SymbolSpec("past_seq", 0, 63)),
        memory=MemorySpec(alignment=256, arena_bytes=1 << 20,
                          regions={"weights": RegionSpec(0, 1024), "kv_cache": RegionSpec(1024, 8192),
                                   "io": RegionSpec(9216, 65536), "activations": RegionSpec(74752, 4096)},
                          dims_offset=9216, activation_peak=4096, activation_naive=8192),
        kv_cache=KVCacheSpec(layers=2, kv_heads=2, head_dim=8, max_batch=4, max_seq=64, dtype="float16",
                             offset=1024),
        weights=(WeightSpec("wte", "float32", (32, 16), 0, 2048),
                 WeightSpec("lm_head.weight", "float32", (16, 32), 2048, 2048)),
        entries={"prefill": _entry("prefill", SEQ, {}), "decode": _entry("decode", 1, {"seq": 1})},
        report={"arena_bytes": 1 << 20, "passes": [["canonicalize", 3]], "max_abs_err": None},
    )


MEMBERS = {
    "kernels.cu": b'extern "C" __global__ void gather_f32() {}\n',
    "cubin/sm90.cubin": b"\x7fELF sm90 cubin bytes" * 3,
    "cubin/sm80.cubin": b"\x7fELF sm80 cubin bytes" * 5,
    "report.json": b'{"ok": true}\n',
}
WEIGHTS = np.arange(4096 // 4, dtype=np.float32).reshape(32, 32)


@pytest.fixture
def artifact(tmp_path):
    path = tmp_path / "tiny.atlas"
    write_artifact(path, make_manifest(), MEMBERS, WEIGHTS)
    return path


def expect_error(path, match: str, **kw) -> ArtifactError:
    with pytest.raises(ArtifactError, match=match) as info:
        with open_artifact(path, **kw):
            pass
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg, msg
    assert info.value.exit_code == 2
    return info.value


def rewrite_zip(src, dst, edit):
    """Copy the zip `src` to `dst`, passing each (name, data) through `edit` (None drops the member)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            out = edit(info.filename, zin.read(info))
            if out is not None:
                zout.writestr(out[0], out[1])


# --- manifest -------------------------------------------------------------------------------

def test_manifest_json_round_trip():
    import atlasc
    m = make_manifest()
    assert m.atlasc_version == atlasc.__version__
    j = m.to_json()
    assert Manifest.from_json(json.loads(json.dumps(j))) == m
    assert j["magic"] == "ATLAS" and j["format_version"] == FORMAT_VERSION
    assert isinstance(j["archs"], list) and isinstance(j["entries"]["decode"]["nodes"][0]["grid"], list)


def test_shared_kernel_offsets_round_trip_and_older_manifests_have_none():
    """NodeSpec.args (format 5): the arena offsets a shared kernel's launch passes; a format-4 manifest, which
    has none, still loads (its kernels take the arena alone)."""
    j = make_manifest().to_json()
    for entry in j["entries"].values():
        entry["nodes"][0]["args"] = [0, 2048]
    m = Manifest.from_json(json.loads(json.dumps(j)))
    assert all(e.nodes[0].args == (0, 2048) and e.nodes[1].args == () for e in m.entries.values())
    j = make_manifest().to_json()
    j["format_version"] = 4
    for entry in j["entries"].values():
        for node in entry["nodes"]:
            node.pop("args")
    assert all(n.args == () for e in Manifest.from_json(j).entries.values() for n in e.nodes)


def test_manifest_normalizes_lists_and_numpy():
    w = WeightSpec("w", "float32", [2, 3], 0, 24)
    assert w.shape == (2, 3)
    n = NodeSpec("n", "Softmax", ["x"], ["y"], {"axis": np.int64(-1), "eps": np.float32(0.5), "p": (1, 2)},
                 "k", [1, 1, 1], (32, 1, 1), 0)
    assert n.attrs == {"axis": -1, "eps": 0.5, "p": [1, 2]} and n.grid == (1, 1, 1)
    with pytest.raises(ArtifactError, match="attrs.bad"):
        NodeSpec("n", "X", (), (), {"bad": object()}, "k", (1, 1, 1), (1, 1, 1), 0)


@pytest.mark.parametrize("edit, field", [
    (lambda j: j["memory"].__setitem__("arena_bytes", "big"), "memory.arena_bytes"),
    (lambda j: j["entries"]["decode"]["nodes"][1].__setitem__("grid", [1, 1]),
     r"entries\.decode\.nodes\[1\]\.grid: expected a list of 3"),
    (lambda j: j["weights"][0].__setitem__("shape", [2, True]), r"weights\[0\].shape\[1\]"),
    (lambda j: j["symbols"][0].pop("upper"), r"symbols\[0\].upper: missing"),
    (lambda j: j.__setitem__("colour", 1), "manifest field colour: unknown field"),
    (lambda j: j["kv_cache"].__setitem__("layers", 2.0), "kv_cache.layers"),
    (lambda j: j["entries"]["decode"].__setitem__("name", "prefill"), "entries.decode.name"),
    (lambda j: j["entries"]["decode"]["nodes"][0].__setitem__("args", [64, 1 << 21]),
     r"entries\.decode\.nodes\[0\] \(gather_f32\)\.args: expected arena offsets in 0\.\.1048576"),
    (lambda j: j["entries"]["decode"]["nodes"][0].__setitem__("args", [64, -8]), r"nodes\[0\] \(gather_f32\)\.args"),
    (lambda j: j["entries"]["decode"]["nodes"][0].__setitem__("args", [64]),
     r"nodes\[0\] \(gather_f32\)\.args: 1 offsets, but another launch of the kernel passes 0"),
    (lambda j: j.__setitem__("archs", ["sm80", "hopper"]), r"archs: 'hopper' is not an arch name such as 'sm90'"),
    (lambda j: j.__setitem__("archs", ["sm90", "sm90"]), r"archs: \['sm90', 'sm90'\] names an arch twice"),
    (lambda j: j.__setitem__("members", {"cubin/sm90.cubin": {"sha256": "ab" * 32, "size": 1}}),
     "archs: lists sm80, sm90 but the cubins are for sm90"),
])
def test_manifest_bad_field_is_named(edit, field):
    j = make_manifest().to_json()
    edit(j)
    with pytest.raises(ArtifactError, match=field) as info:
        Manifest.from_json(j)
    assert "\n" not in str(info.value)


# --- write / read ---------------------------------------------------------------------------

def test_write_then_read(artifact):
    with open_artifact(artifact) as a:
        written = a.manifest
        assert dataclasses.replace(written, members={}) == make_manifest()
        assert set(written.members) == {*MEMBERS, "weights.bin"}
        assert written.members["weights.bin"].size == WEIGHTS.nbytes
        for name, data in MEMBERS.items():
            assert a.read_member(name) == data
        assert a.cubin("sm90") == MEMBERS["cubin/sm90.cubin"] == a.cubin("sm_90")
        assert a.source() == MEMBERS["kernels.cu"].decode()
        assert a.member_names[0] == "manifest.json" and a.member_names[-1] == "weights.bin"


def test_weights_are_aligned_and_mappable(artifact):
    with open_artifact(artifact) as a:
        assert a.weights_file_offset % WEIGHTS_ALIGNMENT == 0
        w = a.weights_array()
        assert w.dtype == np.uint8 and not w.flags.writeable
        assert w.tobytes() == WEIGHTS.tobytes()
        np.testing.assert_array_equal(w.view(np.float32).reshape(32, 32), WEIGHTS)
    with open(artifact, "rb") as f:  # the aligned offset really holds the data
        f.seek(a.weights_file_offset)
        assert f.read(WEIGHTS.nbytes) == WEIGHTS.tobytes()
    with zipfile.ZipFile(artifact) as z:  # an ordinary zip to every other tool
        assert z.testzip() is None
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
        assert z.read("weights.bin") == WEIGHTS.tobytes()


@pytest.mark.parametrize("weights", [b"", b"x", bytes(range(256)) * 20,
                                     memoryview(np.ones((3, 5), np.float16)), np.ones((7, 3), np.int8)[:, 1]])
def test_weights_of_any_size_and_buffer_type(tmp_path, weights):
    m = dataclasses.replace(make_manifest(), weights=())
    raw = np.asarray(weights).tobytes() if isinstance(weights, np.ndarray) else bytes(weights)
    write_artifact(tmp_path / "w.atlas", m, MEMBERS, weights)
    with open_artifact(tmp_path / "w.atlas") as a:
        assert a.weights_file_offset % WEIGHTS_ALIGNMENT == 0
        assert a.weights_array().tobytes() == raw


def test_weights_written_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_mod, "CHUNK", 1000)  # several chunks for the hash and the write
    write_artifact(tmp_path / "a.atlas", make_manifest(), MEMBERS, WEIGHTS)
    with open_artifact(tmp_path / "a.atlas") as a:
        assert a.weights_array().tobytes() == WEIGHTS.tobytes()


@pytest.mark.parametrize("chunk", [1000, 16 << 20])
def test_weights_image_of_placed_arrays_equals_the_assembled_image(tmp_path, monkeypatch, chunk):
    """A WeightsImage (arrays at offsets, zeros between, a transposed view among them) writes the same
    file as the image assembled in memory, chunk size notwithstanding; overlapping pieces are refused."""
    monkeypatch.setattr(writer_mod, "CHUNK", chunk)
    m = dataclasses.replace(make_manifest(), weights=())
    base = np.arange(24 * 40, dtype=np.float16).reshape(24, 40)
    pieces = [(0, np.arange(5, dtype=np.int8)), (256, base.T), (256 + base.nbytes + 768, np.ones(300, np.float32))]
    size = pieces[-1][0] + 1200 + 100
    flat = np.zeros(size, np.uint8)
    for offset, arr in pieces:
        raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        flat[offset:offset + raw.size] = raw
    write_artifact(tmp_path / "pieces.atlas", m, MEMBERS, WeightsImage(size, pieces))
    write_artifact(tmp_path / "flat.atlas", m, MEMBERS, flat)
    assert (tmp_path / "pieces.atlas").read_bytes() == (tmp_path / "flat.atlas").read_bytes()
    with pytest.raises(ArtifactError, match="overlaps"):
        WeightsImage(size, [(0, np.ones(10, np.int8)), (8, np.ones(4, np.int8))])
    with pytest.raises(ArtifactError, match="ends past"):
        WeightsImage(16, [(8, np.ones(10, np.int8))])


def test_byte_identical_rewrite(tmp_path):
    a, b = tmp_path / "a.atlas", tmp_path / "sub" / "b.atlas"
    b.parent.mkdir()
    write_artifact(a, make_manifest(), MEMBERS, WEIGHTS)
    write_artifact(b, make_manifest(), dict(reversed(MEMBERS.items())), WEIGHTS.copy())
    assert a.read_bytes() == b.read_bytes()


def test_rewrite_replaces_and_leaves_no_temp(artifact):
    write_artifact(artifact, make_manifest(), MEMBERS, WEIGHTS[::-1].copy())
    assert os.listdir(artifact.parent) == [artifact.name]
    with open_artifact(artifact) as a:
        assert a.weights_array().tobytes() == WEIGHTS[::-1].tobytes()


# --- bad input ------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    expect_error(tmp_path / "nope.atlas", "no such file")


def test_not_a_zip(tmp_path):
    p = tmp_path / "model.atlas"
    p.write_bytes(b"\x08\x01\x12\x04onnx protobuf, not a zip")
    expect_error(p, r"not an \.atlas file \(not a zip archive\)")
    p.write_bytes(b"")
    expect_error(p, "not a zip archive")


def test_truncated(artifact, tmp_path):
    data = artifact.read_bytes()
    for cut in (3, 30, 100, 2000, 4200, len(data) // 2, len(data) - 200, len(data) - 22, len(data) - 1):
        p = tmp_path / f"cut{cut}.atlas"
        p.write_bytes(data[:cut])
        expect_error(p, "truncated or corrupt")


def test_tampered_weights_checksum_mismatch(artifact):
    with open_artifact(artifact) as a:
        offset = a.weights_file_offset
    data = bytearray(artifact.read_bytes())
    data[offset + 100] ^= 0x01
    artifact.write_bytes(bytes(data))
    expect_error(artifact, r"checksum mismatch in member weights\.bin: the file is corrupt or was modified")
    with open_artifact(artifact, verify=False) as a:  # verify=False skips the hashes
        assert a.weights_array()[100] != WEIGHTS.view(np.uint8).reshape(-1)[100]


def test_tampered_cubin_checksum_mismatch(artifact):
    data = artifact.read_bytes()
    artifact.write_bytes(data.replace(b"sm90 cubin", b"sm90 CUBIN", 1))
    expect_error(artifact, r"checksum mismatch in member cubin/sm90\.cubin")


def test_tampered_magic(artifact, tmp_path):
    p = tmp_path / "magic.atlas"
    rewrite_zip(artifact, p, lambda n, d: (n, d.replace(b'"ATLAS"', b'"ATLAZ"') if n == "manifest.json" else d))
    expect_error(p, "magic 'ATLAZ'")


def test_manifest_edited_in_place(artifact):
    """The manifest's bytes changed inside the zip (its CRC-32 not updated): refused before its fields are read."""
    data = artifact.read_bytes()
    assert data.count(b'"ATLAS"') == 1
    artifact.write_bytes(data.replace(b'"ATLAS"', b'"ATLAZ"'))
    expect_error(artifact, "checksum mismatch in member manifest.json")


def test_manifest_naming_another_arch(artifact, tmp_path):
    """A manifest (with a valid CRC) whose archs were edited from sm80 to sm86: the sm80 cubin would be loaded as
    another arch's code; refused on open."""
    def edit(name, data):
        if name == "manifest.json":
            j = json.loads(data)
            j["archs"] = ["sm86", "sm90"]
            data = json.dumps(j).encode()
        return name, data
    p = tmp_path / "arch.atlas"
    rewrite_zip(artifact, p, edit)
    expect_error(p, "archs: lists sm86, sm90 but the cubins are for sm80, sm90")


def test_newer_format_version(artifact, tmp_path):
    def edit(name, data):
        if name == "manifest.json":
            j = json.loads(data)
            j["format_version"] = FORMAT_VERSION + 1
            j["some_new_field"] = {}  # a newer format's fields are not even looked at
            data = json.dumps(j).encode()
        return name, data
    p = tmp_path / "newer.atlas"
    rewrite_zip(artifact, p, edit)
    err = expect_error(p, rf"artifact format version {FORMAT_VERSION + 1} is newer than this atlasc "
                          rf"supports \({FORMAT_VERSION}\); upgrade atlasc")
    assert str(err).startswith(str(p))


def test_member_path_escaping_archive(artifact, tmp_path):
    for evil in ("../evil", "/etc/evil", "cubin/../../evil", "C:/evil"):
        p = tmp_path / "evil.atlas"
        rewrite_zip(artifact, p, lambda n, d: (n, d))
        with zipfile.ZipFile(p, "a") as z:
            z.writestr(evil, b"owned")
        expect_error(p, "member path escapes the archive")


def test_missing_member(artifact, tmp_path):
    p = tmp_path / "missing.atlas"
    rewrite_zip(artifact, p, lambda n, d: None if n == "cubin/sm80.cubin" else (n, d))
    expect_error(p, r"member cubin/sm80\.cubin listed in the manifest is missing")


def test_unlisted_member(artifact, tmp_path):
    p = tmp_path / "extra.atlas"
    rewrite_zip(artifact, p, lambda n, d: (n, d))
    with zipfile.ZipFile(p, "a") as z:
        z.writestr("cubin/sm86.cubin", b"sneaky")
    expect_error(p, "not listed in the manifest")


def test_missing_manifest(artifact, tmp_path):
    p = tmp_path / "nomanifest.atlas"
    rewrite_zip(artifact, p, lambda n, d: None if n == "manifest.json" else (n, d))
    expect_error(p, "no manifest.json")
    rewrite_zip(artifact, p, lambda n, d: (n, b"{not json" if n == "manifest.json" else d))
    expect_error(p, "manifest.json is not valid JSON")


def test_compressed_member(artifact, tmp_path):
    p = tmp_path / "deflated.atlas"
    with zipfile.ZipFile(artifact) as zin, zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info))
    expect_error(p, "is compressed")


def test_missing_cubin_for_arch(artifact):
    with open_artifact(artifact) as a:
        with pytest.raises(ArtifactError) as info:
            a.cubin("sm_86")
    assert str(info.value).endswith(
        "no cubin for sm_86 in this artifact (it has: sm80, sm90); recompile with --arch sm86")


def test_cubin_parts_round_trip(tmp_path):
    """A chunked build's cubins: cubin/<arch>.cubin, then .1, .2, ... parts; cubins() gives all in order,
    cubin() the first, and other archs keep their one part."""
    parts = [b"\x7fELF part %d" % i for i in range(3)]
    members = {**MEMBERS, "cubin/sm90.cubin": parts[0], "cubin/sm90.1.cubin": parts[1], "cubin/sm90.2.cubin": parts[2]}
    path = tmp_path / "parts.atlas"
    write_artifact(path, make_manifest(), members, WEIGHTS)
    with open_artifact(path) as a:
        assert a.cubins("sm90") == parts
        assert a.cubin("sm_90") == parts[0]
        assert a.cubins("sm80") == [MEMBERS["cubin/sm80.cubin"]]


def test_writer_refuses_inconsistent_members(tmp_path):
    m = make_manifest()
    for members, match in [({**MEMBERS, "../x": b""}, "escapes the archive"),
                           ({k: v for k, v in MEMBERS.items() if k != "cubin/sm80.cubin"}, "arch sm80"),
                           ({**MEMBERS, "cubin/sm86.cubin": b""}, "does not list"),
                           ({**MEMBERS, "cubin/sm90.2.cubin": b""}, "part 1 of sm90 is missing"),
                           ({**MEMBERS, "cubin/sm90.0.cubin": b""}, "cubins are named"),
                           ({**MEMBERS, "weights.bin": b""}, "the writer makes it")]:
        with pytest.raises(ArtifactError, match=match):
            write_artifact(tmp_path / "x.atlas", m, members, WEIGHTS)
    assert os.listdir(tmp_path) == []


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    target = tmp_path / "model.atlas"
    real = writer_mod._write_member

    def failing(zf, fp, name, view, align=None):
        if name == "weights.bin":
            real(zf, fp, name, view[:10])  # part of the file is on disk by now
            raise OSError(28, "No space left on device")
        return real(zf, fp, name, view, align)

    monkeypatch.setattr(writer_mod, "_write_member", failing)
    with pytest.raises(ArtifactError, match="No space left on device"):
        write_artifact(target, make_manifest(), MEMBERS, WEIGHTS)
    assert os.listdir(tmp_path) == []

    def interrupted(zf, fp, name, view, align=None):
        raise KeyboardInterrupt
    monkeypatch.setattr(writer_mod, "_write_member", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_artifact(target, make_manifest(), MEMBERS, WEIGHTS)
    assert os.listdir(tmp_path) == []


def test_failed_write_keeps_the_old_file(artifact, monkeypatch):
    before = artifact.read_bytes()
    monkeypatch.setattr(writer_mod.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(5, "I/O error")))
    with pytest.raises(ArtifactError, match="I/O error"):
        write_artifact(artifact, make_manifest(), MEMBERS, WEIGHTS[::-1].copy())
    assert artifact.read_bytes() == before
    assert os.listdir(artifact.parent) == [artifact.name]


def test_zip64_weights_stay_aligned(tmp_path, monkeypatch):
    # an image over 4 GiB needs zip64 headers (20 more bytes in the local header); shrink the limit
    # so this small image takes that path too
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 1000)
    write_artifact(tmp_path / "big.atlas", make_manifest(), MEMBERS, WEIGHTS)
    monkeypatch.undo()
    with open_artifact(tmp_path / "big.atlas") as a:
        assert a.weights_file_offset % WEIGHTS_ALIGNMENT == 0
        assert a.weights_array().tobytes() == WEIGHTS.tobytes()
    with zipfile.ZipFile(tmp_path / "big.atlas") as z:
        assert z.testzip() is None
