"""nvcc driver: the cubins of each target arch (one, or one per chunk of a big module), built in parallel
and cached by content hash.

The command is a commented list of flags (each with its reason). The cache key covers the source,
the arch, the nvcc version and the flags, so a cached cubin is exactly what nvcc would produce.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from functools import cache
from pathlib import Path

from atlasc.errors import AtlasError

SUPPORTED_ARCHS = ("sm75", "sm80", "sm86", "sm89", "sm90", "sm100", "sm120")


class NvccNotFoundError(AtlasError):
    """nvcc is not on PATH (or ATLAS_NVCC points nowhere)."""


class NvccError(AtlasError):
    """nvcc rejected the generated source; `.log` holds its output, `.source_path` the rendered file."""


def parse_archs(text: str) -> tuple[str, ...]:
    """'sm80,sm_90' -> ('sm80', 'sm90'); AtlasError naming the unknown ones."""
    archs = []
    for part in text.split(","):
        a = part.strip().lower().replace("_", "")
        if not a:
            continue
        if a not in SUPPORTED_ARCHS:
            raise AtlasError(f"unsupported --arch '{part.strip()}'", hint=f"supported: {', '.join(SUPPORTED_ARCHS)}")
        if a not in archs:
            archs.append(a)
    if not archs:
        raise AtlasError("no target arch given", hint="e.g. --arch sm80,sm90")
    return tuple(archs)


def nvcc_path() -> str:
    """The nvcc executable (ATLAS_NVCC overrides PATH)."""
    path = os.environ.get("ATLAS_NVCC") or shutil.which("nvcc")
    if not path or not Path(path).exists():
        raise NvccNotFoundError("nvcc not found: atlasc needs the CUDA compiler to build kernels",
                                hint="install the CUDA toolkit (or `pip install nvidia-cuda-nvcc`) and put nvcc "
                                     "on PATH, or set ATLAS_NVCC")
    if not Path(path).is_file() or not os.access(path, os.X_OK):
        raise NvccNotFoundError(f"nvcc at {path} is not an executable file", hint="point ATLAS_NVCC at the nvcc "
                                "executable, or unset it to take nvcc from PATH")
    return path


@cache
def nvcc_version(path: str) -> str:
    """nvcc's version (V13.0.48), or its last line of `--version` output; NvccNotFoundError if it cannot start."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False).stdout
    except OSError as e:
        raise NvccNotFoundError(f"nvcc at {path} cannot run: {e.strerror or e}",
                                hint="point ATLAS_NVCC at the nvcc executable, or unset it") from None
    m = re.search(r"release ([\d.]+), V([\d.]+)", out)
    return m.group(2) if m else out.strip().splitlines()[-1] if out.strip() else "unknown"


# a source whose kernels use sm90's arch-specific instructions (wgmma: codegen/linear_tma.py) says so with this
# line; for sm90 it is then built for sm_90a, which runs on the same GPUs (compute capability 9.0 exactly)
SM90A_MARKER = "// atlasc: sm_90a (wgmma, linear_tma.cu)"


def flags(arch: str, source: str = "") -> list[str]:
    """The nvcc command line for one arch, minus the input and output paths (sm90 as sm_90a when `source` holds
    SM90A_MARKER)."""
    n = arch[2:] + ("a" if arch == "sm90" and SM90A_MARKER in source else "")
    return [
        "-cubin",  # a device-only binary the runtime loads with cuModuleLoadData
        "-O3",  # full device optimization
        "-std=c++17",  # the kernel library uses C++17 (if constexpr, inline variables)
        "-lineinfo",  # source lines in profiles, at no run-time cost
        f"-gencode=arch=compute_{n},code=sm_{n}",  # machine code for exactly this arch
        "-Xptxas=-warn-spills",  # register spills show up in the log
        # no --use_fast_math: division, sqrt and exp stay IEEE so kernels match the numpy reference
    ]


def cache_dir() -> Path:
    """The cubin cache's folder (ATLAS_CACHE_DIR/cubin, default ~/.cache/atlasc/cubin); it may not exist yet."""
    root = os.environ.get("ATLAS_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "atlasc")
    return Path(root) / "cubin"


def _ready_cache_dir() -> Path:
    """cache_dir(), created; AtlasError naming ATLAS_CACHE_DIR when it cannot be (a file, no permission)."""
    path = cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise AtlasError(f"cannot use {path} as the cubin cache: {e.strerror or e}",
                         hint="set ATLAS_CACHE_DIR to a writable folder") from None
    return path


def chunk_size() -> int:
    """Kernels per nvcc translation unit of a chunked build (ATLAS_NVCC_CHUNK, default 24).

    Fixed, not derived from the machine's core count, so that a build is byte-identical everywhere."""
    text = os.environ.get("ATLAS_NVCC_CHUNK", "") or "24"
    if not text.isdigit() or int(text) < 1:
        raise AtlasError(f"ATLAS_NVCC_CHUNK={text!r} is not a kernel count (expected an integer >= 1)")
    return int(text)


def compile_module(module, archs: tuple[str, ...], *, on_built=None) -> dict[str, list[bytes]]:
    """Compile a GeneratedModule: arch -> its cubins (the runtime loads each as one module). One nvcc per
    arch gives one cubin; a big module is split into chunks of `chunk_size()` kernels compiled in
    parallel, one cubin per chunk. on_built(done, total): cubins ready so far, called in the caller's thread
    whenever that count grows.

    nvcc compiles one translation unit on one core, and a Linear kernel with its GEMV and tensor-core
    variants takes seconds: chunks are what let a build use every core of the machine. They are not
    linked into one cubin: relocatable device code (-rdc, which nvlink needs) makes ptxas give the decode
    GEMVs up to 3x the registers (int4 LinearQ4 on sm90: 212 instead of 67, 1 block per SM instead of 3),
    and the kernels share no device symbols (each reads only its arena), so separate modules lose nothing.
    """
    kernels = getattr(module, "kernels", None)
    size = chunk_size()
    if not kernels or len(kernels) <= 2 * size:
        return {arch: [cubin] for arch, cubin in compile_cubins(module.source, archs, on_built=on_built).items()}
    chunks = [module.prelude + "\n" + "\n".join(kernels[i:i + size]) + "\n" for i in range(0, len(kernels), size)]
    return compile_chunked(chunks, archs, on_built=on_built)


def compile_chunked(chunks: list[str], archs: tuple[str, ...], *, on_built=None) -> dict[str, list[bytes]]:
    """arch -> one cubin per chunk (in chunk order), every (chunk, arch) compiled in parallel and cached
    on its own (compile_cubins); on_built(done, total) as in compile_module."""
    jobs = [(arch, chunk) for arch in archs for chunk in chunks]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        built = _map_waking(pool, lambda job: compile_cubins(job[1], (job[0],), jobs=1)[job[0]], jobs, on_built)
    return {arch: [data for (a, _), data in zip(jobs, built) if a == arch] for arch in archs}


def compile_cubins(source: str, archs: tuple[str, ...], *, jobs: int | None = None,
                   on_built=None) -> dict[str, bytes]:
    """Compile `source` for each arch (in parallel); return arch -> cubin bytes. on_built(done, total) as in
    compile_module.

    Guarantees: identical inputs give identical bytes (served from the cache when present).
    Raises NvccNotFoundError, or NvccError naming the rendered .cu file and carrying nvcc's log.
    """
    exe = nvcc_path()
    version = nvcc_version(exe)
    folder = _ready_cache_dir()

    def one(arch: str) -> tuple[str, bytes]:
        args = flags(arch, source)
        key = hashlib.sha256("\0".join([source, arch, version, *args]).encode()).hexdigest()
        cached = folder / f"{key}.cubin"
        # one build of a given source and arch at a time across processes: the build folder's name is
        # fixed (see _run_nvcc), and the second process then finds the first one's cubin in the cache
        with exclusive(cached.with_suffix(".lock")):
            if cached.exists():
                data = cached.read_bytes()
            else:
                data = _run_nvcc(exe, source, arch, args)
                tmp = cached.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_bytes(data)
                os.replace(tmp, cached)
        return arch, data

    with ThreadPoolExecutor(max_workers=jobs or min(len(archs), os.cpu_count() or 1)) as pool:
        return dict(_map_waking(pool, one, archs, on_built))


def _map_waking(pool: ThreadPoolExecutor, fn, items, on_done=None) -> list:
    """pool.map(fn, items) as a list, the caller waiting in slices of 0.1 s and calling on_done(done, total)
    (in its own thread) whenever more items have ended. CPython runs a signal's Python handler (atlasc's SIGINT /
    SIGTERM handler, which stops nvcc) in the main thread only, when it next executes bytecode, and the kernel may
    deliver the signal to a worker thread waiting on nvcc: a main thread blocked until the futures end then let a
    terminated compile run nvcc to its end and cache the cubin (tests/test_compile_cli.py's terminated-compile
    test failed so under load, docs/perf.md v37)."""
    futures = [pool.submit(fn, item) for item in items]
    reported = 0
    try:
        while True:
            pending = len(wait(futures, timeout=0.1).not_done)
            if on_done is not None and len(futures) - pending > reported:
                reported = len(futures) - pending
                on_done(reported, len(futures))
            if not pending:
                return [f.result() for f in futures]
    except BaseException:  # e.g. KeyboardInterrupt in library use (no CLI handler): no queued build starts, and the
        for f in futures:  # running ones end now (nvcc has a session of its own: a Ctrl-C never reaches it)
            f.cancel()
        _terminate_children()
        raise


_children: set = set()  # nvcc processes running now (stop_children)
_children_lock = threading.Lock()
_stopping = threading.Event()
_stop_signal = [signal.SIGTERM]  # the signal stop_children() was called for


class CompileStopped(AtlasError):
    """The compile was stopped by a signal (stop_children, from atlasc's SIGINT / SIGTERM handler): one line,
    `interrupted (SIGINT)` or `terminated (SIGTERM)`, and the exit status 128 + the signal's number, whichever way
    the stop reaches the top (the handler's exception can be lost when the signal lands in a finalizer, whose
    exceptions Python only prints)."""

    def __init__(self, signum: int = signal.SIGTERM):
        what = "interrupted" if signum == signal.SIGINT else "terminated"
        super().__init__(f"{what} ({signal.Signals(signum).name})")
        self.exit_code = 128 + signum


def check_stopped() -> None:
    """CompileStopped once stop_children() has run (the compile driver calls it between stages and passes)."""
    if _stopping.is_set():
        raise CompileStopped(_stop_signal[0])


def _run_tool(cmd: list[str], cwd) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) that stop_children() can end."""
    check_stopped()
    # its own process group (stop_children ends cicc / ptxas too) and its temporaries in cwd, a folder the
    # caller removes (nvcc leaves its tmpxft files behind when it is terminated)
    env = {**os.environ, "TMPDIR": str(cwd)}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env,
                          start_new_session=True) as proc:
        with _children_lock:
            _children.add(proc)
        try:
            if _stopping.is_set():
                _terminate(proc)
            out, err = proc.communicate()
        finally:
            with _children_lock:
                _children.discard(proc)
    check_stopped()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stop_children(signum: int = signal.SIGTERM) -> None:
    """Terminate the running nvcc processes and refuse new ones (a compile stopped by the signal `signum`: the
    thread pools then unwind at once instead of waiting for every queued job)."""
    _stop_signal[0] = signum
    _stopping.set()
    _terminate_children()


def _terminate_children() -> None:
    with _children_lock:
        for proc in list(_children):
            _terminate(proc)


def resume() -> None:
    """Undo stop_children(): new nvcc processes may start again (atlasc.cli.main calls it once a stopped command
    has cleaned up, so a later compile in the same process is not refused)."""
    _stopping.clear()


def _terminate(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # the tool and the processes it started
    except (ProcessLookupError, PermissionError):
        pass


@contextmanager
def exclusive(path: Path):
    """Hold an exclusive lock across processes, by flock on the file `path`, removed again on release so that no
    lock files pile up (in TMPDIR or the cache). A process that waited on a file another one then removed finds
    that the path no longer names its file and locks the new one instead."""
    while True:
        f = open(path, "w")
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # while still held: a waiter then sees its file gone
        f.close()


def _run_nvcc(exe: str, source: str, arch: str, args: list[str]) -> bytes:
    # -lineinfo records the build folder in the cubin: a folder named by the content hash keeps
    # rebuilds byte-identical (a random temporary name would not)
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    tmp = Path(tempfile.gettempdir()) / f"atlasc-nvcc-{key}-{arch}"
    # the folder is the same for every process compiling this source (parallel builds of one model):
    # hold it exclusively, or one process's cleanup pulls the files from under another's nvcc
    with exclusive(tmp.with_name(tmp.name + ".lock")):
        return _run_nvcc_in(exe, source, arch, args, tmp)


def _run_nvcc_in(exe: str, source: str, arch: str, args: list[str], tmp: Path) -> bytes:
    try:  # the removal is armed before the folder exists (a stop between the two would leave it)
        tmp.mkdir(parents=True, exist_ok=True)
        src = tmp / "kernels.cu"
        out = tmp / f"{arch}.cubin"
        src.write_text(source)
        os.utime(src, (315532800, 315532800))  # the line table records the file's mtime: pin it (1980-01-01)
        # relative paths from inside the temp folder: -lineinfo records the file name, and a random
        # folder name in the cubin would break byte-identical rebuilds
        proc = _run_tool([exe, *args, src.name, "-o", out.name], cwd=tmp)
        if proc.returncode != 0 or not out.exists():
            kept = Path(tempfile.gettempdir()) / f"atlasc-failed-{hashlib.sha256(source.encode()).hexdigest()[:12]}.cu"
            kept.write_text(source)
            said = (proc.stderr + proc.stdout).strip()
            # nvcc that fails without a word did not get to the source: a broken toolkit, not the generated code
            hint = ("this is a bug in atlasc's code generation; please report it with the .cu file" if said else
                    f"nvcc ({exe}) exited without a message: check the CUDA toolkit with `{exe} --version`")
            err = NvccError(f"nvcc failed for {arch} on {kept} (exit {proc.returncode}): {_first_error(said)}",
                            hint=hint)
            err.log = proc.stderr + proc.stdout
            err.source_path = str(kept)
            raise err
        data = out.read_bytes()
        out.unlink()
        return data
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _first_error(log: str) -> str:
    for line in log.splitlines():
        if "error" in line:
            return line.strip()[:300]
    return (log.strip().splitlines() or ["no output"])[0][:300]
