"""`atlasc inspect X.atlas` and `atlasc run X.atlas`: describing and executing artifacts."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.table import Table
from rich.text import Text

from atlasc.cli import _bytes, _out, _quant_title, write_npz
from atlasc.errors import UsageError
from atlasc.artifact.writer import CUBIN_RE


# codegen choices away from their defaults (ATLAS_* switches): inspect names the ones an artifact was built with
OPT_INS = (("linear_ft", "auto", "ATLAS_LINEAR_FT"), ("linear_ksplit", "auto", "ATLAS_LINEAR_KSPLIT"),
           ("quant_ksplit", "auto", "ATLAS_QUANT_KSPLIT"), ("quant_ofs", "auto", "ATLAS_QUANT_OFS"),
           ("quant_min_blocks", 0, "ATLAS_QUANT_MIN_BLOCKS"), ("quant_staged_u", 0, "ATLAS_QUANT_STAGED_U"),
           ("prologue_act8_grid", 0, "ATLAS_PROLOGUE_ACT8_GRID"),
           ("weight_prefetch", False, "ATLAS_PREFETCH"),
           ("linear_prefill", "auto", "ATLAS_LINEAR_PREFILL"), ("attention_prefill", "fa2", "ATLAS_ATTENTION_PREFILL"),
           ("attention_split_min_keys", 256, "ATLAS_ATTENTION_SPLIT_MIN_KEYS"),
           ("attention_split_target", "auto", "ATLAS_ATTENTION_SPLIT_TARGET"),
           ("attention_v_prefetch", True, "ATLAS_ATTENTION_VPREFETCH"), ("attention_mma", True, "ATLAS_ATTENTION_MMA"),
           ("attention_early_kv", False, "ATLAS_ATTENTION_EARLY_KV"), ("norm_vec", True, "ATLAS_NORM_VEC"),
           ("norm_loads_ahead", False, "ATLAS_NORM_LOADS_AHEAD"),
           ("attention_warps", "auto", "ATLAS_ATTENTION_WARPS"),
           ("attention_warp_merge", True, "ATLAS_ATTENTION_WARP_MERGE"), ("share_kernels", True, "ATLAS_SHARE_KERNELS"),
           ("early_weights", "2", "ATLAS_EARLY_WEIGHTS"), ("early_quant", False, "ATLAS_EARLY_QUANT"),
           ("sample_split", True, "ATLAS_SAMPLE_SPLIT"), ("linear_tma", True, "ATLAS_LINEAR_TMA"),
           ("dims_early", True, "ATLAS_DIMS_EARLY"), ("int8_l2_hint", True, "ATLAS_INT8_L2_HINT"),
           ("quant_bulk", "auto", "ATLAS_QUANT_BULK"))


def _bulk_settings() -> tuple:
    """The copy-engine quantized path's settings (codegen/quant_bulk.py) with their defaults: inspect names them only
    where the path was on."""
    from atlasc.codegen.quant_bulk import CONFIG, INFLIGHT, MIN_RUN

    return (("quant_bulk_config", list(CONFIG), "ATLAS_QUANT_BULK_CONFIG"),
            ("quant_bulk_ks", "auto", "ATLAS_QUANT_BULK_KS"), ("quant_bulk_min_n", 0, "ATLAS_QUANT_BULK_MIN_N"),
            ("quant_bulk_min_run", MIN_RUN, "ATLAS_QUANT_BULK_MIN_RUN"),
            ("quant_bulk_early", True, "ATLAS_QUANT_BULK_EARLY"),
            ("quant_bulk_inflight", INFLIGHT, "ATLAS_QUANT_BULK_INFLIGHT"),
            ("quant_bulk_hold", True, "ATLAS_QUANT_BULK_HOLD"), ("quant_bulk_loop", "auto", "ATLAS_QUANT_BULK_LOOP"),
            ("quant_bulk_g_early", False, "ATLAS_QUANT_BULK_G_EARLY"),
            ("quant_bulk_chain", False, "ATLAS_QUANT_BULK_CHAIN"))


def _opt_ins(choices: dict) -> str:
    """'ATLAS_X=value, ...' for the opt-in codegen choices in `choices` that differ from their default, each as the
    variable's value would set it (a switch 0 / 1, a configuration W-S-B); where the copy-engine path served a
    kernel (ATLAS_QUANT_BULK=1, or a kernel choice with path "bulk" or "bulk-chain"), also its settings away from their
    defaults."""

    def text(value) -> str:
        if isinstance(value, bool):
            return str(int(value))
        return "-".join(str(v) for v in value) if isinstance(value, list) else str(value)

    # ATLAS_QUANT_BULK: a switch in artifacts before v49 (False, the default then: the path off), a mode since
    # ("auto" the default); its settings are named where the path served a kernel
    raw = choices.get("quant_bulk", "auto")
    choices = {**choices, "quant_bulk": "1" if raw is True else "auto" if raw is False else raw}
    served = raw is True or raw == "1" or any(isinstance(c, dict) and c.get("path") in ("bulk", "bulk-chain")
                                              for c in choices.get("kernels", {}).values())
    table = OPT_INS + (_bulk_settings() if served else ())
    return ", ".join(f"{env}={text(choices[key])}" for key, default, env in table
                     if key in choices and choices[key] != default)


def _dims(shape_json) -> str:
    from atlasc.ir import symbolic as S

    return "[" + ", ".join(str(S.from_json(d)) for d in shape_json) + "]"


def inspect_artifact(path: Path, as_json: bool) -> None:
    """Entry points, kernels per arch, the memory plan and member checksums of an artifact."""
    from atlasc.artifact import open_artifact

    with open_artifact(path) as art:
        m = art.manifest
        if as_json:
            report = {
                "artifact": str(path), "format_version": m.format_version, "atlasc_version": m.atlasc_version,
                "source": {"name": m.source.name, "sha256": m.source.sha256}, "archs": list(m.archs),
                "options": m.options,
                "entries": {k: {"inputs": [i.name for i in e.inputs], "outputs": [o.name for o in e.outputs],
                                "launches": sum(1 for n in e.nodes if n.kernel), "bindings": e.bindings,
                                "narrows": e.narrows or None, "narrow_upper": e.narrow_upper or None}
                            for k, e in m.entries.items()},
                "kernels": len(m.kernels()),  # distinct kernels in each arch's cubins
                "memory": {"arena_bytes": m.memory.arena_bytes,
                           "regions": {k: {"offset": r.offset, "nbytes": r.nbytes}
                                       for k, r in m.memory.regions.items()},
                           "activation_peak": m.memory.activation_peak,
                           "activation_naive": m.memory.activation_naive},
                "kv_cache": None if m.kv_cache is None else {
                    "layers": m.kv_cache.layers, "kv_heads": m.kv_cache.kv_heads, "head_dim": m.kv_cache.head_dim,
                    "max_batch": m.kv_cache.max_batch, "max_seq": m.kv_cache.max_seq, "dtype": m.kv_cache.dtype},
                "members": {k: {"sha256": v.sha256, "size": v.size} for k, v in m.members.items()},
            }
            for key in ("codegen", "quantization", "decode_paths"):
                if key in m.report:
                    report[key] = m.report[key]
            print(json.dumps(report))
            return
        out = _out()
        out.print(Text(str(path), style="bold") + Text(f"  (atlas format {m.format_version}, atlasc "
                                                         f"{m.atlasc_version}, from {m.source.name} "
                                                         f"sha256 {m.source.sha256[:12]}…)"))
        out.print("options: " + ", ".join(f"{k}={v}" for k, v in m.options.items()))
        if "codegen" in m.report:  # artifacts of format 2 on
            c = m.report["codegen"]
            buckets = "; ".join(f"{e} {s} <= {', '.join(map(str, v))}" for e, (s, v) in c["batch_buckets"].items())
            out.print(f"kernel paths: linear={c['linear_path']}, quant={c['quant_path']}, "
                      f"attention={c['attention_path']} (split <= {c['attention_max_split']}); "
                      f"specialized kernels: {buckets or 'none'}")
            opt_ins = _opt_ins(c)
            if opt_ins:
                out.print(f"opt-in kernel choices: {opt_ins}")
        for quant, d in m.report.get("decode_paths", {}).items():  # choose-decode-path's decision
            paths = set(d["paths"].values())
            text = paths.pop() if len(paths) == 1 else ", ".join(f"{b} {p}" for b, p in d["paths"].items())
            out.print(f"decode path {quant}: {text} ({d['source']})")
        entries = Table(title="entry points", title_justify="left", show_edge=False)
        for col in ("entry", "inputs", "outputs", "launches", "fixed"):
            entries.add_column(col)
        for name, e in m.entries.items():
            label = name
            if e.narrows:  # split-decode's twin: runs the calls of `narrows` within these bounds
                label += f"\n(runs {e.narrows} for " + ", ".join(f"{k} <= {v}" for k, v in e.narrow_upper.items()) + ")"
            entries.add_row(label, "\n".join(f"{i.name} {i.dtype}{_dims(i.shape)}" for i in e.inputs),
                            "\n".join(f"{o.name} {o.dtype}{_dims(o.shape)}" for o in e.outputs),
                            str(sum(1 for n in e.nodes if n.kernel)),
                            ", ".join(f"{k}={v}" for k, v in e.bindings.items()) or "-")
        out.print(entries)
        kernels = Table(title="kernels per arch", title_justify="left", show_edge=False)
        for col in ("arch", "cubins", "cubin bytes", "kernels"):
            kernels.add_column(col)
        total = len(m.kernels())  # distinct kernels (a layer's shared ones once, batch variants each)
        for arch in m.archs:
            parts = [spec.size for name, spec in m.members.items()
                     if (c := CUBIN_RE.fullmatch(name)) and c.group(1) == arch]
            kernels.add_row(arch, str(len(parts)), str(sum(parts)), str(total))
        out.print(kernels)
        mem = Table(title="memory plan", title_justify="left", show_edge=False)
        for col in ("region", "offset", "bytes"):
            mem.add_column(col, justify="left" if col == "region" else "right")
        for name, r in m.memory.regions.items():
            mem.add_row(name, str(r.offset), _bytes(r.nbytes))
        mem.add_row("arena", "", _bytes(m.memory.arena_bytes))
        mem.add_row("activations: planned peak / naive sum", "",
                    f"{_bytes(m.memory.activation_peak)} / {_bytes(m.memory.activation_naive)}")
        out.print(mem)
        if m.kv_cache is not None:
            kv = m.kv_cache
            out.print(f"kv cache: [{kv.layers}, 2, {kv.max_batch}, {kv.kv_heads}, {kv.max_seq}, {kv.head_dim}] "
                      f"{kv.dtype}")
        _print_quantization(out, m.report.get("quantization"))
        sums = Table(title="members (sha256 verified)", title_justify="left", show_edge=False)
        for col in ("member", "bytes", "sha256"):
            sums.add_column(col)
        for name, spec in m.members.items():
            sums.add_row(name, str(spec.size), spec.sha256)
        out.print(sums)


def _print_quantization(out, q: dict | None) -> None:
    if not q:
        return
    title = _quant_title(q)
    table = Table(title=f"{title}: weights {_bytes(q['bytes_before'])} -> {_bytes(q['bytes_after'])}",
                  title_justify="left", show_edge=False)
    acc = q.get("accuracy") or {}
    on_calib = acc.get("layer_rel_error_on_calibration", {})
    for col in ("layer", "shape", "rel error", "on calibration", "bytes before", "bytes after"):
        table.add_column(col, justify="left" if col == "layer" else "right")
    if acc:
        out.print(f"quantized vs float on {acc['prompts']} x {acc['tokens_per_prompt']} calibration tokens "
                  f"({acc['calibration']}): logits KL {acc['kl_divergence']:.3g}, top-1 agreement "
                  f"{100 * acc['top1_agreement']:.1f}%")
        act = acc.get("decode_act_int8")
        if act:
            out.print(f"int8 activations at decode ({act['entry']}) vs float activations, {act['steps']} steps: "
                      f"logits KL {act['kl_divergence']:.3g}, top-1 agreement {100 * act['top1_agreement']:.1f}%")
    for r in q["layers"]:
        calib = on_calib.get(r["layer"])
        table.add_row(r["layer"], "x".join(map(str, r["shape"])), f"{r['rel_error']:.4f}",
                      "-" if calib is None else f"{calib:.4f}", _bytes(r["bytes_before"]), _bytes(r["bytes_after"]))
    out.print(table)
    for where, why in q.get("declined", {}).items():
        out.print(f"  kept in float: {where} ({why})")


def _ints(text: str, what: str) -> list[int]:
    """'1, 2,3' -> [1, 2, 3]; UsageError for an empty item ('1,,3', '1,') or one that is not an integer."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"{what} must be comma-separated integers, no empty items: {text!r}") from None


def parse_ids(text: str) -> list[list[int]]:
    """'1,2,3' -> [[1,2,3]]; '1,2;4,5,6' -> two prompts."""
    prompts = []
    for part in text.split(";"):
        if not part.strip():
            raise UsageError(f"--prompt-ids has an empty prompt (';' separates prompts): {text!r}")
        prompts.append(_ints(part, "--prompt-ids (';' between prompts)"))
    return prompts


def run_artifact(path: Path, *, device: str, inputs: dict | None, prompt_ids: str | None, max_new_tokens: int,
                 out_path: Path | None, entry: str | None, quiet: bool, as_json: bool, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop: str | None = None,
                 cuda_graphs: bool = True) -> None:
    """Execute an artifact: generation for decoders (--prompt-ids), one entry on --inputs otherwise."""
    from atlasc.artifact import open_artifact

    with open_artifact(path) as art:
        model = _load_model(art, device, cuda_graphs)
        m = art.manifest
        if prompt_ids is not None:
            from atlasc.runtime.generate import Sampling, generate

            prompts = parse_ids(prompt_ids)
            stops = _ints(stop, "--stop (token ids)") if stop else []
            stream = not as_json and not quiet and len(prompts) == 1

            def on_token(step: int, ids: list[int]) -> None:
                print(ids[0], end=" ", flush=True)

            t0 = time.perf_counter()
            result = generate(model, prompts, max_new_tokens, sampling=Sampling(temperature, top_k, top_p, seed),
                              stop_tokens=stops, on_token=on_token if stream else None)
            elapsed = time.perf_counter() - t0
            timing = result.timing()
            if as_json:
                print(json.dumps({"tokens": result.tokens,  # one list per prompt, a single prompt too
                                  "device": device, "seconds": round(elapsed, 4), **timing}))
                return
            if not quiet:
                out = _out()
                if stream:
                    print()
                else:
                    for p, toks in zip(prompts, result.tokens):
                        out.print(" ".join(str(t) for t in p) + " | " + " ".join(str(t) for t in toks))
                out.print(f"prefill {timing['prefill_ms']:.2f} ms, decode {timing['decode_ms_per_step']:.3f} ms/step, "
                          f"{timing['tokens_per_s']:.1f} tokens/s ({device}, batch {len(prompts)})")
            return
        if inputs is None:
            raise UsageError("give --prompt-ids (decoders) or --inputs x.npz")
        entry = entry or ("forward" if "forward" in m.entries else "prefill")
        if entry not in m.entries:
            raise UsageError(f"no entry point '{entry}'", hint="entries: " + ", ".join(m.entries))
        symbols = {}
        past = m.report.get("roles", {}).get("past")
        if past and entry != "forward":
            symbols[past] = 0
        if entry != "forward":
            from atlasc.runtime.generate import Sampling

            inputs = {**Sampling().inputs(0), **inputs}
        results = model.run(entry, inputs, symbols)
        if out_path is not None:
            write_npz(out_path, results)
        if as_json:
            print(json.dumps({"outputs": [{"name": k, "dtype": str(v.dtype), "shape": list(v.shape)}
                                          for k, v in results.items()],
                              "out": str(out_path) if out_path else None}))
        elif not quiet:
            out = _out()
            for k, v in results.items():
                out.print(f"{k}: {v.dtype}{list(v.shape)}")
            if out_path is not None:
                out.print(f"wrote {out_path}")


def _load_model(art, device: str, cuda_graphs: bool = True):
    if device == "cpu":
        from atlasc.runtime.cpu import CpuModel

        return CpuModel(art)
    from atlasc.runtime.gpu import GpuModel

    return GpuModel(art, cuda_graphs=cuda_graphs)
