"""The generation loop over a decoder artifact: prefill, then one decode step per new token.

Works with any backend that has `run(entry, inputs, symbols) -> outputs` and `reset()` (the CPU
executor and the GPU runtime). Prompts of different lengths are left-padded: padded positions get
attention_mask 0, position ids count only real tokens (as Hugging Face's generate does), and the
KV cache holds the padding too, so every sequence shares one past length.

Shapes: ids [B, S] (prefill) then [B, 1]; attention_mask [B, past + S]; position_ids [B, S].
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from atlasc.errors import InputError


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per prompt (without the prompt)
    prefill_logits: np.ndarray | None = None  # [B, S, vocab] of the prefill, for tests
    step_logits: list[np.ndarray] = field(default_factory=list)  # [B, vocab] per decode step
    prefill_seconds: float = 0.0
    decode_seconds: list[float] = field(default_factory=list)  # wall time of each decode step

    def timing(self) -> dict:
        """prefill ms, median decode ms/step, generated tokens/s over the decode steps."""
        steps = self.decode_seconds
        batch = len(self.tokens)
        med = float(np.median(steps)) if steps else 0.0
        return {"prefill_ms": round(self.prefill_seconds * 1e3, 3), "decode_ms_per_step": round(med * 1e3, 3),
                "decode_steps": len(steps),
                "tokens_per_s": round(batch * len(steps) / sum(steps), 1) if steps else 0.0}


def _roles(manifest) -> dict[str, str]:
    io = manifest.report.get("decoder_io", {})
    return {"input_ids": io.get("input_ids", "input_ids"), "attention_mask": io.get("attention_mask"),
            "position_ids": io.get("position_ids"), "logits": io.get("logits", "logits"),
            "past": manifest.report.get("roles", {}).get("past")}


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen, on the device (see atlasc/ir/ops/sampling.py)."""

    temperature: float = 0.0  # <= 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0

    def inputs(self, step: int) -> dict[str, np.ndarray]:
        return {"sample_params": np.array([self.temperature, self.top_p, 0.0], np.float32),
                "sample_state": np.array([self.seed, step, self.top_k], np.int64)}


def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, sampling: Sampling = Sampling(),
             stop_tokens: Sequence[int] = (), on_token: Callable[[int, list[int]], None] | None = None,
             pad_id: int = 0, keep_logits: bool = False) -> GenerationResult:
    """Generate up to max_new_tokens per prompt (a sequence stops at a stop token).

    Tokens are chosen on the device by the artifact's Sample kernel; only the token ids come back
    each step (and the logits too with keep_logits). Guarantees: greedy tokens equal a step-by-step
    evaluation of the original ONNX graph with its past/present tensors (tests check this against
    onnxruntime); a given seed reproduces a sampled generation.
    """
    m = model.manifest
    if m.kv_cache is None or "prefill" not in m.entries:
        raise InputError("this artifact is not a decoder (no prefill/decode entry points)")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InputError("every prompt needs at least one token")
    roles = _roles(m)
    b = len(prompts)
    s = max(len(p) for p in prompts)
    kv = m.kv_cache
    if b > kv.max_batch:
        raise InputError(f"{b} prompts exceed the compiled max batch {kv.max_batch}",
                         hint="recompile with a larger --max-batch")
    if s + max_new_tokens > kv.max_seq:
        raise InputError(f"prompt {s} + {max_new_tokens} new tokens exceed the compiled max_seq {kv.max_seq}",
                         hint="recompile with a larger --max-seq")
    ids = np.full((b, s), pad_id, np.int64)
    mask = np.zeros((b, s), np.int64)
    for i, p in enumerate(prompts):
        ids[i, s - len(p):] = p
        mask[i, s - len(p):] = 1
    wanted = ("next_tokens", roles["logits"]) if keep_logits else ("next_tokens",)
    model.reset()
    t0 = time.perf_counter()
    feed = {**_feed(m, "prefill", roles, ids, mask, 0), **sampling.inputs(0)}
    out = model.run("prefill", feed, {roles["past"]: 0}, outputs=wanted)
    result = GenerationResult([[] for _ in range(b)], prefill_logits=out.get(roles["logits"]),
                              prefill_seconds=time.perf_counter() - t0)
    done = np.zeros(b, bool)
    past = s
    for step in range(max_new_tokens):
        nxt = out["next_tokens"]
        for i in range(b):
            if not done[i]:
                result.tokens[i].append(int(nxt[i]))
                if int(nxt[i]) in stop_tokens:
                    done[i] = True
        if on_token:
            on_token(step, [int(t) for t in nxt])
        if done.all() or step == max_new_tokens - 1:
            break
        mask = np.concatenate([mask, np.ones((b, 1), np.int64)], axis=1)
        feed = {**_feed(m, "decode", roles, nxt.reshape(b, 1).astype(np.int64), mask, past),
                **sampling.inputs(step + 1)}
        t0 = time.perf_counter()
        out = model.run("decode", feed, {roles["past"]: past}, outputs=wanted)
        result.decode_seconds.append(time.perf_counter() - t0)
        if keep_logits:
            result.step_logits.append(out[roles["logits"]][:, -1, :])
        past += 1
    return result


def _feed(manifest, entry: str, roles, ids, mask, past: int) -> dict[str, np.ndarray]:
    names = {i.name for i in manifest.entries[entry].inputs} - {"sample_params", "sample_state"}
    feed = {roles["input_ids"]: ids}
    if roles["attention_mask"] and roles["attention_mask"] in names:
        feed[roles["attention_mask"]] = mask
    if roles["position_ids"] and roles["position_ids"] in names:
        pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        feed[roles["position_ids"]] = pos[:, past:past + ids.shape[1]].astype(np.int64)
    extra = names - set(feed)
    if extra:
        raise InputError(f"the decoder has inputs the generation loop cannot fill: {', '.join(sorted(extra))}")
    return feed
