"""atlasc.codegen: CUDA source generation from a scheduled, memory-planned IR graph, and nvcc.

Depends on atlasc.ir only. Kernel templates are `.cu` files beside the Python that fills them.
"""

from atlasc.codegen.generate import GeneratedModule, Launch, generate_module

__all__ = ["GeneratedModule", "Launch", "generate_module"]
