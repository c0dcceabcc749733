"""The kernel families: importing this module registers every emitter.

TEMPLATES lists each family's `.cu` file (beside its Python), included in every generated module.
"""

from atlasc.codegen import elementwise  # noqa: F401  (registers emitters)

TEMPLATES = ["elementwise"]

from atlasc.codegen import attention, matmul  # noqa: E402, F401  (registers emitters)

TEMPLATES += ["matmul", "attention"]

from atlasc.codegen import movement, reduce  # noqa: E402, F401  (registers emitters)

TEMPLATES += ["reduce", "movement"]

from atlasc.codegen import sampling  # noqa: E402, F401  (registers emitters)

TEMPLATES += ["sampling"]

from atlasc.codegen import fused  # noqa: E402, F401  (registers emitters)

TEMPLATES += ["fused"]

from atlasc.codegen import linear  # noqa: E402, F401  (registers emitters; linear.cu uses matmul.cu)

TEMPLATES += ["linear"]

from atlasc.codegen import flash_attention  # noqa: E402, F401  (attention.py calls it; its .cu uses linear.cu's lin_mma)

TEMPLATES += ["flash_attention"]

from atlasc.codegen import gemm  # noqa: E402, F401  (linear.py calls it; its .cu uses linear.cu and flash_attention.cu)

TEMPLATES += ["gemm"]


from atlasc.codegen import quant  # noqa: E402, F401  (registers emitters; quant.cu uses linear.cu)

TEMPLATES += ["quant", "act_int8"]  # act_int8.cu uses quant.cu and linear.cu

from atlasc.codegen import linear_prologue  # noqa: E402, F401  (registers emitters; uses linear.cu, quant.cu)

from atlasc.codegen import linear_epilogue  # noqa: E402, F401  (registers emitters; uses linear.cu)

TEMPLATES += ["linear_tma"]  # linear_tma.py's kernel (linear.py and linear_epilogue.py call it; uses linear.cu)

TEMPLATES += ["quant_bulk"]  # quant_bulk.py's kernel (quant.py calls it; uses linear_tma.cu and quant.cu)

TEMPLATES += ["quant_chain"]  # quant_chain.py's kernel (generate.py chains quant_bulk.py's kernels; uses quant_bulk.cu)
