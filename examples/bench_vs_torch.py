"""atlasc next to Hugging Face transformers on the same Llama shapes and GPU, in one run.

Builds the model (examples/build_llama.py: real shapes, seeded random fp16 weights), compiles it
for this GPU, runs `atlasc bench`, then measures transformers' LlamaForCausalLM of the same config
(random weights too: timing only) with eager generation and with the static cache, and prints one
table with the ratios. The peers are measured here, never quoted. atlasc runs with the runtime's defaults
(programmatic dependent launch on sm90+, unless ATLAS_PDL=0 is set); --pdl-ab benches its artifact twice,
with ATLAS_PDL=0 (plain CUDA graphs) and ATLAS_PDL=1.

    python examples/bench_vs_torch.py --config llama-3.2-1b --batch 1,32 --prompt 128 --gen 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from build_llama import CONFIGS, write  # noqa: E402


def compile_options(arch: str, batches: list[int], prompt: int, gen: int, quant: str = "none"):
    """The CompileOptions of atlasc's artifact in this bench (examples/gpu_cache.py --bench compiles the same
    on the CPU machine, so that the GPU machine finds its cubins cached)."""
    from atlasc.ir.program import CompileOptions

    return CompileOptions(archs=(arch,), max_batch=max(batches), max_seq=prompt + gen, prefill_logits="last",
                          quant=quant)


def compile_one(onnx_path: Path, art_path: Path, options, switch: tuple[str, str] | None) -> str:
    """Compile onnx_path to art_path with `options`, the environment switch (NAME, value) set first (it stays set in
    this process), printing a line as the compile enters each stage ("[compile NAME] 41 s: accuracy"), so that a
    run cut by a time limit shows where each compile was; the line saying how long it took and how many kernels
    each entry has."""
    from atlasc.compiler import compile_model

    if switch:
        os.environ[switch[0]] = switch[1]
    t = time.perf_counter()
    stages = []

    def progress(stage, detail, done=None):
        if not stages or stages[-1] != stage:
            stages.append(stage)
            print(f"[compile {art_path.name}] {time.perf_counter() - t:.0f} s: {stage}", flush=True)

    result = compile_model(onnx_path, art_path, options, progress=progress)
    kernels = {k: sum(1 for n in e.nodes if n.kernel) for k, e in result.manifest.entries.items()}
    return f"compiled in {time.perf_counter() - t:.1f} s: {kernels} kernels, stages {result.seconds}"


def compile_in_child(onnx_path: Path, art_path: Path, options, switch: tuple[str, str] | None) -> str:
    """compile_one in a pool's process; its error comes back as a RuntimeError with the message (the compiler's own
    errors need not survive the trip back between processes)."""
    try:
        return compile_one(onnx_path, art_path, options, switch)
    except Exception as e:  # noqa: BLE001 - the message is the point
        raise RuntimeError(f"{art_path.name}: {type(e).__name__}: {e}") from None


def bench_atlasc(cfg_name: str, batches: list[int], prompt: int, gen: int, workdir: Path, repeats: int,
                 quants: tuple[str, ...] = ("none",), pdl_ab: bool = False, compile_ab: str = "",
                 jobs: int = 1) -> list[dict]:
    """atlasc's bench rows (each with "engine"); one artifact per quant of `quants` (the ONNX file is built
    once; with more than one, each engine name carries its quant); pdl_ab: each artifact with ATLAS_PDL=0,
    then =1; compile_ab: a codegen switch NAME (artifacts compiled with NAME=0 and NAME=1, e.g.
    ATLAS_PREFETCH) or NAME=a,b,... (one artifact per value, e.g. ATLAS_LINEAR_FT=1,auto). jobs > 1: the artifacts
    are compiled first, up to `jobs` at a time in their own processes (all of them on disk at once; a failed compile
    cancels those not started and stops the bench), then benched one by one; otherwise each is compiled and benched
    before the next. Every artifact but the last is removed after its bench."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from atlasc.artifact import open_artifact
    from atlasc.runtime.bench import bench, rows_as_dicts
    from atlasc.runtime.device import Device
    from atlasc.runtime.gpu import GpuModel

    onnx_path = workdir / f"{cfg_name}.onnx"
    t = time.perf_counter()
    write(CONFIGS[cfg_name], onnx_path)
    print(f"[atlasc] built {onnx_path.name} in {time.perf_counter() - t:.1f} s", flush=True)
    dev = Device()
    rows = []
    switch_name, _, values = compile_ab.partition("=")
    switches = (values.split(",") if values else ("0", "1")) if compile_ab else ("",)
    runs = []  # (label, artifact, compile options, switch)
    for quant in quants:
        for switch in switches:
            label = (f" {quant}" if len(quants) > 1 else "") + (f" {switch_name}={switch}" if compile_ab else "")
            runs.append((label, workdir / f"{cfg_name}{label.replace(' ', '-').replace('=', '')}.atlas",
                         compile_options(dev.arch, batches, prompt, gen, quant),
                         (switch_name, switch) if compile_ab else None))
    parallel = jobs > 1 and len(runs) > 1
    if parallel:  # spawn: the children start without this process's CUDA context
        with ProcessPoolExecutor(min(jobs, len(runs)), mp_context=get_context("spawn")) as pool:
            done = [pool.submit(compile_in_child, onnx_path, art, options, switch) for _, art, options, switch in runs]
            try:
                for (label, *_), future in zip(runs, done):
                    print(f"[atlasc{label}] {future.result()}", flush=True)
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise
    for i, (label, art_path, options, switch) in enumerate(runs):
        if not parallel:
            print(f"[atlasc{label}] {compile_one(onnx_path, art_path, options, switch)}", flush=True)
        elif switch:  # set here too, as in the child that compiled it (a switch the loader also reads)
            os.environ[switch[0]] = switch[1]
        # the runtime's default (programmatic edges on sm90+, or ATLAS_PDL as set); pdl_ab: plain, then programmatic
        for pdl in ("0", "1") if pdl_ab else (None,):
            if pdl is not None:
                os.environ["ATLAS_PDL"] = pdl  # read by GpuModel at load
            model = GpuModel(open_artifact(art_path), device=dev)
            measured = rows_as_dicts(bench(model, batches, prompt, gen, repeats))
            # the driver may refuse programmatic edges at the first capture: then the graphs are plain ones
            engine = ("atlasc" if pdl is None else ("atlasc+pdl" if model.pdl else "atlasc plain")) + label
            if model.pdl_error:
                print(f"[atlasc] programmatic edges refused, plain graphs: {model.pdl_error}", flush=True)
            rows += [{"engine": engine, **r} for r in measured]
            for r in measured:  # as measured: a later artifact's failure keeps these
                print(f"[{engine}] {r}", flush=True)
            model.close()
        if i < len(runs) - 1:  # the last is kept for `atlasc profile`; two 8B artifacts + the model fill 64 GB disks
            art_path.unlink()
    return rows


def bench_torch(cfg_name: str, batches: list[int], prompt: int, gen: int, repeats: int) -> list[dict]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    c = CONFIGS[cfg_name]
    config = LlamaConfig(hidden_size=c.hidden, intermediate_size=c.intermediate, num_hidden_layers=c.layers,
                         num_attention_heads=c.heads, num_key_value_heads=c.kv_heads, vocab_size=c.vocab,
                         max_position_embeddings=prompt + gen + 8, rope_theta=c.rope_theta, rms_norm_eps=c.eps)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.float16).eval()
    rows = []
    for mode in ("eager", "static cache"):
        for b in batches:
            ids = torch.randint(1, c.vocab, (b, prompt), device="cuda")
            mask = torch.ones_like(ids)
            kwargs = {"max_new_tokens": gen, "min_new_tokens": gen, "do_sample": False, "pad_token_id": 0}
            if mode == "static cache":
                kwargs["cache_implementation"] = "static"
            with torch.no_grad():
                model.generate(ids, attention_mask=mask, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
                prefills, totals = [], []
                for _ in range(repeats):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    model(ids, attention_mask=mask)
                    torch.cuda.synchronize()
                    prefills.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    model.generate(ids, attention_mask=mask, **kwargs)
                    torch.cuda.synchronize()
                    totals.append(time.perf_counter() - t0)
            prefill = statistics.median(prefills)
            step = (statistics.median(totals) - prefill) / max(gen - 1, 1)
            rows.append({"mode": mode, "batch": b, "prefill_ms": round(prefill * 1e3, 3),
                         "decode_ms_per_step": round(step * 1e3, 4), "tokens_per_s": round(b / step, 1),
                         "peak_device_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)})
            print(f"[torch] {mode} batch {b}: {rows[-1]}", flush=True)
    del model
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-3.2-1b", choices=sorted(CONFIGS))
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--quant", default="none",
                    help="compile atlasc's artifact with --quant: none, int8, int4 or fp8, or several comma-separated "
                         "(one artifact each, one ONNX build; the peers stay fp16)")
    ap.add_argument("--compile-ab", default="", metavar="ATLAS_SWITCH[=A,B]",
                    help="compile atlasc's artifact once per value of this environment switch (0 then 1, or the "
                         "values given, e.g. ATLAS_LINEAR_FT=1,auto) and bench each")
    ap.add_argument("--compile-jobs", type=int, default=1, metavar="N",
                    help="with several artifacts (--quant a,b or --compile-ab): compile up to N at once in their own "
                         "processes before benching any (all of them on disk together; default 1: one at a time)")
    ap.add_argument("--pdl-ab", action="store_true",
                    help="bench atlasc's artifact twice: ATLAS_PDL=0 (plain CUDA graphs), then ATLAS_PDL=1")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="keep the ONNX file and the artifact (CONFIG.onnx, CONFIG.atlas) here, e.g. for `atlasc "
                         "profile` afterwards (default: a temporary folder, removed)")
    ap.add_argument("--json", type=Path, help="also write every row here")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    from atlasc.passes.quantize import MODES

    quants = tuple(args.quant.split(","))
    if bad := [q for q in quants if q not in MODES]:
        ap.error(f"--quant: unknown {', '.join(bad)} ({', '.join(MODES)})")
    if args.compile_jobs < 1:
        ap.error(f"--compile-jobs: {args.compile_jobs} is not a positive count")
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        ours = bench_atlasc(args.config, batches, args.prompt, args.gen, args.workdir, args.repeats, quants,
                            args.pdl_ab, args.compile_ab, args.compile_jobs)
    else:
        with tempfile.TemporaryDirectory(prefix="atlasc-bench-") as tmp:
            ours = bench_atlasc(args.config, batches, args.prompt, args.gen, Path(tmp), args.repeats, quants,
                                args.pdl_ab, args.compile_ab, args.compile_jobs)
    peers = [] if args.skip_torch else bench_torch(args.config, batches, args.prompt, args.gen, args.repeats)
    precision = "fp16" if quants == ("none",) else f"atlasc {args.quant} (weights), peers fp16"
    print(f"\n{args.config}, {precision}, prompt {args.prompt}, {args.gen} new tokens (medians of {args.repeats})")
    print(f"{'engine':<30} {'batch':>5} {'prefill ms':>10} {'ms/step':>9} {'tokens/s':>10} {'roofline':>9} "
          f"{'GiB':>6} {'vs atlasc':>9}")
    by_batch = {r["batch"]: r for r in ours if r["engine"] == ours[0]["engine"]}
    for r in ours:
        ratio = r["tokens_per_s"] / by_batch[r["batch"]]["tokens_per_s"]
        print(f"{r['engine']:<30} {r['batch']:>5} {r['prefill_ms']:>10.2f} {r['decode_ms_per_step']:>9.3f} "
              f"{r['tokens_per_s']:>10.1f} {r['roofline_pct']:>8.1f}% {r['peak_device_gib']:>6.2f} {ratio:>8.2f}x")
    for r in peers:
        ratio = by_batch[r["batch"]]["tokens_per_s"] / r["tokens_per_s"]
        print(f"{'transformers ' + r['mode']:<30} {r['batch']:>5} {r['prefill_ms']:>10.2f} "
              f"{r['decode_ms_per_step']:>9.3f} {r['tokens_per_s']:>10.1f} {'':>9} {r['peak_device_gib']:>6.2f} "
              f"{ratio:>8.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"atlasc": ours, "transformers": peers}, indent=1))


if __name__ == "__main__":
    main()
