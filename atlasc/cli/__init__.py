"""The `atlasc` command line: a thin Typer layer over the library.

Commands raise typed `AtlasError`s; `main()` is the one error boundary: it prints `error: <message>`
and `hint: <hint>` on stderr (one line each) and exits with code 2, or re-raises under `--debug`.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
import zipfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from atlasc import __version__
from atlasc.errors import AtlasError, UsageError

app = typer.Typer(
    name="atlasc",
    help="Ahead-of-time compiler for transformer ONNX models.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@dataclass
class _State:
    debug: bool = False
    verbose: int = 0


state = _State()


def _out() -> Console:
    # built per call so it follows sys.stdout / sys.stderr as they are now (tests capture them)
    return Console(highlight=False, soft_wrap=True, markup=False)  # no markup: shapes look like [a, b]


def _err() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True, markup=False)


def _version_callback(value: bool) -> None:
    if value:
        print(f"atlasc {__version__}")
        raise typer.Exit()


@app.callback()
def _global(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.",
                                          callback=_version_callback, is_eager=True)] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show the full traceback on errors.")] = False,
    verbose: Annotated[int, typer.Option("--verbose", "-v", count=True,
                                         help="More output (repeat for even more).")] = 0,
) -> None:
    """atlasc: ahead-of-time compiler for transformer ONNX models."""
    import os

    from atlasc.env_vars import unknown_variables

    state.debug = debug
    state.verbose = verbose
    for line in unknown_variables(os.environ):  # a misspelt ATLAS_* name would be ignored silently
        _err().print(f"warning: {line}")


class Device(str, Enum):
    cpu = "cpu"
    gpu = "gpu"


def _existing_file(path: Path, what: str) -> Path:
    if not path.exists():
        raise UsageError(f"{what} not found: {path}")
    if not path.is_file():
        raise UsageError(f"{what} is not a file: {path}")
    return path


def is_artifact(path: Path) -> bool:
    """Whether `path` is to be read as an .atlas artifact: its suffix, or (renamed) its content: an artifact is a
    zip whose first member is manifest.json (atlasc/artifact/writer.py fixes that order), while an ONNX protobuf
    starts with a field tag and another zip (an .npz) with another member."""
    if path.suffix == ".atlas":
        return True
    try:
        with open(path, "rb") as f:
            header = f.read(30 + len("manifest.json"))
    except OSError:
        return False
    return header[:4] == b"PK\x03\x04" and header[26:28] == len("manifest.json").to_bytes(2, "little") and \
        header[30:] == b"manifest.json"


def _shape(shape) -> str:
    if shape is None:
        return "?"
    return "[" + ", ".join(str(d) for d in shape) + "]"


# ---------------------------------------------------------------------------------------------
# inspect


@app.command()
def inspect(
    model: Annotated[Path, typer.Argument(help="The ONNX model or .atlas artifact to describe.", metavar="MODEL",
                                          show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
) -> None:
    """Describe an ONNX model (inputs and outputs with symbolic dims, op histogram, parameters,
    unsupported ops, detected architecture hints) or a .atlas artifact (entry points, kernels per
    arch, memory plan, checksums)."""
    from atlasc.frontend.inspect import inspect_onnx

    _existing_file(model, "model")
    if is_artifact(model):
        from atlasc.cli.artifact_cmd import inspect_artifact

        inspect_artifact(model, as_json)
        return
    report = inspect_onnx(model)
    if as_json:
        print(json.dumps(report))
        return
    _print_inspect(report)


def _print_inspect(r: dict[str, Any]) -> None:
    out = _out()
    producer = r['producer'] or 'unknown producer'
    out.print(Text(f"{r['model']}", style="bold") + Text(f"  (graph '{r['graph_name']}', {producer}, "
                                                         + ", ".join(f"{d} {v}" for d, v in r["opsets"].items()) + ")"))

    io = Table(title="inputs / outputs", title_justify="left", show_edge=False)
    io.add_column("")
    io.add_column("name")
    io.add_column("dtype")
    io.add_column("shape")
    for kind in ("inputs", "outputs"):
        for v in r[kind]:
            io.add_row(kind[:-4] or "in", v["name"], v["dtype"], _shape(v["shape"]))
    out.print(io)

    p = r["parameters"]
    out.print(f"parameters: {p['count']:,} in {p['tensors']} tensors, {_bytes(p['bytes'])}"
              f" (all constants: {_bytes(r['constant_bytes'])})")

    h = {k: v for k, v in r["hints"].items() if v is not None}
    out.print("architecture: " + ", ".join(f"{k}={_hint(v)}" for k, v in h.items()))

    ops = r["ops"]
    out.print(f"ONNX ops ({r['nodes']} nodes): " + ", ".join(f"{op} {n}" for op, n in ops.items()))
    imp = r["import"]
    if imp["ok"]:
        line = f"imported: {imp['nodes']} IR nodes"
        if imp.get("symbols"):
            line += "; symbols: " + ", ".join(_symbol(k, v) for k, v in imp["symbols"].items())
        out.print(line)
        if state.verbose:
            out.print("IR ops: " + ", ".join(f"{op} {n}" for op, n in imp["ops"].items()))
    if r["unsupported_ops"]:
        out.print(Text("unsupported ops:", style="bold red"))
        for u in r["unsupported_ops"]:
            out.print(f"  {u['op']} (opset {u['opset']}, e.g. node '{u['node']}')")
    elif not imp["ok"]:
        out.print(Text("import failed: ", style="bold red") + Text(str(imp["error"])))


def _hint(v) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {x}" for k, x in v.items()) + "}"
    return str(v)


def _symbol(name: str, info: dict) -> str:
    lo, hi = info.get("lower"), info.get("upper")
    if lo is None and hi is None:
        return name
    return f"{lo if lo is not None else ''} <= {name}" + (f" <= {hi}" if hi is not None else "")


def _quant_title(q: dict) -> str:
    """"quantization int4 g128 with zero points" (", SmoothQuant alpha 0.5 on 5 inputs"): a quantize report's mode,
    as compile and inspect print it."""
    smooth = q.get("smooth")
    return (f"quantization {q['mode']}" + (f" g{q['group_size']}" if q.get("group_size") else "")
            + (" with zero points" if q.get("zero_points") else "")
            + (f", SmoothQuant alpha {smooth['alpha']:g} on {len(smooth['inputs'])} inputs" if smooth else ""))


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# ---------------------------------------------------------------------------------------------
# run


def _load_inputs(path: Path) -> dict[str, Any]:
    """One array per model input. Keys `in.<name>` (our fixtures) lose the prefix; `out.*` is ignored."""
    import numpy as np

    _existing_file(path, "inputs file")
    hint = "pass an .npz written by numpy.savez, one array per model input"
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise UsageError(f"inputs file {path} holds one unnamed array, not an .npz of named arrays", hint)
        with loaded:
            arrays = {k: loaded[k] for k in loaded.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:  # not an npz, or a corrupt one
        detail = "" if isinstance(e, ValueError) else f" ({e})"  # numpy's ValueError talks about pickles
        raise UsageError(f"inputs file {path} is not a readable .npz{detail}", hint) from None
    inputs: dict[str, Any] = {}
    for key, arr in arrays.items():
        if key.startswith("out."):
            continue
        name = key.removeprefix("in.")
        if name in inputs:
            raise UsageError(f"inputs file {path} holds input '{name}' twice (as '{name}' and 'in.{name}')")
        inputs[name] = arr
    return inputs


def write_npz(path: Path, arrays: dict) -> None:
    """np.savez of `arrays` to `path`; UsageError (no traceback) when the file cannot be written."""
    import numpy as np

    try:
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None


@app.command()
def run(
    model: Annotated[Path, typer.Argument(help="An ONNX model or a .atlas artifact.", metavar="MODEL",
                                          show_default=False)],
    inputs: Annotated[Path | None, typer.Option("--inputs", help="An .npz with one array per model input, "
                                                "named as the input (an 'in.' prefix is accepted).")] = None,
    out: Annotated[Path | None,
                   typer.Option("--out", help="Write the outputs here (.npz, one array per output).")] = None,
    device: Annotated[Device, typer.Option("--device", help="Where to run: cpu (numpy reference; the only choice "
                                           "for .onnx) or gpu (an artifact on the CUDA GPU).")] = Device.cpu,
    prompt_ids: Annotated[str | None, typer.Option("--prompt-ids", help="Decoder artifacts: prompt token ids, "
                                                   "comma-separated; ';' separates the prompts of a batch.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Tokens to generate per prompt.")] = 16,
    entry: Annotated[str | None, typer.Option("--entry", help="Artifacts with --inputs: the entry point to run "
                                              "(default forward, or prefill).")] = None,
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature; 0 is greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample among the k most likely tokens (0: off).")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="Sample from the smallest set holding this much "
                                         "probability (1: off).")] = 1.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the sampler (same seed, same tokens).")] = 0,
    stop: Annotated[str | None, typer.Option("--stop", help="Stop token ids, comma-separated.")] = None,
    cuda_graphs: Annotated[bool, typer.Option("--cuda-graphs/--no-cuda-graphs",
                                              help="Replay captured CUDA graphs (GPU; off for debugging).")] = True,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing on success.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary as the last stdout line.")] = False,
) -> None:
    """Run a model. An ONNX model runs on the numpy reference interpreter (--device cpu) with --inputs.
    A .atlas artifact generates from --prompt-ids (decoders: greedy, prefill then decode steps) or runs
    one entry point on --inputs; --device cpu executes its schedule over a numpy arena laid out as its
    memory plan says."""
    _existing_file(model, "model")
    if out is not None and not out.parent.is_dir():
        raise UsageError(f"output folder does not exist: {out.parent}")
    if out is not None and out.is_dir():
        raise UsageError(f"--out {out} is a folder")
    if max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    if is_artifact(model):
        from atlasc.cli.artifact_cmd import run_artifact

        import numpy as np

        float32_max = float(np.finfo(np.float32).max)  # the sampler reads the temperature as float32
        for ok, why in ((0 <= temperature <= float32_max,
                         f"--temperature must be a number in [0, {float32_max:.4g}] (the sampler's float32)"),
                        (0 <= top_k < 2**63, "--top-k must be in [0, 2**63)"),
                        (0 < top_p <= 1, "--top-p must be a number in (0, 1]"),
                        (0 <= seed < 2**63, "--seed must be in [0, 2**63)")):
            if not ok:  # a NaN fails every comparison
                raise UsageError(why)
        if prompt_ids is not None and (inputs is not None or out is not None or entry is not None):
            raise UsageError("--prompt-ids generates tokens; --inputs, --entry and --out run one entry point: give "
                             "one or the other")
        run_artifact(model, device=device.value, inputs=_load_inputs(inputs) if inputs is not None else None,
                     prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, out_path=out, entry=entry, quiet=quiet,
                     as_json=as_json, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                     stop=stop, cuda_graphs=cuda_graphs)
        return
    if device is Device.gpu:
        raise UsageError("--device gpu runs compiled artifacts", "compile first: atlasc compile MODEL -o m.atlas")
    if prompt_ids is not None:
        raise UsageError("--prompt-ids runs compiled decoder artifacts; an ONNX model runs on --inputs x.npz",
                         hint="compile first: atlasc compile MODEL -o m.atlas")

    from atlasc.frontend import import_onnx
    from atlasc.ir import interpret

    feeds = _load_inputs(inputs) if inputs is not None else {}
    t0 = time.perf_counter()
    graph = import_onnx(model)
    if inputs is None and graph.inputs:
        raise UsageError("running an ONNX model needs --inputs x.npz, one array per model input",
                         hint="inputs: " + ", ".join(v.name for v in graph.inputs))
    t1 = time.perf_counter()
    results = interpret(graph, feeds)
    t2 = time.perf_counter()

    if out is not None:
        write_npz(out, results)

    if as_json:
        summary = {"outputs": [{"name": k, "dtype": str(v.dtype), "shape": list(v.shape)} for k, v in results.items()],
                   "out": str(out) if out is not None else None}
        print(json.dumps(summary))
        return
    if quiet:
        return
    table = Table(show_edge=False)
    for col in ("output", "dtype", "shape", "min", "max", "mean"):
        table.add_column(col, justify="right" if col in ("min", "max", "mean") else "left")
    for name, arr in results.items():
        table.add_row(name, str(arr.dtype), _shape(arr.shape), *_stats(arr))
    console = _out()
    console.print(table)
    if out is not None:
        console.print(f"wrote {out}")
    if state.verbose:
        console.print(f"import {t1 - t0:.3f} s, interpret {t2 - t1:.3f} s")


def _stats(arr) -> tuple[str, str, str]:
    import numpy as np

    if arr.size == 0 or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        return "-", "-", "-"
    a = arr.astype(np.float64)
    return f"{a.min():.4g}", f"{a.max():.4g}", f"{a.mean():.4g}"


# ---------------------------------------------------------------------------------------------
# the error boundary


def _report(e: AtlasError) -> None:
    err = _err()
    err.print(Text("error: ", style="bold red") + Text(e.message))
    if e.hint:
        err.print(Text("hint: ", style="bold") + Text(e.hint))


class _Stopped(BaseException):
    """Raised by the SIGINT / SIGTERM handler. A BaseException, so that no `except Exception` on the way (the
    passes' pattern probes, the ONNX loader) takes it for a failure of its own; not KeyboardInterrupt, which
    Typer turns into a silent exit 130 before main() sees it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame) -> None:
    # a second Ctrl-C or SIGTERM must not interrupt the cleanup (temporary artifact, spill directory, nvcc folders)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from atlasc.codegen.nvcc import stop_children

    stop_children(signum)  # running nvcc processes end now; the thread pools unwind without waiting for them
    raise _Stopped(signum)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `atlasc` console script and `python -m atlasc`.

    Exit codes: 0 success, 2 for any user error (AtlasError or a usage error from the parser), 130 / 143 when
    SIGINT (Ctrl-C) / SIGTERM stopped it, after one `error: interrupted (SIGINT)` / `error: terminated (SIGTERM)`
    line and the compile's cleanup (no artifact, no temporary file, no nvcc left running).
    """
    state.debug = False
    state.verbose = 0
    # both signals unwind the same way, so a stopped compile removes its temporary artifact and spill directory:
    # nothing is left half-written. A SIGINT the parent ignores (a background job of a script) stays ignored.
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signum) is not signal.SIG_IGN:
                previous[signum] = signal.signal(signum, _stop)
    try:
        # standalone mode: typer prints its own usage errors and exits 2; AtlasError comes through
        app(args=argv, prog_name="atlasc")
    except _Stopped as e:
        from atlasc.codegen.nvcc import CompileStopped

        stopped = CompileStopped(e.signum)
        _report(stopped)
        sys.exit(stopped.exit_code)
    except AtlasError as e:
        if state.debug:
            raise
        _report(e)
        sys.exit(e.exit_code)
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: installed from C (an embedding application); cannot be put back
                signal.signal(signum, handler)
        nvcc = sys.modules.get("atlasc.codegen.nvcc")
        if nvcc is not None:
            nvcc.resume()  # a later main() in this process (a notebook, a test harness) compiles again


# commands defined in their own modules register themselves on `app`
from atlasc.cli import bench_cmd, compile_cmd  # noqa: E402,F401
