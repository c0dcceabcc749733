"""The accuracy report of a quantized compile: the quantized decoder against its float self.

On calibration prompts (token ids; random ones when none are given) the prefill entry runs twice on
the reference interpreter: as compiled, and with every quantized linear layer restored to its float
weight. Reported: end-to-end KL divergence of the next-token distributions (float || quantized, mean
over every position), top-1 agreement over every position, and per layer the relative error
||x W^T - x Wq^T|| / ||x W^T|| on the activations x that layer actually sees on those prompts.

When decode projections take int8 activations (choose-decode-path: act = "int8", or "int8@1" for a step
of one row, which the report then runs prompt by prompt), whose error the prefill does not see,
`decode_act_int8` adds one decode step per prompt (its last token) on the quantized prefill's KV cache of the
tokens before it (the compile reuses the caches of the prefill above):
KL divergence and top-1 agreement of that step's logits against the same step with float activations (the
W4A16 / W8A16 decode on the same cache).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from atlasc.ir.calibration import check_token_ids, read_npz, token_ids
from atlasc.ir.graph import Graph, Node, Value, constant
from atlasc.ir.interpreter import interpret
from atlasc.ir.ops.linear import REF_THREADS
from atlasc.ir.ops.quant import dequant, q4_zero
from atlasc.ir.program import Program

QUANTIZED = ("LinearQ8", "LinearQ4", "LinearF8")


def load_calibration(path, vocab: int, max_seq: int) -> np.ndarray:
    """Token ids [prompts, length] from an .npz (key `input_ids`, or its only array); UsageError otherwise."""
    return check_token_ids(token_ids(path, read_npz(path)), vocab, max_seq)


def random_prompts(vocab: int, prompts: int = 2, length: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(prompts, length)).astype(np.int64)


RANDOM_TOKENS = 32  # tokens of the default (random) calibration prompts


def default_prompts(vocab: int, max_batch: int, max_seq: int) -> np.ndarray:
    """The calibration prompts when --calib is absent: RANDOM_TOKENS random tokens as 2 prompts of 16, or as
    one prompt of 32 when --max-batch is 1 (seed 0; at most max_seq tokens each). The report runs the
    prompts max_batch at a time, every chunk reading all the weights twice, so two prompts at --max-batch 1
    doubled its cost (Llama-3.2-1B, 2 cores: 26.0 s against 14.9 s at --max-batch 2, docs/perf.md v11)."""
    prompts = 2 if max_batch >= 2 else 1
    return random_prompts(vocab, prompts=prompts, length=min(RANDOM_TOKENS // prompts, max_seq))


def _float_twin(graph: Graph, float_weights: dict) -> tuple[Graph, list[tuple[str, Value]]]:
    """A copy of graph with quantized layers back in float, returning each layer's input as an output.
    A merged layer (its float weights a tuple of parts) becomes one float Linear per part and a Concat,
    so the twin reads the original weights instead of a concatenated copy."""
    twin = graph.clone("float")
    probes = []  # (node name, its input x, its output x W^T + bias in the twin)
    nodes = []
    for node in twin.nodes:
        if node.op not in QUANTIZED or node.name not in float_weights:
            nodes.append(node)
            continue
        x = node.inputs[0]
        bias = node.inputs[3] if len(node.inputs) > 3 else None
        weights = float_weights[node.name]
        y = node.outputs[0]
        for v in (x, y):
            if all(o is not v for o in twin.outputs):
                twin.outputs.append(v)
        probes.append((node.name, x, y))
        if not isinstance(weights, tuple):
            node.op, node.attrs = "Linear", {}
            node.inputs = [x, weights] + ([bias] if bias is not None else [])
            nodes.append(node)
            continue
        outs, offset = [], 0
        for i, (_, w) in enumerate(weights):
            n = int(w.shape[0])
            out = Value(f"{y.name}__float{i}", y.dtype, tuple(y.shape[:-1]) + (n,))
            ins = [x, w] + ([constant(f"{bias.name}__float{i}", bias.data[offset:offset + n])] if bias else [])
            nodes.append(Node("Linear", ins, [out], name=f"{node.name}__float{i}"))
            outs.append(out)
            offset += n
        nodes.append(Node("Concat", outs, [y], {"axis": -1}, name=f"{node.name}__float_concat"))
    twin.nodes = nodes
    return twin, probes


BLOCK_ELEMENTS = 1 << 24  # weight elements per block of the per-layer error (float32: 64 MiB)


def _weight_blocks(program: Program, name: str, node):
    """(layer, first row, last row + 1, dequantized rows) of a quantized node: functions returning float32
    [rows, K] blocks along N, so a 1 GB LM head is never dequantized whole; a merged node's parts come in
    order under their own layer names (the quantize report's), rows counted over the merged weight."""
    w = program.float_weights[name]
    parts = w if isinstance(w, tuple) else ((name, w),)
    wq, scale = node.inputs[1].data, node.inputs[2].data
    zero_v = q4_zero(node)
    zero = None if zero_v is None else zero_v.data
    group = node.attrs.get("group_size", 128)
    offset, blocks = 0, []
    for layer, part in parts:
        n, k = part.shape
        step = max(1, BLOCK_ELEMENTS // max(1, k))
        for r0 in range(offset, offset + n, step):
            r1 = min(offset + n, r0 + step)

            def make(r0=r0, r1=r1):
                return dequant(node.op, wq[r0:r1], scale[r0:r1], group, None if zero is None else zero[r0:r1])

            blocks.append((layer, r0, r1, make))
        offset += n
    return blocks


def _block_error(xs: np.ndarray, y: np.ndarray, make) -> tuple[float, float]:
    """(sum of (y - x Wq^T)^2, sum of y^2) over one block of a layer's rows, y = x W^T (the float twin's)."""
    return (float(np.sum(np.square(y - xs @ make().T, dtype=np.float64))),
            float(np.sum(np.square(y, dtype=np.float64))))


def _feeds(graph: Graph, ids: np.ndarray, past: int = 0) -> dict[str, np.ndarray]:
    """Feeds of ids [batch, seq] at positions past .. past + seq - 1, every key (cached ones too) unmasked."""
    b, s = ids.shape
    feeds = {}
    for v in graph.inputs:
        if v.name == "sample_params":
            feeds[v.name] = np.array([0, 1, 0], np.float32)
        elif v.name == "sample_state":
            feeds[v.name] = np.zeros(3, np.int64)
        elif v.name == "attention_mask":
            feeds[v.name] = np.ones((b, past + s), np.int64)
        elif v.name == "position_ids":
            feeds[v.name] = np.tile(np.arange(past, past + s, dtype=np.int64), (b, 1))
        else:
            feeds[v.name] = ids
    return feeds


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def _cache_rows(cache: np.ndarray, first: int, n: int, positions: int) -> np.ndarray:
    """A fresh cache of cache's shape [layers, 2, max_batch, kv_heads, max_seq, head_dim] whose batch rows 0..n-1 hold
    cache's rows first..first+n-1 at positions 0..positions-1, zero elsewhere. Only those bytes are written, so a
    large cache (Llama-3-8B at --max-batch 8 --max-seq 2048: 2.1 GB) commits only the pages they fill (np.zeros
    maps the rest lazily), where a copy of the whole array would commit all of it."""
    out = np.zeros(cache.shape, cache.dtype)  # calloc: pages mapped lazily (zeros_like would write them all)
    out[:, :, :n, :, :positions] = cache[:, :, first:first + n, :, :positions]
    return out


def decode_act_report(program: Program, ids: np.ndarray, caches: list[np.ndarray] | None = None,
                      progress=None) -> dict:
    """The int8-activation decode step against the same step with float activations (see the module
    docstring); {} when no decode node has act = "int8". `caches`: accuracy_report's quantized prefill caches of
    the same ids (one per max_batch prompts), which hold every position a step reads (the step rewrites its own,
    the last): given, no prefill runs here. progress("accuracy", detail, (prompts done, prompts)) before each
    step."""
    marked = [name for name in ("decode_small", "decode") if name in program.entries and
              any(n.attrs.get("act", "").startswith("int8") for n in program.entries[name].nodes)]
    if not marked or ids.shape[1] < 2:
        return {}
    name = marked[0]
    graph = program.entries[name]
    twin = graph.clone(f"{name}_float_act")
    for node in twin.nodes:
        if node.attrs.get("act", "").startswith("int8"):
            node.attrs["act"] = ""
    kv, past, batch = program.kv_cache, program.roles["past"], program.roles["batch"]
    rows = min(kv.max_batch, program.bounds[name].get(batch, kv.max_batch))
    if any(n.attrs.get("act") == "int8@1" for n in graph.nodes):
        rows = 1  # "int8@1": int8 activations only in a decode step of one row
    prefill = program.entries["prefill"]
    length = ids.shape[1]
    logits_name = graph.outputs[0].name
    say = progress or (lambda stage, detail, done=None: None)
    kl, agree, count = 0.0, 0, 0
    for start in range(0, ids.shape[0], kv.max_batch):  # one prefill per max_batch prompts
        chunk = ids[start:start + kv.max_batch]
        if caches is not None:
            state = {"kv_cache": caches[start // kv.max_batch]}
        else:
            say("accuracy", f"{_prompts(start, len(chunk), ids)}: quantized prefill", (start, ids.shape[0]))
            state = {"kv_cache": np.zeros(kv.shape, np.dtype(kv.dtype))}
            interpret(prefill, _feeds(prefill, chunk[:, :-1]), state=state, symbols={past: 0})
        for first in range(0, chunk.shape[0], rows):  # then decode steps of `rows` prompts
            n = min(rows, chunk.shape[0] - first)
            say("accuracy", f"{_prompts(start + first, n, ids)}: decode step, int8 vs float activations",
                (start + first, ids.shape[0]))
            feeds = _feeds(graph, chunk[first:first + n, -1:], length - 1)
            outs = []
            for g in (graph, twin):
                step = {"kv_cache": _cache_rows(state["kv_cache"], first, n, length - 1)}
                outs.append(interpret(g, feeds, state=step, symbols={past: length - 1})[logits_name])
            q, p = (_softmax(o.astype(np.float64).reshape(-1, o.shape[-1])) for o in outs)
            kl += float(np.sum(p * (np.log(p + 1e-300) - np.log(q + 1e-300))))
            agree += int(np.sum(p.argmax(-1) == q.argmax(-1)))
            count += p.shape[0]
    return {"entry": name, "steps": count, "kl_divergence": kl / max(count, 1), "top1_agreement": agree / max(count, 1)}


def _prompts(first: int, n: int, ids: np.ndarray) -> str:
    """"prompts 3-4 of 8" (or "prompt 3 of 8"): which calibration prompts a step of the report runs."""
    span = f"prompt {first + 1}" if n == 1 else f"prompts {first + 1}-{first + n}"
    return f"{span} of {ids.shape[0]}"


def accuracy_report(program: Program, ids: np.ndarray, caches: list[np.ndarray] | None = None,
                    progress=None) -> dict:
    """KL, top-1 agreement and per-layer errors of the quantized prefill against its float twin. `caches`: a list
    that receives the quantized prefill's KV cache of each max_batch prompts (for decode_act_report).
    progress("accuracy", detail, (steps done, steps)) before each prefill and after each block of a layer's
    error, naming the prompts and the layer."""
    if program.kind != "decoder" or "prefill" not in program.entries:
        return {}
    graph = program.entries["prefill"]
    twin, probes = _float_twin(graph, program.float_weights)
    kv = program.kv_cache
    logits_name = graph.outputs[0].name
    kl, agree, count = 0.0, 0, 0
    sums: dict[str, list[float]] = {}  # per layer of the quantize report (a merged node's parts apart)
    quantized_nodes = {n.name: n for n in graph.nodes if n.op in QUANTIZED}
    say = progress or (lambda stage, detail, done=None: None)
    blocks = {name: _weight_blocks(program, name, quantized_nodes[name]) for name, _, _ in probes}
    # progress steps: per max_batch prompts, two prefills and one per block of the layers' errors
    per_chunk = 2 + sum(map(len, blocks.values()))
    steps = -(-ids.shape[0] // kv.max_batch) * per_chunk
    for start in range(0, ids.shape[0], kv.max_batch):
        chunk = ids[start:start + kv.max_batch]
        which, step = _prompts(start, len(chunk), ids), start // kv.max_batch * per_chunk
        symbols = {program.roles["past"]: 0}
        feeds = _feeds(graph, chunk)
        say("accuracy", f"{which}: quantized prefill", (step, steps))
        q_state = {"kv_cache": np.zeros(kv.shape, np.dtype(kv.dtype))}
        q_out = interpret(graph, feeds, state=q_state, symbols=symbols)
        if caches is not None:
            caches.append(q_state["kv_cache"])
        say("accuracy", f"{which}: float prefill", (step + 1, steps))
        f_out = interpret(twin, feeds, state={"kv_cache": np.zeros(kv.shape, np.dtype(kv.dtype))}, symbols=symbols)
        p = _softmax(f_out[logits_name].astype(np.float64))
        q = _softmax(q_out[logits_name].astype(np.float64))
        kl += float(np.sum(p * (np.log(p + 1e-300) - np.log(q + 1e-300))))
        agree += int(np.sum(p.argmax(-1) == q.argmax(-1)))
        count += int(np.prod(p.shape[:-1]))
        # a block of output rows at a time, REF_THREADS blocks at once (the dequantization dominates);
        # summed in block order, so the report does not depend on the threads. x W^T is the twin's output
        # (minus the bias), in the model's dtype: the float weights are not read a second time
        jobs = []
        for name, x, y in probes:
            node = quantized_nodes[name]
            xs = f_out[x.name].astype(np.float32).reshape(-1, x.shape[-1])
            ys = f_out[y.name].astype(np.float32).reshape(-1, y.shape[-1])
            if len(node.inputs) > 3 and node.inputs[3] is not None:
                ys = ys - np.asarray(node.inputs[3].data, np.float32)
            jobs += [(layer, xs, ys[:, r0:r1], make) for layer, r0, r1, make in blocks[name]]
        with ThreadPoolExecutor(REF_THREADS) as pool:
            errors = []
            for job, error in zip(jobs, pool.map(lambda job: _block_error(job[1], job[2], job[3]), jobs)):
                errors.append(error)
                say("accuracy", f"{which}: error of {job[0]}", (step + 2 + len(errors), steps))
        for (layer, _, _, _), (err, ref) in zip(jobs, errors):
            acc = sums.setdefault(layer, [0.0, 0.0])
            acc[0] += err
            acc[1] += ref
    layers = {name: (float(np.sqrt(a / b)) if b > 0 else 0.0) for name, (a, b) in sums.items()}
    return {"prompts": int(ids.shape[0]), "tokens_per_prompt": int(ids.shape[1]),
            "kl_divergence": kl / max(count, 1), "top1_agreement": agree / max(count, 1),
            "layer_rel_error_on_calibration": layers,
            "max_layer_rel_error_on_calibration": max(layers.values(), default=0.0)}

