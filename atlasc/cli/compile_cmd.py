"""`atlasc compile`: options (from flags and/or a build.yaml), rich progress, a report or --json."""

from __future__ import annotations

import json
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from atlasc.cli import _bytes, _err, _existing_file, _out, _quant_title, app, state
from atlasc.errors import UsageError, env_switch

# build.yaml's keys and the YAML types each takes (a list of strings also for arch and quant_skip)
CONFIG_TYPES = {"arch": str, "dtype": str, "max_batch": int, "max_seq": int, "fusion": bool, "quant": str,
                "group_size": int, "zero_points": bool, "gptq": bool, "smooth": float, "quant_skip": str,
                "prefill_logits": str}
# the longest sequence a compile accepts: past it the KV cache of even one small layer is gigabytes, and the
# compile's own evaluation of the mask (mask-as-lengths) would allocate max_seq-long host arrays
MAX_SEQ_LIMIT = 1 << 20
# the largest batch a compile accepts: a decode kernel's scratch counters hold 16384 items (codegen/generate.py
# COUNTER_BYTES), which larger batches overrun before any other limit
MAX_BATCH_LIMIT = 1 << 14


def _load_config(path: Path) -> dict:
    import yaml

    _existing_file(path, "config file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except UnicodeDecodeError:
        raise UsageError(f"config file {path} is not UTF-8 text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        why = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UsageError(f"config file {path} is not valid YAML: {where}{why}") from None
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} must hold a mapping of options")
    if not all(isinstance(k, str) for k in data):
        raise UsageError(f"config file {path}: option names must be strings, not "
                         f"{', '.join(repr(k) for k in data if not isinstance(k, str))}")
    data = {k.replace("-", "_"): v for k, v in data.items()}
    unknown = set(data) - set(CONFIG_TYPES)
    if unknown:
        raise UsageError(f"config file {path}: unknown option(s) {', '.join(sorted(unknown))}",
                         hint=f"known: {', '.join(sorted(CONFIG_TYPES))}")
    data = {k: v for k, v in data.items() if v is not None}  # `key:` with no value: the default
    for key, value in data.items():
        _check_config_type(path, key, value)
        if CONFIG_TYPES[key] is bool:
            data[key] = bool(value)
    if isinstance(data.get("arch"), list):
        data["arch"] = ",".join(data["arch"])
    return data


def _check_config_type(path: Path, key: str, value) -> None:
    """UsageError unless build.yaml's `key: value` has the key's type (CONFIG_TYPES; a switch may also be 0 or 1):
    no other coercion, so that `zero_points: "no"` or `max_batch: 2.5` is an error rather than the opposite or a
    truncated setting."""
    want = CONFIG_TYPES[key]
    if want is str and key in ("arch", "quant_skip") and isinstance(value, list):
        ok = all(isinstance(v, str) for v in value)
    elif want is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif want is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif want is bool:
        ok = isinstance(value, bool) or (type(value) is int and value in (0, 1))
    else:
        ok = isinstance(value, want)
    if not ok:
        kind = {str: "a string", int: "an integer", bool: "true or false (or 1 / 0)", float: "a number"}[want]
        listed = " (or a list of strings)" if key in ("arch", "quant_skip") else ""
        raise UsageError(f"config file {path}: {key} must be {kind}{listed}, not {value!r}")


@app.command("compile")
def compile_command(
    model: Annotated[Path, typer.Argument(help="The ONNX model to compile.", metavar="MODEL", show_default=False)],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the .atlas artifact.")],
    arch: Annotated[str | None, typer.Option("--arch", help="Target GPU archs, comma-separated (sm75, sm80, "
                                             "sm86, sm89, sm90, sm100, sm120). Default: sm80,sm90.")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="auto (the export's precision), or fp32 / fp16 to "
                                              "insist on it (no conversion).")] = None,
    max_batch: Annotated[int | None, typer.Option("--max-batch", help="Largest batch the artifact runs "
                                                  "(sizes the KV cache and buffers). Default 8.")] = None,
    max_seq: Annotated[int | None, typer.Option("--max-seq", help="Largest past + new tokens per sequence. "
                                                "Default 2048.")] = None,
    config: Annotated[Path | None, typer.Option("--config", help="A build.yaml holding these options "
                                                "(flags given on the command line win).")] = None,
    verify: Annotated[bool, typer.Option("--verify", help="Run the IR verifier after every pass.")] = False,
    no_fusion: Annotated[bool, typer.Option("--no-fusion", help="Turn every fusion pass off (unfused kernels; "
                                            "also ATLAS_FUSION_ENABLED=0).")] = False,
    dump_ir: Annotated[Path | None, typer.Option("--dump-ir", help="Write the IR after each pass to "
                                                 "DIR/NN-<pass>.txt.")] = None,
    time_passes: Annotated[bool, typer.Option("--time-passes", help="Print each pass's time.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary as the last stdout line.")] = False,
    quant: Annotated[str | None, typer.Option("--quant", help="Weight-only quantization of the linear layers: "
                                              "none, int8 (per channel), int4 (per group) or fp8 (E4M3 per "
                                              "channel; sm89 and newer). Default none.")] = None,
    group_size: Annotated[int | None, typer.Option("--group-size", help="int4: weights per scale along K "
                                                   "(a layer whose K it does not divide stays float). "
                                                   "Default 128.")] = None,
    zero_points: Annotated[bool, typer.Option("--zero-points", help="int4: asymmetric groups, each with a "
                                              "zero point (16 levels over [min, max], 0 included) instead of the "
                                              "symmetric +-max. Default symmetric.")] = False,
    quant_skip: Annotated[list[str] | None, typer.Option("--quant-skip", help="Keep linear layers whose weight, "
                                                         "node or output name matches this glob in float "
                                                         "(repeatable, or comma-separated).")] = None,
    gptq: Annotated[bool, typer.Option("--gptq", help="int4: round each layer by GPTQ on the float activations "
                                       "of the --calib prompts (error feedback through the calibration "
                                       "Hessian) instead of to nearest. Default off.")] = False,
    smooth: Annotated[float | None, typer.Option("--smooth", metavar="ALPHA", help="int8: SmoothQuant before "
                                                 "quantizing: each norm-fed projection's input channels divided by "
                                                 "max|x|^ALPHA / max|w|^(1-ALPHA) measured on the --calib prompts, "
                                                 "its weight columns multiplied by the same (exact in real "
                                                 "arithmetic), so int8 activations (W8A8) lose less to outlier "
                                                 "channels. ALPHA in (0, 1], typically 0.5. Default off.")] = None,
    calib: Annotated[Path | None, typer.Option("--calib", help="With --quant: an .npz of calibration token "
                                               "ids [prompts, length] (key input_ids): decoders' accuracy "
                                               "report (random prompts when absent), --gptq's and --smooth's "
                                               "activations.")] = None,
    verbose: Annotated[int, typer.Option("--verbose", "-v", count=True, help="-v: the rewrites each pass applied; "
                                         "-vv: also the candidates it declined and why (also accepted before the "
                                         "command).")] = 0,
    prefill_logits: Annotated[str | None, typer.Option("--prefill-logits", help="Decoders: 'all' (logits of every "
                                                       "prompt position) or 'last' (only what the next token "
                                                       "needs: the LM head runs on one position). "
                                                       "Default all.")] = None,
) -> None:
    """Compile an ONNX model into one .atlas file: passes, static memory plan, CUDA per arch (nvcc).

    A failed compile leaves no file behind. -v prints the rewrites each pass applied, -vv also the
    candidates it declined and why.
    """
    from atlasc.codegen.nvcc import parse_archs
    from atlasc.compiler import compile_model
    from atlasc.ir.program import CompileOptions

    state.verbose += verbose  # `atlasc -v compile ...` and `atlasc compile -v ...` count alike
    _existing_file(model, "model")
    if output.suffix != ".atlas":
        raise UsageError(f"output must end in .atlas: {output}")
    if not output.parent.is_dir():
        raise UsageError(f"output folder does not exist: {output.parent}")
    if output.is_dir():
        raise UsageError(f"output {output} is a folder")
    if output.exists() and output.resolve() == model.resolve():
        raise UsageError(f"output {output} is the model being compiled", hint="write the artifact elsewhere")
    cfg = _load_config(config) if config else {}
    arch = arch if arch is not None else cfg.get("arch", "sm80,sm90")
    dtype = (dtype or cfg.get("dtype") or "auto").lower()
    if dtype not in ("auto", "fp32", "fp16"):
        raise UsageError(f"--dtype must be auto, fp32 or fp16, not {dtype}")
    max_batch = max_batch if max_batch is not None else int(cfg.get("max_batch", 8))
    max_seq = max_seq if max_seq is not None else int(cfg.get("max_seq", 2048))
    if max_batch < 1 or max_seq < 2:
        raise UsageError("--max-batch must be >= 1 and --max-seq >= 2")
    if max_seq > MAX_SEQ_LIMIT or max_batch > MAX_BATCH_LIMIT:
        raise UsageError(f"--max-seq must be at most {MAX_SEQ_LIMIT} and --max-batch at most {MAX_BATCH_LIMIT} "
                         f"(given {max_seq} and {max_batch})")
    fusion = cfg.get("fusion", True) and not no_fusion and env_switch("ATLAS_FUSION_ENABLED", True)
    quant_opts = _quant_options(quant, group_size, quant_skip, cfg)
    if zero_points or cfg.get("zero_points", False):
        if quant_opts["quant"] != "int4":
            raise UsageError(f"--zero-points applies to --quant int4, not {quant_opts['quant']}")
        quant_opts["zero_points"] = True
    if gptq or cfg.get("gptq", False):
        if quant_opts["quant"] != "int4" or calib is None:
            raise UsageError("--gptq needs --quant int4 and --calib prompts.npz",
                             hint="the calibration prompts are what GPTQ minimizes each layer's output error on")
        quant_opts["gptq"] = True
    smooth = smooth if smooth is not None else cfg.get("smooth")
    if smooth is not None:
        try:
            smooth = float(smooth)
        except (TypeError, ValueError):
            raise UsageError(f"--smooth must be a number in (0, 1], not {smooth!r}") from None
        if not 0 < smooth <= 1:
            raise UsageError(f"--smooth must be in (0, 1], not {smooth:g}", hint="SmoothQuant's usual value is 0.5")
        if quant_opts["quant"] != "int8" or calib is None:
            raise UsageError("--smooth needs --quant int8 and --calib prompts.npz",
                             hint="the calibration prompts give each channel's activation range")
        quant_opts["smooth"] = smooth
    if calib is not None:
        _existing_file(calib, "calibration file")
        if quant_opts["quant"] == "none":
            raise UsageError("--calib only matters with --quant int8, int4 or fp8")
        quant_opts["calib"] = str(calib)
    if quant_opts["quant"] != "none" and not fusion:
        raise UsageError(f"--quant {quant_opts['quant']} needs fusion: it quantizes the linear layers that "
                         "fuse-linear forms, and --no-fusion (or ATLAS_FUSION_ENABLED=0) leaves none")
    if quant_opts["quant_skip"] and quant_opts["quant"] == "none":
        raise UsageError("--quant-skip only matters with --quant int8, int4 or fp8")
    prefill_logits = (prefill_logits or cfg.get("prefill_logits") or "all").lower()
    if prefill_logits not in ("all", "last"):
        raise UsageError(f"--prefill-logits must be all or last, not {prefill_logits}")
    options = CompileOptions(archs=parse_archs(arch), dtype=dtype, max_batch=max_batch, max_seq=max_seq,
                             fusion=fusion, verify=verify, prefill_logits=prefill_logits, **quant_opts)

    console = _err()
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    lines = nullcontext() if as_json or console.is_terminal else _ProgressLines(console)
    with (Progress(*columns, console=console, transient=True, disable=as_json or not console.is_terminal) as progress,
          lines as log):
        task = progress.add_task("compiling", total=None)

        def on_progress(stage: str, detail: str, done: tuple | None = None) -> None:
            # a bar where the stage knows its size (quantizing weights, nvcc's cubins), a pulsing one otherwise
            total, completed = (done[1], done[0]) if done else (None, 0)
            progress.update(task, description=f"{stage}: {detail}{_amount(done)}", total=total, completed=completed)
            if log:
                log.update(stage, detail, done)

        result = compile_model(model, output, options, dump_ir=dump_ir, progress=on_progress)

    if as_json:
        print(json.dumps(result.summary()))
        return
    _print_report(result, time_passes)


class _ProgressLines:
    """Progress when stderr is not a terminal (a CI log, a redirect), where a bar would print nothing.

    Guarantees: a timestamped line at once for every stage and pass that starts, and for each step that has no
    count; while a stage counts its work (done / total, e.g. bytes quantized, cubins built, accuracy steps), its
    latest step at most every EVERY seconds, as `(done of total, p%)`, bytes in B / KiB / MiB / GiB. Used as a
    context manager, a daemon thread prints a held step once it is due, so a long step shows within EVERY
    seconds even when nothing follows it."""

    EVERY = 5.0

    def __init__(self, console, clock=time.monotonic) -> None:
        self.console, self.clock, self.start = console, clock, clock()
        self.last, self.last_at, self.held = None, float("-inf"), None
        self.lock = threading.Lock()
        self.closed = threading.Event()

    def __enter__(self) -> _ProgressLines:
        self.ticker = threading.Thread(target=self._tick_until_closed, name="atlasc-progress", daemon=True)
        self.ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        """After this no line is printed: the report or the error line comes last."""
        self.closed.set()
        self.ticker.join(timeout=5)  # a tick in flight finishes first (tick() prints nothing once closed)

    def update(self, stage: str, detail: str, done: tuple | None) -> None:
        """One progress event: printed now, held for later (a counted step of the stage printed last), or dropped
        (a repeat)."""
        with self.lock:
            if (stage, detail, done) == self.last:
                return
            if done is None or self.last is None or stage != self.last[0]:
                self._print(stage, detail, done)
            else:
                self.held = (stage, detail, done)
                self._print_due()

    def tick(self) -> None:
        """Print the held step if EVERY seconds have passed since the last line."""
        with self.lock:
            if not self.closed.is_set():
                self._print_due()

    def _tick_until_closed(self) -> None:
        while not self.closed.wait(0.5):
            self.tick()

    def _print_due(self) -> None:
        if self.held is not None and self.clock() - self.last_at >= self.EVERY:
            self._print(*self.held)

    def _print(self, stage: str, detail: str, done: tuple | None) -> None:
        now = self.clock()
        self.last, self.last_at, self.held = (stage, detail, done), now, None
        self.console.print(f"[{now - self.start:7.1f} s] {stage}: {detail}{_amount(done)}")


def _amount(done: tuple | None) -> str:
    """" (3 of 12, 25%)", or " (1.5 MiB of 733.0 MiB, 0%)" for a (done, total, "bytes") count; "" for None."""
    if done is None:
        return ""
    unit = _bytes if done[2:] == ("bytes",) else str
    share = f", {100 * done[0] / done[1]:.0f}%" if done[1] else ""
    return f" ({unit(done[0])} of {unit(done[1])}{share})"


def _quant_options(quant: str | None, group_size: int | None, skip: list[str] | None, cfg: dict) -> dict:
    """--quant / --group-size / --quant-skip (flags win over build.yaml), validated."""
    mode = str(quant or cfg.get("quant") or "none").lower()
    if mode not in ("none", "int8", "int4", "fp8"):
        raise UsageError(f"--quant must be none, int8, int4 or fp8, not {mode}")
    try:
        group = int(group_size if group_size is not None else cfg.get("group_size", 128))
    except (TypeError, ValueError):
        raise UsageError(f"--group-size must be an integer, not {cfg.get('group_size')}") from None
    if group < 2 or group % 2:
        raise UsageError(f"--group-size must be an even number >= 2, not {group}")
    if (group_size is not None or "group_size" in cfg) and mode != "int4":
        raise UsageError(f"--group-size applies to --quant int4, not {mode}")
    raw = skip if skip else cfg.get("quant_skip") or []
    if isinstance(raw, str):
        raw = [raw]
    patterns = tuple(p.strip() for item in raw for p in str(item).split(","))
    if any(not p for p in patterns):
        raise UsageError(f"--quant-skip has an empty pattern: {', '.join(map(repr, raw))}")
    return {"quant": mode, "group_size": group, "quant_skip": patterns}


def _kept_in_float(q: dict) -> str:
    """"; 13 layers kept in float: group size 128 does not divide K (64)": the int4 layers the group size left in
    float (a compile that quantizes some layers only says so, not just `inspect`), and those --quant-skip kept."""
    kept = q.get("kept_float", {})
    ks, n_skip = kept.get("group_size_k", []), kept.get("quant_skip", 0)
    parts = []
    if ks:
        parts.append(f"{len(ks)} layer{'s' if len(ks) > 1 else ''} kept in float: group size {q['group_size']} does "
                     f"not divide K ({', '.join(map(str, sorted(set(ks))))})")
    if n_skip:
        parts.append(f"{n_skip} kept by --quant-skip")
    return "".join(f"; {p}" for p in parts)


def _print_report(result, time_passes: bool) -> None:
    out = _out()
    s = result.summary()
    out.print(f"wrote {result.path}  ({result.program.kind}; entries "
              + ", ".join(f"{k}: {n} launches" for k, n in s["entries"].items())
              + f"; {s['kernels']} kernels; archs {', '.join(s['archs'])})")
    mem = Table(title="memory plan", title_justify="left", show_edge=False)
    for col in ("region", "bytes"):
        mem.add_column(col, justify="right" if col == "bytes" else "left")
    mem.add_row("arena", _bytes(s["arena_bytes"]))
    mem.add_row("weights", _bytes(s["weights_bytes"]))
    mem.add_row("kv cache", _bytes(s["kv_cache_bytes"]))
    mem.add_row("activations (planned peak)", _bytes(s["activation_peak_bytes"]))
    if s["scratch_bytes"]:
        mem.add_row("kernel scratch", _bytes(s["scratch_bytes"]))
    mem.add_row("activations (naive sum)", _bytes(s["activation_naive_bytes"]))
    out.print(mem)
    q = result.manifest.report.get("quantization")
    if q:
        out.print(f"{_quant_title(q)}: {len(q['layers'])} layers, weights {_bytes(q['bytes_before'])} -> "
                  f"{_bytes(q['bytes_after'])}, max relative error {q['max_rel_error']:.4f}{_kept_in_float(q)}")
    if state.verbose or time_passes:
        table = Table(title="passes", title_justify="left", show_edge=False)
        table.add_column("pass")
        if time_passes:
            table.add_column("ms", justify="right")
        table.add_column("rewrites")
        for r in result.pipeline.records:
            row = [r.name] + ([f"{r.seconds * 1000:.1f}"] if time_passes else [])
            row.append(", ".join(f"{k} x{v}" for k, v in r.applied.items()) or "-")
            table.add_row(*row)
        out.print(table)
    if state.verbose >= 2:
        for r in result.pipeline.records:
            for where, why in r.declined.items():
                out.print(f"  {r.name}: declined {where}: {why}")
    if time_passes:
        out.print("stages: " + ", ".join(f"{k} {v:.2f} s" for k, v in s["seconds"].items()))
