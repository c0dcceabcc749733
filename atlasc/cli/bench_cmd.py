"""`atlasc bench` and `atlasc profile`: decoder speed on the GPU, as tables or --json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from atlasc.cli import _existing_file, _out, app, is_artifact
from atlasc.errors import UsageError


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{what} must be comma-separated integers: {text}") from None
    if not values or min(values) < 1:
        raise UsageError(f"{what} must be positive integers: {text}")
    return values


def _load(model: Path, cuda_graphs: bool = True):
    from atlasc.artifact import open_artifact
    from atlasc.runtime.gpu import GpuModel

    _existing_file(model, "artifact")
    if not is_artifact(model):
        raise UsageError(f"bench and profile take a compiled .atlas artifact, not {model.name}",
                         hint="compile first: atlasc compile MODEL -o m.atlas")
    art = open_artifact(model)
    if "decode" not in art.manifest.entries:
        raise UsageError("bench and profile measure decoders (this artifact has no decode entry)")
    return GpuModel(art, cuda_graphs=cuda_graphs)


@app.command("bench")
def bench_command(
    model: Annotated[Path, typer.Argument(help="A compiled decoder artifact.", metavar="MODEL", show_default=False)],
    batch: Annotated[str, typer.Option("--batch", help="Batch sizes, comma-separated.")] = "1",
    prompt: Annotated[int, typer.Option("--prompt", help="Prompt tokens per sequence.")] = 128,
    gen: Annotated[int, typer.Option("--gen", help="Generated tokens per sequence.")] = 128,
    repeats: Annotated[int, typer.Option("--repeats", help="Runs per batch size (medians are reported).")] = 3,
    bandwidth: Annotated[float, typer.Option("--bandwidth", help="Memory bandwidth for the roofline, TB/s "
                                             "(4.30: the H200's measured copy rate).")] = 4.30,
    as_json: Annotated[bool, typer.Option("--json", help="Print the rows as one JSON object.")] = False,
) -> None:
    """Median prefill ms, decode ms/step and tokens/s per batch size, next to the bandwidth roofline of a
    decode step (weights + KV cache read once) and the device memory in use."""
    from atlasc.runtime.bench import bench, rows_as_dicts

    batches = _ints(batch, "--batch")
    m = _load(model)
    kv = m.manifest.kv_cache
    if max(batches) > kv.max_batch or prompt + gen > kv.max_seq:
        raise UsageError(f"batch {max(batches)} / {prompt}+{gen} tokens exceed the compiled maxima "
                         f"({kv.max_batch} / {kv.max_seq})", hint="recompile with larger --max-batch/--max-seq")
    rows = bench(m, batches, prompt, gen, repeats, bandwidth * 1e12)
    if as_json:
        print(json.dumps({"model": str(model), "rows": rows_as_dicts(rows)}))
        return
    t = Table(title=f"{model.name}: prompt {prompt}, {gen} new tokens, medians of {repeats}", title_justify="left",
              show_edge=False)
    for col in ("batch", "prefill ms", "decode ms/step", "tokens/s", "roofline ms/step", "% of roofline",
                "device GiB"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r.batch), f"{r.prefill_ms:.2f}", f"{r.decode_ms_per_step:.3f}", f"{r.tokens_per_s:.1f}",
                  f"{r.roofline_ms:.3f}", f"{r.roofline_pct:.1f}", f"{r.peak_device_gib:.2f}")
    _out().print(t)


@app.command("profile")
def profile_command(
    model: Annotated[Path, typer.Argument(help="A compiled decoder artifact.", metavar="MODEL", show_default=False)],
    batch: Annotated[int, typer.Option("--batch", help="Batch size of the profiled step.")] = 1,
    context: Annotated[int, typer.Option("--context", help="Tokens in the cache (past + 1).")] = 128,
    entry: Annotated[str, typer.Option("--entry", help="decode or prefill.")] = "decode",
    top: Annotated[int, typer.Option("--top", help="Rows to print.")] = 25,
    as_json: Annotated[bool, typer.Option("--json", help="Print every row as JSON.")] = False,
) -> None:
    """Per-kernel time of one step (the step replayed as a CUDA graph with an event around every kernel:
    the kernels run back to back and the rows add up to the step), with bytes and FLOPs per kernel and
    the achieved GB/s and TFLOP/s, slowest first."""
    from atlasc.runtime.bench import profile

    m = _load(model, cuda_graphs=False)
    rows = profile(m, batch, context, entry)
    total = sum(r.us for r in rows)
    if as_json:
        rows_json = [{"kernel": r.kernel, "op": r.op, "node": r.node, "us": r.us, "bytes": r.bytes, "flops": r.flops,
                      "gbps": r.gbps, "tflops": r.tflops} for r in rows]
        print(json.dumps({"total_us": total, "method": rows[0].method if rows else "", "rows": rows_json}))
        return
    how = "" if not rows or rows[0].method == "graph" else " (launched from the host: short kernels overstated)"
    t = Table(title=f"{entry} step, batch {batch}, context {context}: {len(rows)} kernels, {total:.1f} us{how}",
              title_justify="left", show_edge=False)
    for col in ("op", "node", "us", "% time", "MB", "GB/s", "TFLOP/s"):
        t.add_column(col, justify="left" if col in ("op", "node") else "right")
    for r in rows[:top]:
        t.add_row(r.op, r.node[:40], f"{r.us:.1f}", f"{100 * r.us / total:.1f}", f"{r.bytes / 1e6:.2f}",
                  f"{r.gbps:.0f}", f"{r.tflops:.2f}")
    _out().print(t)
