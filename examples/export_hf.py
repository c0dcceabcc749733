#!/usr/bin/env python
"""Export tiny random-weight Hugging Face transformers to ONNX test fixtures for atlasc.

Usage:
    python examples/export_hf.py                       # every fixture into examples/fixtures
    python examples/export_hf.py --only llama qwen2    # a subset (the manifest is merged, not replaced)
    python examples/export_hf.py --out /tmp/fixtures

What it produces, in --out (default examples/fixtures):
  <name>.onnx          the model, weights inside the file (no external data).
  <name>.<case>.npz    one reference case: `in.<input name>` for every model input and
                       `out.<output name>` for every model output, the outputs computed by
                       onnxruntime (CPU EP, ORT_DISABLE_ALL) on that very .onnx file.
  manifest.json        one entry per fixture: name, arch, kind, exporter, opset, dtype, cases,
                       num_layers, num_kv_heads, head_dim, vocab_size, op_types, inputs, outputs,
                       notes.

No weights are downloaded: every model is built from a tiny `XxxConfig(...)` with weights drawn
under torch.manual_seed(0), so the same config gives the same weights in every fixture (that is how
`llama-opset23` is checked against `llama`).

Decoder interface (the DecoderWrapper below; bind inputs by name, the order differs by exporter):
  inputs   input_ids int64 [batch, seq]
           attention_mask int64 [batch, past_seq + seq]   (1 = real token, 0 = left padding)
           position_ids int64 [batch, seq]                (cumsum(mask) - 1 clipped at 0, numpy side)
           past_key_values.{i}.key / .value [batch, num_kv_heads, past_seq, head_dim]
  outputs  logits [batch, seq, vocab], present.{i}.key / .value [batch, num_kv_heads, past_seq+seq, head_dim]
Encoder interface (EncoderWrapper): inputs input_ids, attention_mask, token_type_ids int64 [batch, seq];
  outputs last_hidden_state [batch, seq, hidden] and sentence_embedding [batch, hidden] (mean pooling
  over the mask, inside the graph).

At the end it prints a table: fixture, case, max |onnxruntime - torch| on that case, op types.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

warnings.filterwarnings("ignore")

from transformers import DynamicCache  # noqa: E402  (after the torch setup above)

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 0

# The tiny shape shared by every decoder (GQA: 4 query heads over 2 kv heads).
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


# ----------------------------------------------------------------------------------------------
# Model builders
# ----------------------------------------------------------------------------------------------


def _build(config_cls, model_cls, attn="sdpa", **kw):
    config = config_cls(**kw)
    config._attn_implementation = attn
    torch.manual_seed(SEED)
    model = model_cls(config).eval()
    # HF initialises norm weights to 1 and biases to 0, which would let a compiler bug that drops
    # them pass unnoticed: perturb them (seeded, so every fixture of one config has the same weights).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or (p.dim() == 1 and bool((p == 1).all())):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(hash_name(name))))
    return model, config


def hash_name(name):
    return sum((i + 1) * ord(c) for i, c in enumerate(name)) % 2**31


def build_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return _build(LlamaConfig, LlamaForCausalLM, **TINY)


def build_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _build(Qwen2Config, Qwen2ForCausalLM, **TINY, tie_word_embeddings=True)


def build_mistral(sliding_window=8):
    from transformers import MistralConfig, MistralForCausalLM

    return _build(MistralConfig, MistralForCausalLM, **TINY, sliding_window=sliding_window)


def build_phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    kw = dict(TINY)
    kw.pop("head_dim")  # Phi3 derives head_dim = hidden / heads = 16
    return _build(
        Phi3Config,
        Phi3ForCausalLM,
        **kw,
        partial_rotary_factor=0.5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def build_gpt2(attn="sdpa"):
    from transformers import GPT2Config, GPT2LMHeadModel

    return _build(
        GPT2Config,
        GPT2LMHeadModel,
        attn=attn,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_inner=128,
        vocab_size=256,
        n_positions=128,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def build_bert():
    from transformers import BertConfig, BertModel

    return _build(
        BertConfig,
        BertModel,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=128,
        type_vocab_size=2,
        hidden_act="gelu",
        add_pooling_layer=False,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def build_minilm():
    # MiniLM-L6 shape (6 layers, hidden 384, 12 heads) shrunk to hidden 64.
    from transformers import BertConfig, BertModel

    return _build(
        BertConfig,
        BertModel,
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=128,
        type_vocab_size=2,
        hidden_act="gelu",
        add_pooling_layer=False,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


# ----------------------------------------------------------------------------------------------
# Wrappers: flat tensors in, flat tensors out
# ----------------------------------------------------------------------------------------------


def kv_names(num_layers, prefix):
    return [f"{prefix}.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


class DecoderWrapper(nn.Module):
    """Runs a *ForCausalLM on flat tensors; the KV cache goes in and out as 2*L flat tensors.

    `input_order` is the list of input names in the order forward() receives them, so every
    exporter style can use its own order while the wrapper binds them by name.
    """

    def __init__(self, model, num_layers, input_order):
        super().__init__()
        self.model = model
        self.num_layers = num_layers
        self.input_order = list(input_order)

    def forward(self, *flat):
        x = dict(zip(self.input_order, flat))
        # A plain DynamicCache (no config): every layer is a full DynamicLayer, so `present` is
        # always past ++ new, also for sliding-window models (the window lives in the mask).
        cache = DynamicCache()
        for i in range(self.num_layers):
            cache.update(x[f"past_key_values.{i}.key"], x[f"past_key_values.{i}.value"], i)
        # transformers 5.x calls the argument `cache` (`past_key_values` is a deprecated alias);
        # the cache is updated in place, so `present` is read back from the same object.
        out = self.model(
            input_ids=x["input_ids"],
            attention_mask=x["attention_mask"],
            position_ids=x["position_ids"],
            cache=cache,
            use_cache=True,
        )
        result = [out.logits]
        for layer in cache.layers:
            result += [layer.keys, layer.values]
        return tuple(result)


class EncoderWrapper(nn.Module):
    """BertModel + mean pooling over the attention mask (the pooling is part of the graph)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):
        hidden = self.model(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return hidden, pooled


# ----------------------------------------------------------------------------------------------
# Fixture table
# ----------------------------------------------------------------------------------------------

DYNAMO_ORDER = ["input_ids", "attention_mask", "position_ids", "@past"]
TORCHSCRIPT_ORDER = ["input_ids", "position_ids", "@past", "attention_mask"]  # deliberately different
OPTIMUM_ORDER = ["input_ids", "attention_mask", "position_ids", "@past"]  # Optimum's order

# Dim names per style (dynamo names come from torch.export.Dim; the mask length is renamed after export).
PLAIN_DIMS = {"batch": "batch", "seq": "seq", "past": "past_seq", "total": "total_seq"}
OPTIMUM_DIMS = {
    "batch": "batch_size",
    "seq": "sequence_length",
    "past": "past_sequence_length",
    "total": "past_sequence_length + 1",
}

DECODER_CASES = ["prefill", "decode", "chunk"]


@dataclass
class Spec:
    name: str
    arch: str
    kind: str  # "decoder" | "encoder"
    exporter: str  # "dynamo" | "dynamo-opset23" | "torchscript" | "optimum-style"
    opset: int | None  # None: the exporter's default (read back from the file)
    build: Callable
    dtype: str = "fp32"
    cases: list = field(default_factory=lambda: list(DECODER_CASES))
    input_order: list = field(default_factory=lambda: list(DYNAMO_ORDER))
    dims: dict = field(default_factory=lambda: dict(PLAIN_DIMS))
    notes: str = ""


SPECS = [
    Spec(
        "llama",
        "llama",
        "decoder",
        "dynamo",
        None,
        build_llama,
        notes="LlamaForCausalLM, GQA 4q/2kv heads, sdpa attention, torch.onnx.export(dynamo=True).",
    ),
    Spec(
        "llama-fp16",
        "llama",
        "decoder",
        "dynamo",
        None,
        build_llama,
        dtype="fp16",
        notes="Same weights as llama, model.half(), exported on CPU in fp16; past/present in fp16.",
    ),
    Spec(
        "llama-opset23",
        "llama",
        "decoder",
        "dynamo-opset23",
        23,
        build_llama,
        notes="Same weights as llama. Exported with dynamo opset 23 with the model patched so the "
        "standard ops appear: RMSNorm forward -> F.rms_norm (RMSNormalization), "
        "apply_rotary_pos_emb -> custom op atlas::rotary translated to RotaryEmbedding "
        "(4D input, cos/sin caches [batch, seq, head_dim/2], no position_ids), sdpa with "
        "enable_gqa -> Attention (q 4 heads, k/v = present with 2 kv heads, bool mask "
        "[batch, 1, seq, total_seq], is_causal=0, scale 0.25). ORT output matches the unpatched "
        "fp32 llama in torch.",
    ),
    Spec(
        "qwen2",
        "qwen2",
        "decoder",
        "torchscript",
        17,
        build_qwen2,
        input_order=TORCHSCRIPT_ORDER,
        notes="Qwen2ForCausalLM, q/k/v bias, tie_word_embeddings=True, TorchScript exporter "
        "(many Constant nodes, no value_info).",
    ),
    Spec(
        "mistral",
        "mistral",
        "decoder",
        "dynamo",
        None,
        build_mistral,
        cases=DECODER_CASES + ["long"],
        notes="MistralForCausalLM with sliding_window=8 in the mask; case `long` (seq 12, past 6) "
        "differs from a no-window run.",
    ),
    Spec(
        "phi3",
        "phi3",
        "decoder",
        "torchscript",
        18,
        build_phi3,
        input_order=TORCHSCRIPT_ORDER,
        notes="Phi3ForCausalLM: fused qkv_proj and gate_up_proj, partial_rotary_factor=0.5 "
        "(rotary on 8 of 16 head dims), TorchScript exporter.",
    ),
    Spec(
        "gpt2",
        "gpt2",
        "decoder",
        "torchscript",
        17,
        build_gpt2,
        input_order=TORCHSCRIPT_ORDER,
        notes="GPT2LMHeadModel: LayerNorm, Conv1D (x @ W + b), tanh GELU, learned positions "
        "(num_kv_heads = num heads, no GQA), TorchScript exporter.",
    ),
    Spec(
        "gpt2-fp16",
        "gpt2",
        "decoder",
        "torchscript",
        17,
        lambda: build_gpt2(attn="eager"),
        dtype="fp16",
        input_order=TORCHSCRIPT_ORDER,
        notes="Same weights as gpt2, model.half(), TorchScript exporter in fp16, eager attention "
        "(the TorchScript sdpa symbolic leaves the fp16 attention output in fp32 and ORT "
        "rejects the graph).",
    ),
    Spec(
        "llama-optimum",
        "llama",
        "decoder",
        "optimum-style",
        17,
        build_llama,
        input_order=OPTIMUM_ORDER,
        dims=dict(OPTIMUM_DIMS),
        notes="Same weights as llama; TorchScript export emulating Optimum: dims batch_size, "
        "sequence_length, past_sequence_length, 'past_sequence_length + 1' (mask and present).",
    ),
    Spec(
        "bert",
        "bert",
        "encoder",
        "torchscript",
        17,
        build_bert,
        cases=["forward"],
        notes="BertModel (no pooler) + mean pooling over the mask, erf GELU, TorchScript exporter.",
    ),
    Spec(
        "minilm",
        "bert",
        "encoder",
        "dynamo",
        None,
        build_minilm,
        cases=["forward"],
        notes="MiniLM-shaped BertModel (6 layers, hidden 64) + mean pooling, dynamo exporter.",
    ),
]


# ----------------------------------------------------------------------------------------------
# Inputs: export examples and reference cases
# ----------------------------------------------------------------------------------------------


def expand_order(order, num_layers):
    names = []
    for n in order:
        names += kv_names(num_layers, "past_key_values") if n == "@past" else [n]
    return names


def position_ids_from_mask(mask, seq):
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    return pos[:, -seq:].astype(np.int64)


def decoder_inputs(rng, config, batch, seq, past, pad_left=None, kv_dtype=np.float32):
    """Named numpy inputs for one decoder call (left padding given per sequence)."""
    num_layers, kv_heads, head_dim, vocab = decoder_dims(config)
    mask = np.ones((batch, past + seq), np.int64)
    for b, n in enumerate(pad_left or []):
        mask[b, :n] = 0
    x = {
        "input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int64),
        "attention_mask": mask,
        "position_ids": position_ids_from_mask(mask, seq),
    }
    for name in kv_names(num_layers, "past_key_values"):
        x[name] = rng.standard_normal((batch, kv_heads, past, head_dim)).astype(kv_dtype)
    return x


def case_inputs(spec, config, case):
    rng = np.random.default_rng(_case_seed(case))
    kv_dtype = np.float16 if spec.dtype == "fp16" else np.float32
    if spec.kind == "encoder":
        assert case == "forward"
        batch, seq = 2, 9
        mask = np.ones((batch, seq), np.int64)
        mask[1, -3:] = 0
        return {
            "input_ids": rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int64),
            "attention_mask": mask,
            "token_type_ids": rng.integers(0, 2, (batch, seq)).astype(np.int64),
        }
    if case == "prefill":
        return decoder_inputs(rng, config, 2, 7, 0, kv_dtype=kv_dtype)
    if case == "decode":
        return decoder_inputs(rng, config, 3, 1, 9, pad_left=[3, 0, 5], kv_dtype=kv_dtype)
    if case == "chunk":
        return decoder_inputs(rng, config, 1, 4, 5, kv_dtype=kv_dtype)
    if case == "long":
        return decoder_inputs(rng, config, 1, 12, 6, kv_dtype=kv_dtype)
    raise ValueError(case)


def _case_seed(case):
    return {"prefill": 1, "decode": 2, "chunk": 3, "long": 4, "forward": 5}[case]


def export_example(spec, config):
    """Example inputs for tracing: shapes differ from every reference case (batch 4, seq 3, past 10)."""
    rng = np.random.default_rng(1234)
    kv_dtype = np.float16 if spec.dtype == "fp16" else np.float32
    if spec.kind == "encoder":
        # A padded mask: with an all-ones mask, HF skips the mask and a trace would freeze that.
        batch, seq = 3, 5
        mask = np.ones((batch, seq), np.int64)
        mask[0, -2:] = 0
        return {
            "input_ids": rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int64),
            "attention_mask": mask,
            "token_type_ids": np.zeros((batch, seq), np.int64),
        }
    return decoder_inputs(rng, config, 4, 3, 10, pad_left=[0, 2, 0, 1], kv_dtype=kv_dtype)


def decoder_dims(config):
    if hasattr(config, "n_layer"):  # gpt2
        return config.n_layer, config.n_head, config.n_embd // config.n_head, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, head_dim, config.vocab_size


# ----------------------------------------------------------------------------------------------
# Exporters (one function per style)
# ----------------------------------------------------------------------------------------------


def make_wrapper(spec, model, config):
    if spec.kind == "encoder":
        return (
            EncoderWrapper(model),
            ["input_ids", "attention_mask", "token_type_ids"],
            ["last_hidden_state", "sentence_embedding"],
        )
    num_layers = decoder_dims(config)[0]
    in_names = expand_order(spec.input_order, num_layers)
    out_names = ["logits"] + kv_names(num_layers, "present")
    return DecoderWrapper(model, num_layers, in_names), in_names, out_names


def axis_names(spec, name):
    """Symbolic axes of one input/output, by name: {axis: dim name}."""
    d = spec.dims
    if spec.kind == "encoder":
        if name == "sentence_embedding":
            return {0: "batch"}
        return {0: "batch", 1: "seq"}
    if name in ("input_ids", "position_ids", "logits"):
        return {0: d["batch"], 1: d["seq"]}
    if name == "attention_mask":
        return {0: d["batch"], 1: d["total"]}
    if name.startswith("past_key_values."):
        return {0: d["batch"], 2: d["past"]}
    if name.startswith("present."):
        return {0: d["batch"], 2: d["total"]}
    raise KeyError(name)


def to_torch(x):
    return tuple(torch.from_numpy(np.ascontiguousarray(v)) for v in x)


def export_torchscript(spec, wrapper, example, in_names, out_names, path):
    args = to_torch(example[n] for n in in_names)
    dynamic_axes = {n: axis_names(spec, n) for n in in_names + out_names}
    with torch.no_grad():
        torch.onnx.export(
            wrapper,
            args,
            path,
            input_names=in_names,
            output_names=out_names,
            dynamic_axes=dynamic_axes,
            opset_version=spec.opset,
            dynamo=False,
            # The TorchScript constant folder computes fp16 weights in fp32 (GPT-2's
            # Conv1D Gemm came out half fp32, half fp16): fold only in fp32.
            do_constant_folding=spec.dtype != "fp16",
        )


def export_dynamo(spec, wrapper, example, in_names, out_names, path, **kw):
    from torch.export import Dim

    args = to_torch(example[n] for n in in_names)
    dims = {}

    def spec_for(name):
        out = {}
        for axis, dn in axis_names(spec, name).items():
            if dn == spec.dims.get("total"):
                out[axis] = Dim.DYNAMIC  # past + seq: let torch.export derive it
            else:
                out[axis] = dims.setdefault(dn, Dim(dn.replace(" ", "_")))
        return out

    if spec.kind == "encoder":
        ds = tuple(spec_for(n) for n in in_names)
    else:
        ds = (tuple(spec_for(n) for n in in_names),)  # forward(*flat): one varargs entry
    with torch.no_grad():
        prog = torch.onnx.export(
            wrapper,
            args,
            input_names=in_names,
            output_names=out_names,
            dynamic_shapes=ds,
            opset_version=spec.opset,
            dynamo=True,
            verbose=False,
            **kw,
        )
    prog.save(path)
    strip_metadata(path)
    rename_leftover_dims(spec, path)


def strip_metadata(path):
    """Drop the per-node stack traces / FX metadata the dynamo exporter stores (half the file size)."""
    model = onnx.load(path)
    for node in model.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    for vi in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output):
        del vi.metadata_props[:]
    onnx.save(model, path)


def rename_leftover_dims(spec, path):
    """torch.export names the derived mask length `s53`; give it the fixture's total-length name."""
    if spec.kind != "decoder":
        return
    model = onnx.load(path)
    mask = next(i for i in model.graph.input if i.name == "attention_mask")
    old = mask.type.tensor_type.shape.dim[1].dim_param
    new = spec.dims["total"]
    if not old or old == new:
        return
    for vi in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param == old or d.dim_param == "past_seq + seq":
                d.dim_param = new
    onnx.save(model, path)


# --- opset 23: RMSNormalization, RotaryEmbedding, Attention ----------------------------------


@torch.library.custom_op("atlas::rotary", mutates_args=())
def _rotary(x: torch.Tensor, cos_half: torch.Tensor, sin_half: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE on x [b, h, s, d] with cos/sin [b, s, d/2] (ONNX RotaryEmbedding semantics)."""
    c, s = cos_half.unsqueeze(1), sin_half.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


@_rotary.register_fake
def _(x, cos_half, sin_half):
    return torch.empty_like(x)


def _rotary_onnx(x, cos_half, sin_half):
    from onnxscript import opset23 as op

    return op.RotaryEmbedding(x, cos_half, sin_half)


def _patched_apply_rotary(q, k, cos, sin, unsqueeze_dim=1):
    half = cos.shape[-1] // 2  # HF cos/sin repeat the frequencies twice: keep the first half
    ch, sh = cos[..., :half], sin[..., :half]
    return _rotary(q, ch, sh), _rotary(k, ch, sh)


def _rms_norm_forward(self, hidden_states):
    return torch.nn.functional.rms_norm(
        hidden_states, (hidden_states.shape[-1],), self.weight, self.variance_epsilon
    )


@contextlib.contextmanager
def opset23_patches():
    """Make the Llama modeling code emit what the opset-23 translations map to the standard ops."""
    from transformers.integrations import sdpa_attention
    from transformers.models.llama import modeling_llama as ml

    saved = ml.apply_rotary_pos_emb, ml.LlamaRMSNorm.forward, sdpa_attention.use_gqa_in_sdpa
    ml.apply_rotary_pos_emb, ml.LlamaRMSNorm.forward = _patched_apply_rotary, _rms_norm_forward
    # sdpa(enable_gqa=True) instead of repeat_kv: Attention gets the 2 kv heads as they are.
    sdpa_attention.use_gqa_in_sdpa = lambda *a, **k: True
    try:
        yield
    finally:
        ml.apply_rotary_pos_emb, ml.LlamaRMSNorm.forward, sdpa_attention.use_gqa_in_sdpa = saved


def export_dynamo_opset23(spec, wrapper, example, in_names, out_names, path):
    with opset23_patches():
        export_dynamo(
            spec,
            wrapper,
            example,
            in_names,
            out_names,
            path,
            custom_translation_table={torch.ops.atlas.rotary.default: _rotary_onnx},
        )


EXPORTERS = {
    "dynamo": export_dynamo,
    "dynamo-opset23": export_dynamo_opset23,
    "torchscript": export_torchscript,
    "optimum-style": export_torchscript,
}


# ----------------------------------------------------------------------------------------------
# Reference run and checks
# ----------------------------------------------------------------------------------------------


def ort_session(path):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def torch_run(spec, wrapper, in_names, out_names, inputs, patched=None):
    """The wrapper's outputs (as fp32 numpy) on named numpy inputs; opset-23 fixtures run patched."""
    if patched is None:
        patched = spec.exporter == "dynamo-opset23"
    ctx = opset23_patches() if patched else contextlib.nullcontext()
    wrapper.eval()
    with torch.no_grad(), ctx:
        outs = wrapper(*to_torch(inputs[n] for n in in_names))
    return {n: o.float().numpy() for n, o in zip(out_names, outs)}


def max_diff(a, b):
    return max(
        float(np.max(np.abs(a[k].astype(np.float32) - b[k].astype(np.float32)))) if a[k].size else 0.0
        for k in a
    )


def export_one(spec, out_dir):
    model, config = spec.build()
    if spec.dtype == "fp16":
        model = model.half()
    wrapper, in_names, out_names = make_wrapper(spec, model, config)
    path = os.path.join(out_dir, f"{spec.name}.onnx")
    example = export_example(spec, config)
    print(
        f"[{spec.name}] exporting ({spec.exporter}, opset {spec.opset or 'default'}, {spec.dtype})",
        flush=True,
    )
    EXPORTERS[spec.exporter](spec, wrapper, example, in_names, out_names, path)

    proto = onnx.load(path)
    onnx.checker.check_model(proto)
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
    opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    op_hist = Counter(n.op_type for n in proto.graph.node)
    sess = ort_session(path)
    graph_in = [i.name for i in sess.get_inputs()]
    graph_out = [o.name for o in sess.get_outputs()]
    assert sorted(graph_in) == sorted(in_names), (graph_in, in_names)
    assert graph_out == out_names, (graph_out, out_names)

    atol = 3e-2 if spec.dtype == "fp16" else 1e-4
    rows = []
    for case in spec.cases:
        inputs = case_inputs(spec, config, case)
        outs = dict(zip(graph_out, sess.run(None, {n: inputs[n] for n in graph_in})))
        assert all(np.isfinite(v).all() for v in outs.values()), f"{spec.name}.{case}: non-finite output"
        ref = torch_run(spec, wrapper, in_names, out_names, inputs)
        diff = max_diff(outs, ref)
        ok = diff <= atol
        rows.append((spec.name, case, diff, ok))
        np.savez(
            os.path.join(out_dir, f"{spec.name}.{case}.npz"),
            **{f"in.{n}": inputs[n] for n in graph_in},
            **{f"out.{n}": outs[n] for n in graph_out},
        )

    entry = {
        "name": spec.name,
        "arch": spec.arch,
        "kind": spec.kind,
        "exporter": spec.exporter,
        "opset": opset,
        "dtype": spec.dtype,
        "cases": list(spec.cases),
        "inputs": graph_in,
        "outputs": graph_out,
        "shapes": {
            v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(proto.graph.input) + list(proto.graph.output)
        },
        "op_types": sorted(op_hist),
        "notes": spec.notes,
    }
    if spec.kind == "decoder":
        num_layers, kv_heads, head_dim, vocab = decoder_dims(config)
        entry.update(num_layers=num_layers, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab)
    else:
        entry.update(
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_attention_heads,
            head_dim=config.hidden_size // config.num_attention_heads,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
        )
    extra = extra_checks(spec, model, config, wrapper, in_names, out_names, sess)
    rows += extra
    return entry, rows, op_hist


def extra_checks(spec, model, config, wrapper, in_names, out_names, sess):
    """Fixture-specific checks, reported as extra rows of the final table."""
    rows = []
    if spec.kind == "decoder":
        # The mask must be live in the graph (a trace could have frozen an all-ones shortcut):
        # dropping the left padding of the `decode` case changes sequences 0 and 2, not 1.
        inputs = case_inputs(spec, config, "decode")
        run = lambda x: sess.run(["logits"], {i.name: x[i.name] for i in sess.get_inputs()})[0]
        unpadded = dict(inputs, attention_mask=np.ones_like(inputs["attention_mask"]))
        d = np.abs(run(inputs).astype(np.float32) - run(unpadded).astype(np.float32)).max(axis=(1, 2))
        ok = d[0] > 1e-3 and d[2] > 1e-3 and d[1] == 0
        rows.append((spec.name, "decode: padding changes seqs 0,2 only", float(min(d[0], d[2])), ok))
    if spec.name == "mistral":
        # The sliding window must be live: without it the `long` case gives other logits.
        nowin, _ = build_mistral(sliding_window=None)
        w2 = DecoderWrapper(nowin, config.num_hidden_layers, in_names)
        inputs = case_inputs(spec, config, "long")
        a = torch_run(spec, wrapper, in_names, out_names, inputs)
        b = torch_run(spec, w2, in_names, out_names, inputs)
        d = float(np.abs(a["logits"] - b["logits"]).max())
        rows.append((spec.name, "long: window vs no window (must be > 0)", d, d > 1e-3))
    if spec.name == "llama-opset23":
        # Same weights as `llama`: ORT on this graph vs the unpatched fp32 llama in torch.
        base, _ = build_llama()
        w2 = DecoderWrapper(base, config.num_hidden_layers, in_names)
        for case in spec.cases:
            inputs = case_inputs(spec, config, case)
            outs = dict(
                zip(
                    [o.name for o in sess.get_outputs()],
                    sess.run(None, {i.name: inputs[i.name] for i in sess.get_inputs()}),
                )
            )
            ref = torch_run(spec, w2, in_names, out_names, inputs, patched=False)
            d = max_diff(outs, ref)
            rows.append((spec.name, f"{case} vs unpatched llama torch", d, d <= 1e-4))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="fixture names to (re)generate")
    ap.add_argument("--out", default=os.path.join(HERE, "fixtures"))
    args = ap.parse_args(argv)

    names = {s.name for s in SPECS}
    if args.only and not set(args.only) <= names:
        ap.error(f"unknown fixture(s) {sorted(set(args.only) - names)}; known: {sorted(names)}")
    specs = [s for s in SPECS if not args.only or s.name in args.only]
    os.makedirs(args.out, exist_ok=True)

    manifest_path = os.path.join(args.out, "manifest.json")
    manifest = {}
    if os.path.exists(manifest_path):
        with open(manifest_path) as f:
            manifest = {e["name"]: e for e in json.load(f)}

    table, failed = [], []
    for spec in specs:
        try:
            entry, rows, _ = export_one(spec, args.out)
        except Exception as e:  # noqa: BLE001 - keep going, report at the end
            import traceback

            traceback.print_exc()
            failed.append((spec.name, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
            continue
        manifest[spec.name] = entry
        table += [(r, entry["op_types"]) for r in rows]

    order = [s.name for s in SPECS]
    entries = sorted(manifest.values(), key=lambda e: order.index(e["name"]) if e["name"] in order else 99)
    with open(manifest_path, "w") as f:
        json.dump(entries, f, indent=2)
        f.write("\n")

    print(f"\n{'fixture':<15} {'case':<40} {'max|ort-torch|':>14}  ok   op types")
    last = None
    for (name, case, diff, ok), ops in table:
        print(
            f"{name:<15} {case:<40} {diff:>14.3g}  {'yes' if ok else 'NO '}  "
            f"{' '.join(ops) if name != last else ''}"
        )
        last = name
    total = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"\n{args.out}: {total / 1e6:.2f} MB in {len(os.listdir(args.out))} files")
    for name, why in failed:
        print(f"FAILED {name}: {why}")
    bad = [r for (r, _) in table if not r[3]]
    return 1 if failed or bad else 0


if __name__ == "__main__":
    sys.exit(main())
