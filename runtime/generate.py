"""The generation loop over a decoder artifact: prefill, then one decode step per new token.

Works with any backend that has `run(entry, inputs, symbols) -> outputs` and `reset()` (the CPU
executor and the GPU runtime). Prompts of different lengths are left-padded: padded positions get
attention_mask 0, position ids count only real tokens (as Hugging Face's generate does), and the
KV cache holds the padding too, so every sequence shares one past length.

Shapes: ids [B, S] (prefill) then [B, 1]; attention_mask [B, past + S]; position_ids [B, S].

On the GPU runtime (GpuModel.submit) the decode steps are pipelined: step t + 1 is enqueued, its input ids
copied on the device from step t's next_tokens, before the host reads step t's tokens, so the GPU does not
wait for the host between steps (8 layers of Llama-3-8B shapes: docs/perf.md v17). Not with keep_logits,
which reads every step's logits (one step at a time, as on the CPU).
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
    decode_seconds: list[float] = field(default_factory=list)  # wall time from each step's tokens to the next's

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


def _vocab(manifest, roles: dict[str, str]) -> int | None:
    """The vocabulary size: the last dim of the prefill's logits output (None where it is not a number)."""
    logits = next((o for o in manifest.entries["prefill"].outputs if o.name == roles["logits"]), None)
    dim = logits.shape[-1] if logits is not None and logits.shape else None
    return dim if isinstance(dim, int) else None


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
    vocab = _vocab(m, roles)
    bad = sorted({int(t) for p in prompts for t in p if not 0 <= int(t) < (vocab or 2**63)})
    if bad:
        raise InputError(f"prompt token ids {', '.join(map(str, bad[:5]))}{' ...' if len(bad) > 5 else ''} are "
                         f"outside the vocabulary [0, {vocab or 2**63})")
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
    steps = _DecodeCalls(model, m, roles, sampling, b, wanted)
    nxt, past, t_last = out["next_tokens"], s, time.perf_counter()
    one = np.ones((b, 1), np.int64)
    ahead = None  # the mask of the call submitted two steps ahead (pipelined), built once
    for step in range(max_new_tokens):
        for i in range(b):  # nxt: the tokens of call `step` (the prefill's at step 0)
            if not done[i]:
                result.tokens[i].append(int(nxt[i]))
                if int(nxt[i]) in stop_tokens:
                    done[i] = True
        if on_token:
            on_token(step, [int(t) for t in nxt])
        if done.all() or step == max_new_tokens - 1:
            break
        mask = ahead if ahead is not None else np.concatenate([mask, one], axis=1)  # call step + 1's
        ahead = None
        if steps.pipelined:
            if step == 0:
                steps.submit(mask, past)
            if step + 2 < max_new_tokens:  # call step + 2 goes behind call step + 1 before the host reads it
                ahead = np.concatenate([mask, one], axis=1)
                steps.submit(ahead, past + 1)
            nxt = steps.collect()
        else:
            out = steps.run(nxt, mask, past)
            nxt = out["next_tokens"]
            if keep_logits:
                result.step_logits.append(out[roles["logits"]][:, -1, :])
        now = time.perf_counter()
        result.decode_seconds.append(now - t_last)
        t_last = now
        past += 1
    steps.drain()
    return result


class _DecodeCalls:
    """generate's decode calls, in order. run: one call, waited for. Pipelined (a GpuModel, int64 input ids,
    no per-step logits wanted): submit enqueues a call behind the previous one (GpuModel.submit), its input
    ids taken on the device from that call's next_tokens, and collect waits for the oldest call not yet
    collected, so the GPU runs the next step while the host reads this one's tokens."""

    def __init__(self, model, manifest, roles, sampling: Sampling, batch: int, wanted: tuple[str, ...]):
        self.model, self.manifest, self.roles, self.sampling, self.wanted = model, manifest, roles, sampling, wanted
        ids = next((i for i in manifest.entries["decode"].inputs if i.name == roles["input_ids"]), None)
        self.pipelined = (hasattr(model, "submit") and wanted == ("next_tokens",) and ids is not None
                          and ids.dtype == "int64")
        self.placeholder = np.zeros((batch, 1), np.int64)  # overwritten on the device (submit's tokens_from)
        self.tokens_from = model.tokens_offset("prefill") if self.pipelined else None
        self.calls = 0  # decode calls made so far; call k samples with step k (Sampling.inputs)
        self.queued: list[int] = []  # slots of submitted calls not yet collected, oldest first

    def _inputs(self, ids, mask, past: int) -> dict[str, np.ndarray]:
        self.calls += 1
        return {**_feed(self.manifest, "decode", self.roles, ids, mask, past), **self.sampling.inputs(self.calls)}

    def run(self, nxt, mask, past: int) -> dict[str, np.ndarray]:
        ids = nxt.reshape(-1, 1).astype(np.int64)
        return self.model.run("decode", self._inputs(ids, mask, past), {self.roles["past"]: past},
                              outputs=self.wanted)

    def submit(self, mask, past: int) -> None:
        inputs = self._inputs(self.placeholder, mask, past)
        self.queued.append(self.model.submit("decode", inputs, {self.roles["past"]: past},
                                             tokens_from=self.tokens_from, tokens_to=self.roles["input_ids"]))
        self.tokens_from = self.model.tokens_offset("decode")

    def collect(self) -> np.ndarray:
        return self.model.collect(self.queued.pop(0))

    def drain(self) -> None:
        """Wait for calls enqueued past the last token used (a stop token ended the generation early)."""
        while self.queued:
            self.collect()


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
