"""Binding one call's inputs to an entry point: symbols from shapes, checks against the signature."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from atlasc.artifact import EntrySpec
from atlasc.artifact.dims import dim_str, evaluate_dim, symbol_of
from atlasc.errors import InputError


def bind_entry(entry: EntrySpec, inputs: Mapping[str, np.ndarray], symbols: Mapping[str, int],
               bounds: Mapping[str, tuple[int, int]]) -> dict[str, int]:
    """Symbol values for one call of `entry`: its bindings, the given symbols, and the inputs' shapes.

    Raises InputError for missing/unknown inputs, wrong dtype or rank, inconsistent dims, or a symbol
    outside the bounds the artifact was compiled for.
    """
    env = dict(entry.bindings)
    env.update(symbols)
    names = [i.name for i in entry.inputs]
    missing = [n for n in names if n not in inputs]
    unknown = [n for n in inputs if n not in names]
    if missing or unknown:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + \
                ([f"unknown {', '.join(unknown)}"] if unknown else [])
        raise InputError(f"inputs of entry '{entry.name}' do not match: {'; '.join(parts)}",
                         hint="expected: " + ", ".join(names))
    deferred = []
    for spec in entry.inputs:
        arr = np.asarray(inputs[spec.name])
        if arr.dtype != np.dtype(spec.dtype):
            raise InputError(f"input '{spec.name}' has dtype {arr.dtype}, expected {spec.dtype}")
        if arr.ndim != len(spec.shape):
            raise InputError(f"input '{spec.name}' has rank {arr.ndim}, expected {len(spec.shape)}")
        for axis, (d, actual) in enumerate(zip(spec.shape, arr.shape)):
            name = symbol_of(d)
            if name is not None and name not in env:
                env[name] = actual
            else:
                deferred.append((spec.name, axis, d, actual))
    for name, axis, d, actual in deferred:
        want = evaluate_dim(d, env)
        if want != actual:
            rule = dim_str(d)
            expected = str(want) if rule == str(want) else f"{rule} = {want}"  # not "expected 1 = 1"
            raise InputError(f"input '{name}' dim {axis} is {actual}, expected {expected}")
    for name, (lo, hi) in bounds.items():
        if name in env and not lo <= env[name] <= hi:
            raise InputError(f"{name} = {env[name]} is outside the compiled range [{lo}, {hi}]",
                             hint="recompile with a larger --max-batch / --max-seq")
    return env


def output_shape(spec, env: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(evaluate_dim(d, env) for d in spec.shape)


def bind_call(manifest, name: str, inputs: Mapping[str, np.ndarray], symbols: Mapping[str, int],
              bounds: Mapping[str, tuple[int, int]]) -> tuple[str, dict[str, int]]:
    """(the entry that runs a call of `name`, the call's symbol values): `name` bound once (bind_entry),
    then an entry narrowing it (EntrySpec.narrows, e.g. split-decode's `decode_small`: same inputs and
    bindings) whose narrow_upper bounds hold for those values, else `name` itself. InputError for an
    unknown entry."""
    wide = manifest.entries.get(name)
    if wide is None:
        raise InputError(f"no entry point '{name}' (the artifact has {', '.join(manifest.entries)})")
    env = bind_entry(wide, inputs, symbols, bounds)
    for twin in manifest.entries.values():
        if twin.narrows == name and all(s in env and env[s] <= hi for s, hi in twin.narrow_upper.items()):
            return twin.name, env
    return name, env
