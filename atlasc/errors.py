"""Typed errors of atlasc.

Every error a user can cause is an `AtlasError`: a one-line message plus an optional hint. The CLI
catches `AtlasError` at one boundary, prints `error: <message>` (and `hint: <hint>`) on stderr and
exits with code 2; `--debug` shows the traceback instead. Anything else escaping is a bug in atlasc.
"""

from __future__ import annotations


class AtlasError(Exception):
    """Base class: a user-facing error with a one-line message and an optional hint."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class ModelLoadError(AtlasError):
    """The ONNX file is missing, malformed, truncated, or its external data cannot be read safely."""


class UnsupportedModelError(AtlasError):
    """The model uses ops (or op variants) atlasc cannot import. Lists every one of them at once."""

    def __init__(self, unsupported: list[tuple[str, str, str]], hint: str | None = None):
        # unsupported: (op_type with domain, opset, one node name) per distinct op
        self.unsupported = unsupported
        parts = [f"{op} (opset {opset}, e.g. node '{node}')" for op, opset, node in unsupported]
        super().__init__(
            f"unsupported ONNX op{'s' if len(parts) != 1 else ''}: " + ", ".join(parts),
            hint or "open an issue with the model's exporter and these op names",
        )


class ShapeError(AtlasError):
    """Shapes or dtypes do not fit an op's rule, or a symbolic dim cannot be resolved."""


class InputError(AtlasError):
    """Inputs given at run time do not match the graph's signature (names, dtypes, shapes)."""


class VerificationError(AtlasError):
    """The IR verifier found a malformed graph; the message names the node."""


class UsageError(AtlasError):
    """Bad command-line input (a missing file, a malformed option value)."""


class ArtifactError(AtlasError):
    """An `.atlas` file cannot be written or read: not a zip, truncated, tampered, newer format, no cubin."""


def env_choice(name: str, default: str, allowed: tuple[str, ...], what: str,
               error: type[AtlasError] = UsageError) -> str:
    """The setting `name` from the environment, one of `allowed` (unset or empty gives `default`); any other value
    raises `error` naming the variable and `what` it should be (exit 2)."""
    import os

    value = os.environ.get(name, "") or default
    if value not in allowed:
        raise error(f"{name}={value!r} is not {what} (expected {', '.join(allowed[:-1])} or {allowed[-1]})")
    return value


def env_switch(name: str, default: bool, error: type[AtlasError] = UsageError) -> bool:
    """The 0 / 1 switch `name` from the environment (the ATLAS_* variables for A/B timing and opt-in paths): unset
    or empty gives `default`, "1" True, "0" False; any other value raises `error` naming the variable (exit 2)."""
    import os

    value = os.environ.get(name, "") or str(int(default))
    if value not in ("0", "1"):
        raise error(f"{name}={value!r} is not 0 or 1")
    return value == "1"
