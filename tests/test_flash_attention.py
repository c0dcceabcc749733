"""attention_fa2 (ATLAS_ATTENTION_PREFILL=fa2, codegen/flash_attention.py + .cu) on the CPU: off by
default (the generated source and the report are unchanged), chosen only for the prefill-sized fp16
nodes it supports (the others keep today's kernel, the reason recorded), tiles recorded in the report,
and the kernels compile for sm80 and sm90 without register spills. GPU numerics:
tests/test_kernels_matmul_attention_gpu.py::test_attention_fa2 and tests/test_gpu_runtime.py."""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import arch_params
from test_codegen_matmul_attention import (
    Builder,
    _nvcc_log,
    compile_or_skip,
    left_padded_keys,
    planned,
)

from atlasc.codegen import flash_attention, generate_module
from atlasc.codegen.generate import CodegenError, KernelContext, codegen_choices
from atlasc.ir import symbolic as S

PREFILL_UPPER = {"batch": 2, "seq": 520, "past_seq": 64}
F16_MIN = -65504.0


def prefill_mask(kind: str, fill: float = F16_MIN):
    """Generator of a [B, 1, S, T] mask as a decoder's default pipeline gives it: key t visible to query s
    iff t >= pad_b (left padding, random) and t <= T - S + s (causal with past T - S); hidden keys get
    `fill` (the fp16 export's lowest value, or -inf), visible ones 0 or a small negative bias; batch row 1
    hides every key when B > 1, and query rows left of the padding see no key (all-hidden rows)."""

    def gen(rng, shape):
        b, _, s, t = shape
        pads = rng.integers(0, max(1, t // 2), b)
        if b > 1:
            pads[1] = t
        keep = (np.arange(t)[None, None, :] >= pads[:, None, None]) & \
            (np.arange(t)[None, None, :] <= t - s + np.arange(s)[None, :, None])  # [B, S, T]
        keep = keep[:, None]
        if kind == "bool":
            return keep.copy()
        bias = -rng.uniform(0.0, 0.5, shape).astype(np.float32)
        return np.where(keep, bias, np.float32(fill)).astype(kind)

    return gen


def build_attention_prefill(dtype: str = "float16") -> Builder:
    """Prefill-shaped Attention (seq up to 520, past up to 64): K/V as cache views [B, Hk, past + seq, D]
    (plan them padded), head dims 64 / 128 / 16, GQA groups 1 / 4, the default pipeline's additive mask
    (fp16 lowest and -inf fills) and a bool one, the causal attribute with past inputs, the KEYS form
    (attention_mask [B, T] with causal, window, fp16-lowest or -inf fill), 3-D inputs, the [B, S, H*D]
    output. The first eight nodes are fa2's; the last four it declines (softcap, head dim 96, present
    outputs, a transposed K)."""
    b = Builder(f"attention_prefill_{dtype}", {k: (1 if k != "past_seq" else 0, v) for k, v in PREFILL_UPPER.items()})
    hk = 2
    total = S.add(S.sym("past_seq"), S.sym("seq"))
    kv = {d: (b.input(f"k{d}", dtype, ("batch", hk, total, d)), b.input(f"v{d}", dtype, ("batch", hk, total, d)))
          for d in (16, 64, 128)}
    q = lambda d, g: b.input(f"q{d}_g{g}_{b.n}", dtype, ("batch", g * hk, "seq", d))  # noqa: E731
    mask = lambda name, kind, fill=F16_MIN: b.input(name, kind, ("batch", 1, "seq", total),  # noqa: E731
                                                    gen=prefill_mask(kind, fill))
    am = b.input("am", "int64", ("batch", total), gen=left_padded_keys("int64"))
    amask = mask("amask", dtype)
    keys = lambda causal, window, fill: {"key_mask": 1, "causal": causal, "window": window,  # noqa: E731
                                         "mask_fill": fill}
    # 1 the default pipeline's llama prefill: additive fp16 mask (lowest fill), group 4, [B, S, H*D] out
    b.node("Attention", [q(64, 4), *kv[64], amask], {"out_bshd": 1})
    # 2 head dim 128, group 1, additive mask with -inf fills, a scale
    b.node("Attention", [q(128, 1), *kv[128], mask("imask", dtype, float("-inf"))], {"scale": 0.05})
    # 3 bool mask, head dim 128, group 4
    b.node("Attention", [q(128, 4), *kv[128], mask("bmask", "bool")])
    # 4 the causal attribute with past inputs (query i at past + i), no mask, group 4
    pk = b.input("pk", dtype, ("batch", hk, "past_seq", 64))
    pv = b.input("pv", dtype, ("batch", hk, "past_seq", 64))
    kn = b.input("kn", dtype, ("batch", hk, "seq", 64))
    vn = b.input("vn", dtype, ("batch", hk, "seq", 64))
    b.node("Attention", [q(64, 4), kn, vn, None, pk, pv], {"is_causal": 1})
    # 5 KEYS, causal + window 37, fp16-lowest fill (the mask-as-lengths llama / mistral form), group 4
    b.node("Attention", [q(128, 4), *kv[128], am], {**keys(1, 37, F16_MIN), "out_bshd": 1})
    # 6 KEYS, causal, -inf fill (skipped key tiles exact), group 1
    b.node("Attention", [q(64, 1), *kv[64], am], keys(1, 0, float("-inf")))
    # 7 3-D inputs [B, S, H*D], 8 q heads over 2 kv heads, head dim 64, causal attribute, no past
    q3 = b.input("q3", dtype, ("batch", "seq", 8 * 64))
    k3 = b.input("k3", dtype, ("batch", "seq", hk * 64))
    v3 = b.input("v3", dtype, ("batch", "seq", hk * 64))
    b.node("Attention", [q3, k3, v3], {"q_num_heads": 8, "kv_num_heads": hk, "is_causal": 1})
    # 8 head dim 16 (the decoder fixtures'), group 2, additive mask
    b.node("Attention", [q(16, 2), *kv[16], amask], {"out_bshd": 1})
    # declined: 9 softcap, 10 head dim 96, 11 present outputs, 12 K transposed
    b.node("Attention", [q(64, 4), *kv[64], amask], {"softcap": 30.0})
    b.node("Attention", [q(96, 1), b.input("k96", dtype, ("batch", hk, total, 96)),
                         b.input("v96", dtype, ("batch", hk, total, 96)), amask])
    b.node("Attention", [q(64, 1), kn, vn, None, pk, pv], {"is_causal": 1}, outputs=3)
    b.node("Attention", [q(64, 4), b.input("kt", dtype, ("batch", hk, total, 64)), kv[64][1], amask])
    return b


PREFILL_PADDED = {"k16", "v16", "k64", "v64", "k128", "v128", "k96", "v96"}
PREFILL_TRANSPOSED = {"kt"}
FA2_NODES = 8


def generate_prefill(dtype: str = "float16", upper: dict | None = None):
    b = build_attention_prefill(dtype)
    graph, plan, _ = planned(b, dtype, padded=PREFILL_PADDED, transposed=PREFILL_TRANSPOSED)
    return b, graph, plan, generate_module({"p": (graph, plan)}, {"p": upper or b.upper})


def _calls(source: str, kernel: str) -> list[str]:
    return [line for line in source.splitlines() if line.startswith(f"  atlas::{kernel}<")]


def test_fa2_is_the_default_and_off_turns_it_off(monkeypatch):
    """Unset (or empty): fa2, as with ATLAS_ATTENTION_PREFILL=fa2. off: no attention_fa2 call, no per-kernel
    attention report, and the choice recorded as off."""
    monkeypatch.delenv(flash_attention.PREFILL_ENV, raising=False)
    monkeypatch.delenv(flash_attention.WARPS_ENV, raising=False)
    _, _, _, mod = generate_prefill()
    assert _calls(mod.source, "attention_fa2")
    assert codegen_choices()["attention_prefill"] == "fa2"
    monkeypatch.setenv(flash_attention.PREFILL_ENV, "fa2")
    assert generate_prefill()[3].source == mod.source
    monkeypatch.setenv(flash_attention.PREFILL_ENV, "off")
    off = generate_prefill()[3]
    assert not _calls(off.source, "attention_fa2") and "kernels" not in off.choices
    assert codegen_choices()["attention_prefill"] == "off" and "attention_fa2" not in codegen_choices()
    monkeypatch.setenv(flash_attention.PREFILL_ENV, "on")
    with pytest.raises(CodegenError, match="expected fa2 or off"):
        generate_prefill()


def test_fa2_serves_supported_prefill_nodes(monkeypatch):
    """ATLAS_ATTENTION_PREFILL=fa2: the eight supported nodes get attention_fa2 (4 warps of 16 rows at
    520 rows, 64 keys per tile, its template head dim), the four others keep today's kernel with the
    reason recorded per kernel; at decode maxima (seq 1) nothing is fa2 (1 query row)."""
    monkeypatch.setenv(flash_attention.PREFILL_ENV, "fa2")
    monkeypatch.delenv(flash_attention.WARPS_ENV, raising=False)
    b, graph, plan, mod = generate_prefill()
    calls = _calls(mod.source, "attention_fa2")
    assert len(calls) == FA2_NODES
    heads = [int(re.match(r"  atlas::attention_fa2<[^,]+, (\d+), 4,", line).group(1)) for line in calls]
    assert heads == [64, 128, 128, 64, 128, 64, 64, 16]
    # flags HAS_PAST, HAS_MASK, CAUSAL, KEYS
    assert [line.split(", ", 4)[4] for line in calls] == [
        "false, true, false, false>(args);", "false, true, false, false>(args);", "false, true, false, false>(args);",
        "true, false, true, false>(args);", "false, true, false, true>(args);", "false, true, false, true>(args);",
        "false, false, true, false>(args);", "false, true, false, false>(args);"]
    assert mod.choices["attention_prefill"] == "fa2"
    assert mod.choices["attention_fa2"] == {"bc": 64, "min_rows": 16, "warps": "auto"}
    kinds = mod.choices["kernels"]
    launches = {launch.node: launch for launch in mod.launches["p"]}
    for i, node in enumerate(graph.nodes):
        choice = kinds[launches[node.name].kernel]
        if i < FA2_NODES:
            assert choice == {"attention": "fa2", "br": 64, "bc": 64, "warps": 4,
                              "head_dim": heads[i]}, node.name
            assert launches[node.name].block == (128, 1, 1)
            assert launches[node.name].smem == flash_attention.fa2_smem(heads[i], 4)
        else:
            assert choice["attention"] in ("fast", "rows") and choice["fa2_declined"], node.name
    reasons = [kinds[launches[n.name].kernel]["fa2_declined"] for n in graph.nodes[FA2_NODES:]]
    assert reasons[0] == "softcap" and reasons[1].startswith("head dims 96 / 96")
    assert reasons[2] == "present or qk outputs" and reasons[3] == "kt has a non-unit stride along the head dim"
    # batch 2 x 8 q heads x ceil(520 / 64) row tiles for the first node
    assert launches[graph.nodes[0].name].grid == (2 * 8 * 9, 1, 1)
    one = generate_module({"p": (graph, plan)}, {"p": {**b.upper, "seq": 1}})
    assert not _calls(one.source, "attention_fa2")
    ctx = KernelContext(graph.nodes[0], plan, {**b.upper, "seq": 1}, "k", None)
    assert flash_attention.fa2_decline(ctx, graph.nodes[0]) == "1 query rows at most (prefill from 16)"


def test_fa2_declines_float32(monkeypatch):
    monkeypatch.setenv(flash_attention.PREFILL_ENV, "fa2")
    b = build_attention_prefill("float32")
    graph, plan, _ = planned(b, "float32", padded=PREFILL_PADDED, transposed=PREFILL_TRANSPOSED)
    ctx = KernelContext(graph.nodes[0], plan, b.upper, "k", None)
    assert flash_attention.fa2_decline(ctx, graph.nodes[0]) == "float32 (float16 only)"
    mod = generate_module({"p": (graph, plan)}, {"p": b.upper})
    assert not _calls(mod.source, "attention_fa2")


@pytest.mark.parametrize("rows,warps", [(16, 1), (17, 2), (32, 2), (33, 4), (64, 4), (4096, 4)])
def test_fa2_warps_follow_the_rows(monkeypatch, rows, warps):
    monkeypatch.delenv(flash_attention.WARPS_ENV, raising=False)
    assert flash_attention.fa2_warps(rows) == warps
    monkeypatch.setenv(flash_attention.WARPS_ENV, "8")
    assert flash_attention.fa2_warps(rows) == 8


@pytest.mark.parametrize("env,value", [("ATLAS_ATTENTION_PREFILL", "flash"), ("ATLAS_ATTENTION_PREFILL", "1"),
                                       ("ATLAS_ATTENTION_FA2_WARPS", "3"), ("ATLAS_ATTENTION_FA2_WARPS", "x")])
def test_fa2_env_rejects_bad_values(monkeypatch, env, value):
    monkeypatch.setenv(flash_attention.PREFILL_ENV, "fa2")
    monkeypatch.setenv(env, value)
    with pytest.raises(CodegenError, match=env):
        generate_prefill()


@pytest.mark.parametrize("arch", arch_params("sm90", "sm80"))
@pytest.mark.parametrize("warps", ["", "8"])
def test_fa2_compiles_without_spills(monkeypatch, tmp_path, warps, arch):
    """Every fa2 variant (head dims 16 / 64 / 128, masks bool / fp16 / KEYS, causal, past, 3-D) compiles
    for the arch with no register spills and no stack frame; the SASS-level instructions are there
    (ldmatrix, mma, cp.async: checked in the PTX-facing source by nvcc's success)."""
    monkeypatch.setenv(flash_attention.PREFILL_ENV, "fa2")
    monkeypatch.setenv(flash_attention.WARPS_ENV, warps)
    _, graph, _, mod = generate_prefill()
    fa2_kernels = {launch.kernel for launch in mod.launches["p"]
                   if mod.choices["kernels"][launch.kernel]["attention"] == "fa2"}
    assert len(fa2_kernels) == FA2_NODES
    log = _nvcc_log(mod.source, arch, tmp_path)
    assert "spill" not in log.replace("0 bytes spill", ""), log[-3000:]
    for kernel in fa2_kernels:  # ptxas -v: "Compiling entry function 'k' ... Used N registers"
        m = re.search(rf"Function properties for {kernel}\n\s*(\d+) bytes stack frame", log)
        assert m and int(m.group(1)) == 0, (arch, kernel, log[-2000:])


def test_fa2_compiles_for_older_archs(monkeypatch):
    """sm < 80 has no mma.sync m16n8k16 / cp.async: the same source compiles (attention_rows runs)."""
    from atlasc.codegen.nvcc import NvccNotFoundError, compile_cubins

    monkeypatch.setenv(flash_attention.PREFILL_ENV, "fa2")
    mod = generate_prefill()[3]
    try:
        cubins = compile_cubins(mod.source, ("sm75",))
    except NvccNotFoundError:
        pytest.skip("nvcc not found")
    assert cubins["sm75"]


def test_fa2_module_compiles(monkeypatch):
    monkeypatch.setenv(flash_attention.PREFILL_ENV, "fa2")
    compile_or_skip(generate_prefill()[3].source)


def test_attention_lab_prefill_mode():
    """examples/attention_lab.py --prefill without a GPU: its fa2 / fa2w8 paths are the compiler's
    attention_fa2 (64 / 128 rows per block), its other paths are not, and its numpy reference (causal,
    two heads) agrees with the reference interpreter for each mask form."""
    import sys

    from conftest import REPO

    from atlasc.ir import interpret

    sys.path.insert(0, str(REPO / "examples"))
    import attention_lab as lab

    for path, br in (("fa2", 64), ("fa2w8", 128), ("fast", None), ("rows", None)):
        for mask in lab.MASKS:
            _, _, mod = lab.generate_prefill("1B", 512, 1, mask, path)
            choice = mod.choices.get("kernels", {}).get(mod.launches["run"][0].kernel, {})
            assert choice.get("br") == br, (path, mask, choice)
    rng = np.random.default_rng(1)
    for mask in lab.MASKS:
        g, _, _ = lab.build_prefill("1B", 40, 2, mask)
        q, ck, cv, m = lab.prefill_inputs("1B", 40, 2, mask, rng)
        feeds = {"q": q, "k": ck[:, :, :40], "v": cv[:, :, :40], **({"mask": m} if m is not None else {})}
        y = interpret(g, feeds)["y"].astype(np.float32).reshape(2, 40, 32, 64).transpose(0, 2, 1, 3)
        np.testing.assert_allclose(y[:, [0, 31]], lab.prefill_reference(q, ck, cv, 40, (0, 31)), atol=1e-3)
    assert lab.prefill_flops("8B", 4096, 1) == 4 * 32 * 128 * 4096 * 4097 / 2


def test_fa2_fits_the_smallest_arch(monkeypatch):
    """A compile that targets sm75 (64 KB of shared memory per block) keeps today's kernel where fa2's
    tiles need more than it allows beside the static arrays (head dim 128: 68 KB), not for head dim 64
    (36 KB); the reason names the bytes. sm90 alone serves both."""
    monkeypatch.delenv(flash_attention.PREFILL_ENV, raising=False)
    monkeypatch.delenv(flash_attention.WARPS_ENV, raising=False)
    b = build_attention_prefill("float16")
    graph, plan, _ = planned(b, "float16", padded=PREFILL_PADDED, transposed=PREFILL_TRANSPOSED)
    by_dim = {}
    for node in graph.nodes:
        why = flash_attention.fa2_decline(KernelContext(node, plan, b.upper, "k", None, archs=("sm90",)), node)
        if why is None:
            by_dim.setdefault(int(node.inputs[0].shape[-1]) // int(node.attrs.get("q_num_heads", 1) or 1)
                              if len(node.inputs[0].shape) == 3 else int(node.inputs[0].shape[-1]), node)
    assert {64, 128} <= set(by_dim)
    old = KernelContext(by_dim[128], plan, b.upper, "k", None, archs=("sm75", "sm90"))
    assert flash_attention.fa2_decline(old, by_dim[128]) == \
        f"its tiles need {flash_attention.fa2_smem(128, 4)} bytes of shared memory, over the 49152 of the " \
        "compile's smallest arch"
    assert flash_attention.fa2_decline(KernelContext(by_dim[64], plan, b.upper, "k", None, archs=("sm75",)),
                                       by_dim[64]) is None
