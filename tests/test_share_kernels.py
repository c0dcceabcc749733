"""codegen/share.py: nodes whose kernels differ only in arena offsets (a model's layers) launch one kernel
with their offsets as arguments. Checked on the fixtures' generated modules against the same compile with
ATLAS_SHARE_KERNELS=0 (every node its own kernel): each launch of a shared kernel, its arguments put back
as literals, is exactly the node's own kernel; the rest of the source is unchanged.
"""

from __future__ import annotations

import re

import pytest

from atlasc.codegen.share import Shared, share_kernels
from atlasc.ir.program import CompileOptions

from conftest import FIXTURES

OPTIONS = CompileOptions(archs=("sm90",), max_batch=4, max_seq=64)
DEFINITION = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(unsigned char\*')


class _Generated(Exception):
    pass


def _module(name: str, monkeypatch, share: bool | str):
    """The GeneratedModule of the fixture's compile (the compile stops before nvcc); share: True, False or
    "all" (ATLAS_SHARE_KERNELS=1 / 0 / all)."""
    import atlasc.compiler
    from atlasc.compiler import compile_model

    got = {}

    def capture(module, archs, *, on_built=None):
        got["module"] = module
        raise _Generated

    with monkeypatch.context() as mp:
        mp.setattr(atlasc.compiler, "compile_module", capture)
        mp.setenv("ATLAS_SHARE_KERNELS", share if isinstance(share, str) else "1" if share else "0")
        with pytest.raises(_Generated):
            compile_model(FIXTURES / f"{name}.onnx", "/nonexistent/never-written.atlas", OPTIONS)
    return got["module"]


def _texts(module) -> dict[str, str]:
    """kernel name -> its text (the preamble before the definition included)."""
    out = {}
    for text in module.kernels:
        names = set(DEFINITION.findall(text))  # the definition (and a declaration in the preamble)
        assert len(names) == 1, names
        out[names.pop()] = text
    return out


def _launches(module) -> list[tuple[str, str, tuple[int, ...]]]:
    """(node / variant, kernel, args) of every launch of every entry."""
    return [(f"{e}:{launch.node}:{v.upto if v is not launch else ''}", v.kernel, v.args)
            for e, ls in module.launches.items() for launch in ls for v in (launch, *launch.variants)]


def _canonical(kernel: str, text: str) -> str:
    """The text without comment lines, with the kernel's name as a placeholder."""
    text = re.sub(r"^[ \t]*//[^\n]*\n?", "", text, flags=re.M)
    return re.sub(rf"\b{kernel}\b", "@KERNEL@", text)


def _with_literals(text: str, args: tuple[int, ...]) -> str:
    """A shared kernel's text as one launch runs it: `(atlas_off.v[k] + d)` -> args[k] + d, the one-argument
    signature."""
    def literal(m) -> str:
        distance = int(m.group(3) or 0) * (-1 if m.group(2) == "-" else 1)
        return f"arena + {args[int(m.group(1))] + distance}LL"

    text = re.sub(r"arena \+ \(?atlas_off\.v\[(\d+)\](?: ([+-]) (\d+)LL\))?", literal, text)
    return re.sub(r"\(unsigned char\* __restrict__ arena, const atlas::ArenaOffsets<\d+> atlas_off\)",
                  "(unsigned char* __restrict__ arena)", text)


@pytest.mark.parametrize("name,layers", [("llama-fp16", 2), ("minilm", 6)])
def test_each_launch_of_a_shared_kernel_is_its_nodes_own_kernel(name, layers, monkeypatch):
    own, shared = _module(name, monkeypatch, False), _module(name, monkeypatch, True)
    own_texts, shared_texts = _texts(own), _texts(shared)
    own_launches, shared_launches = _launches(own), _launches(shared)
    assert [w for w, _, _ in own_launches] == [w for w, _, _ in shared_launches]
    assert all(not args for _, _, args in own_launches)
    # the layers' kernels are shared: per distinct layer kernel, one definition instead of `layers`
    assert len(shared_texts) < len(own_texts)
    uses: dict[str, set] = {}
    for (_, own_kernel, _), (_, kernel, args) in zip(own_launches, shared_launches):
        uses.setdefault(kernel, set()).add(args)
        text = shared_texts[kernel]
        if args:
            assert f"atlas::ArenaOffsets<{len(args)}> atlas_off" in text
            text = _with_literals(text, args)
        else:  # a kernel of one node (its text unchanged), or of nodes equal to the byte
            assert "ArenaOffsets" not in text
            assert text == own_texts[own_kernel] or text.startswith("// one kernel for ")
        assert _canonical(kernel, text) == _canonical(own_kernel, own_texts[own_kernel])
    assert max(len(a) for a in uses.values()) >= layers  # a layer kernel serves every layer
    assert all(len(a) == 1 or all(a) for a in uses.values())  # shared: each launch its own offsets
    assert shared.prelude == own.prelude


def test_the_kernel_choices_name_only_emitted_kernels(monkeypatch):
    module = _module("minilm", monkeypatch, True)
    emitted = set(_texts(module))
    assert set(module.choices.get("kernels", {})) <= emitted


def _kernel(name: str, offsets: tuple[int, ...], op: str = "y = x", preamble: str = "") -> tuple[str, str, str]:
    lines = "\n".join(f"  float* p{i} = reinterpret_cast<float*>(arena + {o}LL);" for i, o in enumerate(offsets))
    return (name, f"node_{name}", f"{preamble}// node_{name}: Op -> y\n"
            f'extern "C" __global__ void __launch_bounds__(256) {name}(unsigned char* __restrict__ arena) {{\n'
            f"{lines}\n  {op};\n}}")


def test_only_kernels_equal_but_for_offsets_are_shared():
    texts, launch = share_kernels([_kernel("a", (0, 64)), _kernel("b", (128, 192)), _kernel("c", (0, 64), "y = 2 * x"),
                                   _kernel("d", (256, 320))])
    # both offsets move together: one argument, the other offset a literal distance from it
    assert launch == {"a": Shared("a", (0,)), "b": Shared("a", (128,)), "c": Shared("c"), "d": Shared("a", (256,))}
    assert len(texts) == 2 and texts[1] == _kernel("c", (0, 64), "y = 2 * x")[2]
    assert texts[0].startswith("// one kernel for 3 nodes: node_a, node_b, node_d\n")
    assert "a(unsigned char* __restrict__ arena, const atlas::ArenaOffsets<1> atlas_off) {" in texts[0]
    assert "(arena + atlas_off.v[0]);" in texts[0] and "(arena + (atlas_off.v[0] + 64LL));" in texts[0]


def test_offsets_equal_in_every_node_stay_literals_and_each_way_of_moving_gets_one_argument():
    texts, launch = share_kernels([_kernel("a", (8, 4096, 512, 1024)), _kernel("b", (8, 2048, 512, 3072)),
                                   _kernel("c", (8, 0, 512, 5120))])
    # offset 0 and 2: the same in every node; 1 moves by -2048 per node, 3 by +2048: two arguments
    assert launch == {"a": Shared("a", (4096, 1024)), "b": Shared("a", (2048, 3072)), "c": Shared("a", (0, 5120))}
    assert "(arena + 8LL)" in texts[0] and "(arena + 512LL)" in texts[0] and "ArenaOffsets<2>" in texts[0]
    texts, launch = share_kernels([_kernel("a", (8, 4096, 6144)), _kernel("b", (8, 2048, 4096))])
    assert launch == {"a": Shared("a", (4096,)), "b": Shared("a", (2048,))}
    assert "(arena + (atlas_off.v[0] + 2048LL))" in texts[0]
    texts, launch = share_kernels([_kernel("a", (8, 6144, 4096)), _kernel("b", (8, 4096, 2048))])
    assert launch == {"a": Shared("a", (6144,)), "b": Shared("a", (4096,))}
    assert "(arena + (atlas_off.v[0] - 2048LL))" in texts[0]
    texts, launch = share_kernels([_kernel("a", (8, 16)), _kernel("b", (8, 16))])  # equal to the byte
    assert launch == {"a": Shared("a"), "b": Shared("a")} and "ArenaOffsets" not in texts[0] and len(texts) == 1


def test_an_offset_outside_the_kernel_body_is_never_parameterized(monkeypatch):
    """An offset in a namespace-scope preamble cannot read the kernel's parameter: such kernels stay apart;
    ATLAS_SHARE_KERNELS=0 keeps every kernel as generated."""
    code = "__device__ long long at(unsigned char* arena) { return (long long)(arena + 8LL); }\n"
    kernels = [_kernel("a", (0,), preamble=code), _kernel("b", (64,), preamble=code)]
    texts, launch = share_kernels(kernels)
    assert launch == {"a": Shared("a"), "b": Shared("b")} and texts == [k[2] for k in kernels]
    monkeypatch.setenv("ATLAS_SHARE_KERNELS", "0")
    kernels = [_kernel("a", (0,)), _kernel("b", (64,))]
    assert share_kernels(kernels) == ([k[2] for k in kernels], {"a": Shared("a"), "b": Shared("b")})


def test_a_decode_steps_batch_1_kernels_stay_one_per_node(monkeypatch):
    """The decode step's kernels generated for batch 1 (the batch-1 bucket's variants; measured slower shared,
    codegen/share.py) are each node's own; its kernels for larger batches and the prefill's are shared."""
    module = _module("llama-fp16", monkeypatch, True)
    decode = [v for launch in module.launches["decode"] for v in (launch, *launch.variants)]
    batch1 = [v for v in decode if getattr(v, "upto", None) == 1 and v.kernel.endswith("_batch1")]
    assert batch1 and all(not v.args for v in batch1)
    assert len({v.kernel for v in batch1}) == len(batch1)  # one kernel per node
    assert any(v.args for v in decode if getattr(v, "upto", None) != 1)
    assert any(launch.args for launch in module.launches["prefill"])
    texts, launch = share_kernels([_kernel("a", (0,)), _kernel("b", (64,)), _kernel("c", (128,))], alone={"b"})
    assert launch == {"a": Shared("a", (0,)), "b": Shared("b"), "c": Shared("a", (128,))} and len(texts) == 2


def test_share_kernels_all_shares_the_batch_1_decode_kernels_too(monkeypatch):
    """ATLAS_SHARE_KERNELS=all (for A/B runs on the GPU): the batch-1 decode kernels of the layers become shared
    kernels with arguments, and the report records "all"."""
    module = _module("llama-fp16", monkeypatch, "all")
    batch1 = [v for launch in module.launches["decode"] for v in launch.variants
              if v.upto == 1 and v.kernel.endswith("_batch1")]
    assert batch1 and any(v.args for v in batch1)
    assert len({v.kernel for v in batch1}) < len(batch1)
    assert module.choices["share_kernels"] == "all"
