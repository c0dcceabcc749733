"""examples/gpu_cache.py: the GPU tests compile without a GPU under ATLAS_GPU_PRECOMPILE (tests/conftest.py),
and the cubins pack and unpack into an nvcc cache (CPU)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "examples"))
import gpu_cache  # noqa: E402


def test_pack_then_unpack_keeps_every_cubin_and_nothing_else(tmp_path):
    src = tmp_path / "a" / "cubin"
    src.mkdir(parents=True)
    for i in range(3):
        (src / f"{i:064x}.cubin").write_bytes(os.urandom(1000 + i))
    (src / f"{0:064x}.lock").write_bytes(b"")
    count, raw = gpu_cache.pack(tmp_path / "a", tmp_path / "p.tar.xz")
    assert (count, raw) == (3, 3003)
    dest = tmp_path / "b"
    (dest / "cubin").mkdir(parents=True)
    kept = dest / "cubin" / f"{1:064x}.cubin"
    kept.write_bytes(b"already here")  # an existing cubin stays as it is
    assert gpu_cache.unpack(tmp_path / "p.tar.xz", dest) == 2
    assert sorted(p.name for p in (dest / "cubin").iterdir()) == sorted(p.name for p in src.glob("*.cubin"))
    assert (dest / "cubin" / f"{2:064x}.cubin").read_bytes() == (src / f"{2:064x}.cubin").read_bytes()
    assert kept.read_bytes() == b"already here"


def test_unpack_ignores_members_outside_the_cache(tmp_path):
    bad = tmp_path / "bad.tar.xz"
    with tarfile.open(bad, "w:xz") as tar:
        for name in ("../evil.cubin", "cubin/../../evil.cubin", "/tmp/evil.cubin", "other/x.cubin", "cubin/x.txt"):
            info = tarfile.TarInfo(name)
            info.size = 4
            tar.addfile(info, io.BytesIO(b"evil"))
    assert gpu_cache.unpack(bad, tmp_path / "cache") == 0
    assert not list((tmp_path / "cache" / "cubin").iterdir()) and not (tmp_path / "evil.cubin").exists()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_precompile_compiles_a_gpu_test_and_skips_it(tmp_path):
    """One GPU test under ATLAS_GPU_PRECOMPILE=sm90, no GPU: skipped with the reason, its cubin in the cache."""
    env = {**os.environ, "ATLAS_GPU_PRECOMPILE": "sm90", "ATLAS_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        "tests/test_kernels_reduce_movement_gpu.py::test_group_matches_reference[sources]"],
                       cwd=REPO, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "1 skipped" in r.stdout and "ATLAS_GPU_PRECOMPILE" in r.stdout, r.stdout[-2000:]
    assert list((tmp_path / "cubin").glob("*.cubin"))


def test_cache_option_packs_another_caches_cubins(tmp_path, capsys):
    """--cache DIR adds the cubins of an nvcc cache (e.g. of `atlasc compile`s a device script will repeat) to the
    pack, with --add keeping the old pack's; a folder that is no nvcc cache is refused before anything is written."""
    old = tmp_path / "old" / "cubin"
    old.mkdir(parents=True)
    (old / f"{1:064x}.cubin").write_bytes(b"old")
    out = tmp_path / "p.tar.xz"
    gpu_cache.pack(tmp_path / "old", out)
    other = tmp_path / "other" / "cubin"
    other.mkdir(parents=True)
    (other / f"{1:064x}.cubin").write_bytes(b"newer")  # the same key: the pack's copy stays
    (other / f"{2:064x}.cubin").write_bytes(os.urandom(64))
    (other / f"{3:064x}.lock").write_bytes(b"")
    assert gpu_cache.main(["--add", "--no-tests", "--cache", str(tmp_path / "other"), "--out", str(out)]) == 0
    with tarfile.open(out) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert sorted(members) == [f"cubin/{1:064x}.cubin", f"cubin/{2:064x}.cubin"]
    assert members[f"cubin/{1:064x}.cubin"] == b"old"
    assert members[f"cubin/{2:064x}.cubin"] == (other / f"{2:064x}.cubin").read_bytes()
    before = out.read_bytes()
    with pytest.raises(SystemExit) as e:
        gpu_cache.main(["--no-tests", "--cache", str(tmp_path / "nothing"), "--out", str(out)])
    assert e.value.code == 2 and "no cubin/ folder" in capsys.readouterr().err
    assert out.read_bytes() == before


def test_send_bytes_counts_the_tracked_files_and_wheels_beside_the_pack(tmp_path, monkeypatch):
    # v47: a 56.6 MB pack passed the old check (the pack alone) while the run refused the whole send (69.8 MB)
    repo = tmp_path / "repo"
    (repo / ".whl").mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / "tracked.py").write_bytes(b"x" * 1000)
    (repo / "untracked.bin").write_bytes(b"y" * 5000)
    (repo / ".whl" / "a.whl").write_bytes(b"z" * 10)
    subprocess.run(["git", "add", "tracked.py"], cwd=repo, check=True)
    monkeypatch.setattr(gpu_cache, "REPO", repo)
    assert gpu_cache.send_bytes(7) == 1000 + 10 + 7


def test_pack_uses_xz_with_the_largest_dictionary(tmp_path):
    # a cubin repeated at a distance over the default preset's 8 MiB dictionary packs once only at preset 9
    src = tmp_path / "a" / "cubin"
    src.mkdir(parents=True)
    blob = os.urandom(9 << 20)
    (src / f"{0:064x}.cubin").write_bytes(blob)
    (src / f"{1:064x}.cubin").write_bytes(blob)
    gpu_cache.pack(tmp_path / "a", tmp_path / "p.tar.xz")
    assert (tmp_path / "p.tar.xz").stat().st_size < 1.2 * len(blob)
