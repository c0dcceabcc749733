"""Recognizing a decoder's I/O roles from its ONNX signature.

LLM exports name their inputs by convention (Hugging Face, Optimum, torch.onnx): `input_ids`,
`attention_mask`, `position_ids`, `past_key_values.{i}.key|value` (or `past.{i}.key`, `past_key.{i}`)
and outputs `present.{i}.key|value`. The roles fix one relation no ONNX shape states: the mask
covers the past and the new tokens, so its length is `past_seq + seq`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PAST_PATTERNS = [
    re.compile(r"^past_key_values[._](?P<layer>\d+)[._](?P<kind>key|value)$"),
    re.compile(r"^past[._](?P<layer>\d+)[._](?P<kind>key|value)$"),
    re.compile(r"^past_(?P<kind>key|value)[._](?P<layer>\d+)$"),
]
PRESENT_PATTERNS = [
    re.compile(r"^present[._](?P<layer>\d+)[._](?P<kind>key|value)$"),
    re.compile(r"^present_(?P<kind>key|value)[._](?P<layer>\d+)$"),
]


def _match(patterns, name):
    for p in patterns:
        m = p.match(name)
        if m:
            return int(m["layer"]), m["kind"]
    return None


@dataclass
class DecoderSignature:
    """Names of a decoder's inputs/outputs by role; `past[i] = (key name, value name)`."""

    input_ids: str | None = None
    attention_mask: str | None = None
    position_ids: str | None = None
    past: dict[int, tuple[str, str]] = field(default_factory=dict)
    present: dict[int, tuple[str, str]] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.past)


def detect_decoder(input_names: list[str], output_names: list[str]) -> DecoderSignature | None:
    """The decoder roles, or None when the signature has no complete KV-cache (key and value per layer)."""
    sig = DecoderSignature()
    past: dict[int, dict[str, str]] = {}
    for name in input_names:
        if name == "input_ids":
            sig.input_ids = name
        elif name == "attention_mask":
            sig.attention_mask = name
        elif name == "position_ids":
            sig.position_ids = name
        elif (hit := _match(PAST_PATTERNS, name)) is not None:
            past.setdefault(hit[0], {})[hit[1]] = name
    present: dict[int, dict[str, str]] = {}
    for name in output_names:
        if (hit := _match(PRESENT_PATTERNS, name)) is not None:
            present.setdefault(hit[0], {})[hit[1]] = name
    if not past or any(len(kv) != 2 for kv in past.values()):
        return None
    sig.past = {i: (kv["key"], kv["value"]) for i, kv in sorted(past.items())}
    sig.present = {i: (kv["key"], kv["value"]) for i, kv in sorted(present.items()) if len(kv) == 2}
    return sig
