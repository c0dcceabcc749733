"""The kernel families: importing this module registers every emitter.

TEMPLATES lists each family's `.cu` file (beside its Python), included in every generated module.
"""

from atlasc.codegen import elementwise  # noqa: F401  (registers emitters)

TEMPLATES = ["elementwise"]
