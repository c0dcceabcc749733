"""Compile the GPU tests' kernels here (no GPU needed) and pack the cubins for the GPU machine's nvcc cache.

    python examples/gpu_cache.py                  # -> .gpu-cache.tar.xz (git-ignored), sm90
    python examples/gpu_cache.py --add --no-tests --bench llama-3-8b:1,32 --bench llama-3-8b:1,8:int4
                                                  # add the artifacts gpu_bench.sh compiles (build_llama.py
                                                  # shapes, bench_vs_torch.py's options): gigabytes of disk
    ATLAS_CACHE_DIR=/tmp/c atlasc compile ...     # then: the cubins of compiles a device script will repeat
    python examples/gpu_cache.py --add --no-tests --cache /tmp/c
    python examples/gpu_cache.py --unpack         # on the GPU machine: into ATLAS_CACHE_DIR (gpu_check.sh does it)

Why: the GPU machine starts with an empty nvcc cache every session, and the GPU tests spent ~400 s of its
30 minutes compiling (docs/perf.md v14, 16 processes). Here the GPU tests run with ATLAS_GPU_PRECOMPILE=<arch>
(tests/conftest.py): each one generates and compiles its kernels into a fresh cache and is skipped at its
first use of a GPU. The cache key covers the source, the arch, the nvcc version and the flags
(codegen/nvcc.py), so the GPU machine finds these cubins only where its nvcc is the same build as this
one's (13.0 V13.0.88 on both, v14) and the code has not changed since; anything else it compiles as before.
Pass `carry: [".whl", ".gpu-cache.tar.xz"]` to the device run; examples/gpu_check.sh unpacks it.
"""

from __future__ import annotations

import argparse
import lzma
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACK = REPO / ".gpu-cache.tar.xz"
CARRY_LIMIT = 64 << 20  # bytes a device run sends in all: the tracked files, .whl and this pack
# xz's largest dictionary (64 MiB) finds the kernels repeated across cubins: the 307-cubin pack of v46 took 56.6 MB
# at the default preset, 41.1 MB at this one (measured with the xz command, `xz -9e -T2`), so that it fits the
# limit beside the tree
XZ_PRESET = 9 | lzma.PRESET_EXTREME


def cache_root() -> Path:
    """ATLAS_CACHE_DIR as codegen/nvcc.py reads it."""
    return Path(os.environ.get("ATLAS_CACHE_DIR") or Path.home() / ".cache" / "atlasc")


def fill(arch: str, cache: Path) -> int:
    """Run the `gpu` tests with ATLAS_GPU_PRECOMPILE=arch and ATLAS_CACHE_DIR=cache; pytest's exit status."""
    env = {**os.environ, "ATLAS_GPU_PRECOMPILE": arch, "ATLAS_CACHE_DIR": str(cache)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]
    try:  # every core (nvcc is the work; the cache's locks keep two workers off one build)
        import xdist  # noqa: F401

        cmd += ["-n", "auto", "--dist", "worksteal"]
    except ImportError:
        pass
    return subprocess.run(cmd, cwd=REPO, env=env).returncode


def compile_bench(spec: str, arch: str, cache: Path, workdir: Path) -> None:
    """Compile the artifact examples/bench_vs_torch.py compiles for `spec` = CONFIG:BATCHES[:QUANT] (prompt
    and gen 128, as gpu_bench.sh runs it) into `cache`; the model (and its weights file) and the artifact
    are deleted afterwards."""
    sys.path.insert(0, str(REPO / "examples"))
    from bench_vs_torch import compile_options
    from build_llama import CONFIGS, write

    from atlasc.compiler import compile_model

    config, batches, quant = (spec.split(":") + ["none"])[:3]
    workdir.mkdir(parents=True, exist_ok=True)
    onnx_path, art_path = workdir / f"{config}.onnx", workdir / f"{config}.atlas"
    old = os.environ.get("ATLAS_CACHE_DIR")
    os.environ["ATLAS_CACHE_DIR"] = str(cache)
    try:
        t = time.perf_counter()
        write(CONFIGS[config], onnx_path)
        result = compile_model(onnx_path, art_path, compile_options(arch, [int(b) for b in batches.split(",")],
                                                                    128, 128, quant))
        print(f"gpu_cache: {spec} compiled in {time.perf_counter() - t:.0f} s ({result.seconds})", flush=True)
    finally:
        if old is None:
            del os.environ["ATLAS_CACHE_DIR"]
        else:
            os.environ["ATLAS_CACHE_DIR"] = old
        for path in (onnx_path, onnx_path.with_name(onnx_path.name + ".data"), art_path):
            path.unlink(missing_ok=True)


def pack(cache: Path, out: Path) -> tuple[int, int]:
    """Write the cache's cubins (sorted, no lock files) to `out` (tar.xz); (cubins, raw bytes)."""
    cubins = sorted((cache / "cubin").glob("*.cubin"))
    tmp = out.with_suffix(".tmp")
    with tarfile.open(tmp, "w:xz", preset=XZ_PRESET) as tar:
        for path in cubins:
            tar.add(path, arcname=f"cubin/{path.name}")
    tmp.replace(out)
    return len(cubins), sum(p.stat().st_size for p in cubins)


def send_bytes(pack_bytes: int) -> int:
    """What a device run with carry [".whl", pack] sends: the tracked files (git ls-files), .whl and the pack."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    tracked = sum((REPO / n).stat().st_size for n in listed.decode().split("\0") if n and (REPO / n).is_file())
    wheels = sum(p.stat().st_size for p in (REPO / ".whl").glob("*") if p.is_file())
    return tracked + wheels + pack_bytes


def _add(cache: Path, name: str, read) -> bool:
    """Write cubin `name` (its bytes from read()) into `cache` unless it is there already (written whole, then
    renamed, so a reader never sees part of one); whether it was added."""
    dest = cache / "cubin" / name
    if dest.exists():
        return False
    part = dest.with_suffix(".part")
    part.write_bytes(read())
    part.replace(dest)
    return True


def merge(src: Path, cache: Path) -> int:
    """Copy the cubins of the nvcc cache `src` into `cache`, keeping cubins already there; the cubins added."""
    (cache / "cubin").mkdir(parents=True, exist_ok=True)
    return sum(_add(cache, path.name, path.read_bytes) for path in sorted((src / "cubin").glob("*.cubin")))


def unpack(src: Path, cache: Path) -> int:
    """Extract `src` into `cache`, keeping cubins already there; the cubins added."""
    (cache / "cubin").mkdir(parents=True, exist_ok=True)
    added = 0
    with tarfile.open(src, "r:xz") as tar:
        for member in tar.getmembers():
            name = Path(member.name)
            if not (member.isfile() and name.parent == Path("cubin") and name.suffix == ".cubin"):
                continue  # only cubin/<key>.cubin: nothing else, nowhere else
            added += _add(cache, name.name, tar.extractfile(member).read)
    return added


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm90", help="the GPU machine's arch (default sm90: the H200)")
    ap.add_argument("--out", type=Path, default=PACK, help=f"the pack (default {PACK.name} in the repo root)")
    ap.add_argument("--unpack", action="store_true", help="extract the pack into ATLAS_CACHE_DIR instead")
    ap.add_argument("--bench", action="append", default=[], metavar="CONFIG:BATCHES[:QUANT]",
                    help="also compile gpu_bench.sh's artifact for this config (e.g. llama-3-8b:1,32:int4)")
    ap.add_argument("--cache", action="append", default=[], type=Path, metavar="DIR",
                    help="also pack the cubins of this nvcc cache: the ATLAS_CACHE_DIR of `atlasc compile` runs made "
                         "here with the options and environment a device script will use (e.g. examples/step_ab.sh's)")
    ap.add_argument("--no-tests", action="store_true", help="skip the GPU tests (only --bench / --cache cubins)")
    ap.add_argument("--add", action="store_true", help="keep the cubins of the existing pack too")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "atlasc-gpu-cache-work",
                    help="where --bench writes its model and artifact (both deleted after each)")
    args = ap.parse_args(argv)
    bad = [spec for spec in args.bench if len(spec.split(":")) not in (2, 3)]
    if bad:
        ap.error(f"--bench {bad[0]}: expected CONFIG:BATCHES[:QUANT], e.g. llama-3-8b:1,32")
    missing = [str(d) for d in args.cache if not (d / "cubin").is_dir()]
    if missing:
        ap.error(f"--cache {missing[0]}: no cubin/ folder there (not an nvcc cache)")
    if args.unpack:
        if not args.out.exists():
            print(f"gpu_cache: no {args.out}: nothing to unpack")
            return 0
        added = unpack(args.out, cache_root())
        print(f"gpu_cache: {added} cubins from {args.out.name} into {cache_root()}")
        return 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="atlasc-gpu-cache-") as tmp:
        if args.add and args.out.exists():
            print(f"gpu_cache: {unpack(args.out, Path(tmp))} cubins kept from {args.out.name}", flush=True)
        if not args.no_tests:
            status = fill(args.arch, Path(tmp))
            if status not in (0, 1):  # 1: some test failed without a GPU after compiling (e.g. a CLI run): fine
                print(f"gpu_cache: pytest exited {status}; pack not written", file=sys.stderr)
                return 1
        for spec in args.bench:
            compile_bench(spec, args.arch, Path(tmp), args.workdir)
        for cache in args.cache:
            print(f"gpu_cache: {merge(cache, Path(tmp))} cubins from {cache}", flush=True)
        count, raw = pack(Path(tmp), args.out)
    size = args.out.stat().st_size
    print(f"gpu_cache: {count} cubins for {args.arch}, {raw / 1e6:.1f} MB -> {args.out.name} {size / 1e6:.1f} MB "
          f"in {time.perf_counter() - t0:.0f} s")
    total = send_bytes(size)
    if total > CARRY_LIMIT:
        print(f"gpu_cache: a device run would send {total / 2**20:.1f} MiB (tracked files, .whl, the pack), over its "
              f"64 MiB limit: build a smaller pack (fewer --bench / --cache, or --no-tests)", file=sys.stderr)
        return 1
    print(f"gpu_cache: a device run sends {total / 2**20:.1f} MiB of its 64 MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
