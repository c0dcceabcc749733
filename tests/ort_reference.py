"""onnxruntime as the oracle for whole decoders: greedy generation with explicit past/present tensors.

The loop mirrors atlasc.runtime.generate: left padding, attention_mask over past + new tokens,
position ids = cumsum(mask) - 1 clipped at 0. Each step feeds the previous step's `present.*`
outputs back as `past_key_values.*`, exactly as the ONNX export expects.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort


def session(path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def ort_greedy(path, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy tokens per prompt and the last-position logits of every step."""
    sess = session(path)
    inputs = {i.name: i for i in sess.get_inputs()}
    past_names = [n for n in inputs if n.startswith("past")]
    first = inputs[past_names[0]]
    heads, head_dim = first.shape[1], first.shape[3]
    dtype = np.float16 if "float16" in first.type else np.float32
    b = len(prompts)
    s = max(len(p) for p in prompts)
    ids = np.zeros((b, s), np.int64)
    mask = np.zeros((b, s), np.int64)
    for i, p in enumerate(prompts):
        ids[i, s - len(p):] = p
        mask[i, s - len(p):] = 1
    past = {n: np.zeros((b, heads, 0, head_dim), dtype) for n in past_names}
    tokens: list[list[int]] = [[] for _ in range(b)]
    logits_seen = []
    done_len = 0
    for _ in range(max_new_tokens):
        pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)[:, done_len:done_len + ids.shape[1]]
        feed = {"input_ids": ids, **past}
        if "attention_mask" in inputs:
            feed["attention_mask"] = mask
        if "position_ids" in inputs:
            feed["position_ids"] = pos.astype(np.int64)
        outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))
        last = outs["logits"][:, -1, :]
        logits_seen.append(last)
        nxt = np.argmax(last.astype(np.float32), axis=-1)
        for i in range(b):
            tokens[i].append(int(nxt[i]))
        done_len += ids.shape[1]
        past = {n: outs[n.replace("past_key_values", "present")] for n in past_names}
        ids = nxt.reshape(b, 1).astype(np.int64)
        mask = np.concatenate([mask, np.ones((b, 1), np.int64)], axis=1)
    return tokens, logits_seen
