"""One kernel for the nodes whose generated code differs only in arena offsets (a model's layers).

Every layer of a decoder generates the same kernels, save the arena offsets of its tensors: a 32-layer
model compiled them 32 times (nvcc time grows with the number of kernels, not of distinct ones). Here the
kernels of one module are grouped by their text with the kernel name, comment lines and offsets left
out. A group of two or more becomes one kernel that takes the offsets that differ between its nodes as a
by-value parameter, `atlas::ArenaOffsets<N> atlas_off` (read from the constant bank), and each of its
launches passes its own (Launch.args):
- an offset equal in every node (the dims buffer, the scratch, an activation buffer the plan reuses in
  every layer) stays a literal;
- offsets that move together from node to node (one layer's weights) share one argument, the first of
  them, and the others are literals from it: `arena + (atlas_off.v[k] + 4096LL)`. So the compiler still
  sees pointers at constant distances from one base, not one unrelated pointer per tensor (with one
  argument per offset, Llama-3.2-1B's batch-1 gate/up projections ran 8% slower and o + down together 6.5%;
  in this form gate/up and o run as fast as per node, docs/perf.md v21).
A kernel of one node keeps its literals and its one-argument signature. A decode step's kernels generated for
one row (batch 1) are never shared (`share_kernels(alone=...)`): even in this form, Llama-3.2-1B's batch-1 down
projection and fused QKV + rotary kernels ran 8-9% slower shared, its step 3.5% (docs/perf.md v21), 2.9-3.0% in
an alternated A/B (v22), while at batch 8 the shared kernels were as fast. Nsight Compute (v22): the shared down
projection executes 6.7% more instructions with 80 registers instead of 72; ptxas lays it out differently
(sm90 SASS: 54 more instructions before the MMA loop, a loop 34 shorter), why that is slower is not pinned down.

ATLAS_SHARE_KERNELS=0 turns the sharing off (every node its own kernel, as before), =all shares the batch-1
decode kernels too: for A/B runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from atlasc.codegen.cexpr import comment_text
from atlasc.errors import env_choice

OFFSET = re.compile(r"arena \+ (\d+)LL")
COMMENT_LINE = re.compile(r"^[ \t]*//[^\n]*\n?", re.M)
SIGNATURE = "(unsigned char* __restrict__ arena)"
SHARE_ENV = "ATLAS_SHARE_KERNELS"


def _share_setting() -> str:
    """ATLAS_SHARE_KERNELS: "1" (also when unset), "0" or "all"; CodegenError otherwise."""
    from atlasc.codegen.generate import CodegenError  # generate imports this module

    return env_choice(SHARE_ENV, "1", ("0", "1", "all"), "a sharing mode", CodegenError)


def share_enabled() -> bool:
    """ATLAS_SHARE_KERNELS: on unless set to 0."""
    return _share_setting() != "0"


def share_batch1() -> bool:
    """ATLAS_SHARE_KERNELS=all: a decode step's batch-1 kernels are shared too (by default they stay per node)."""
    return _share_setting() == "all"


def share_choice() -> bool | str:
    """What the report records: True (the default), False (=0) or "all"."""
    return "all" if share_batch1() else share_enabled()


@dataclass(frozen=True)
class Shared:
    """What a generated kernel became: the kernel its node launches and the offsets it passes."""

    kernel: str
    args: tuple[int, ...] = ()


def _key(name: str, text: str) -> tuple[str, tuple[int, ...]] | None:
    """(text without the kernel's name, comment lines and offsets; the offsets in order), or None when an
    offset lies outside the kernel's body (in a namespace-scope preamble, where no parameter reaches)."""
    offsets = tuple(int(m) for m in OFFSET.findall(text))
    text = COMMENT_LINE.sub("", re.sub(rf"\b{re.escape(name)}\b", "@KERNEL@", text))
    body = text.find(SIGNATURE + " {")
    if body < 0 or OFFSET.search(text, 0, body) or len(OFFSET.findall(text)) != len(offsets):
        return None  # (the last: an offset in a comment, which would shift the others' numbering)
    return OFFSET.sub("arena + @OFFSET@", text), offsets


def _parameterized(text: str, offsets: list[tuple[int, ...]]) -> tuple[str, list[tuple[int, ...]]]:
    """The kernel's text for nodes with these offsets (one tuple per node, in text order) and each node's
    arguments: offsets equal in every node stay literals; the others, grouped by how they move from the
    first node on, read the group's first offset from atlas_off.v[k] plus a literal distance."""
    first = offsets[0]
    moves = [tuple(o[i] - first[i] for o in offsets) for i in range(len(first))]
    bases: dict[tuple[int, ...], int] = {}  # how a set of offsets moves -> its argument
    leaders: list[int] = []  # the occurrence whose offset is each argument
    for i, move in enumerate(moves):
        if any(move) and move not in bases:
            bases[move] = len(leaders)
            leaders.append(i)
    if not leaders:
        return text, [() for _ in offsets]
    occurrence = iter(range(len(first)))

    def address(_match) -> str:
        i = next(occurrence)
        if not any(moves[i]):
            return f"arena + {first[i]}LL"
        k = bases[moves[i]]
        distance = first[i] - first[leaders[k]]
        return f"arena + (atlas_off.v[{k}] {'-' if distance < 0 else '+'} {abs(distance)}LL)" if distance else \
            f"arena + atlas_off.v[{k}]"

    text = OFFSET.sub(address, text)
    text = text.replace(SIGNATURE, f"(unsigned char* __restrict__ arena, const atlas::ArenaOffsets<{len(leaders)}> "
                                   "atlas_off)")
    return text, [tuple(o[i] for i in leaders) for o in offsets]


def share_kernels(kernels: list[tuple[str, str, str]], alone: frozenset[str] | set[str] = frozenset()) \
        -> tuple[list[str], dict[str, Shared]]:
    """kernels: (kernel name, its node's name, text) in source order, names distinct; `alone`: names never
    shared.

    Returns the texts to emit (in the order of each group's first kernel) and, for every input name, the
    kernel its launches use and their arguments. Guarantees: a launch of a shared kernel with its args
    computes exactly what the node's own kernel would (the texts differ only in where the offsets come
    from); an unshared kernel's text is returned unchanged."""
    if not share_enabled():
        return [text for _, _, text in kernels], {name: Shared(name) for name, _, _ in kernels}
    groups: dict[object, list[tuple[str, str, str, tuple[int, ...]]]] = {}  # in source order of first kernels
    for name, node, text in kernels:
        key = None if name in alone else _key(name, text)
        # an unshareable kernel is a group of its own
        groups.setdefault(("alone", name) if key is None else key[0], []).append(
            (name, node, text, () if key is None else key[1]))
    texts, launch = [], {}
    for members in groups.values():
        first, _, text, _ = members[0]
        if len(members) == 1:
            texts.append(text)
            launch[first] = Shared(first)
            continue
        nodes = ", ".join(node for _, node, _, _ in members)
        shared, args = _parameterized(text, [m[3] for m in members])
        texts.append(f"// one kernel for {len(members)} nodes: {comment_text(nodes)}\n" + shared)
        for (name, *_), node_args in zip(members, args):
            launch[name] = Shared(first, node_args)
    return texts, launch
