"""The compiler's 0 / 1 switches read from the environment (ATLAS_* variables for A/B timing and opt-in paths)."""

from __future__ import annotations

import os

from atlasc.errors import AtlasError, UsageError


def env_switch(name: str, default: bool, error: type[AtlasError] = UsageError) -> bool:
    """The switch `name`: unset or empty gives `default`, "1" True, "0" False; any other value raises `error` (a
    one-line message naming the variable: exit 2 at the command line)."""
    value = os.environ.get(name, "") or str(int(default))
    if value not in ("0", "1"):
        raise error(f"{name}={value!r} is not 0 or 1")
    return value == "1"
