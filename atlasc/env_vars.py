"""The ATLAS_* environment variables atlasc reads (docs/cli.md describes each), and a check for names it does not.

Each variable is read, and its value checked, where it applies (a pass, a kernel family, the runtime): a variable
that does not apply to a compile is not read. A misspelt name would be ignored silently, so the command line warns
about ATLAS_* names that are not in this list (tests/test_cli.py keeps it equal to the names the code reads).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

KNOWN = frozenset({
    "ATLAS_ATTENTION_EARLY_KV", "ATLAS_ATTENTION_FA2_WARPS", "ATLAS_ATTENTION_MMA", "ATLAS_ATTENTION_PATH",
    "ATLAS_ATTENTION_PREFILL", "ATLAS_ATTENTION_SPLIT", "ATLAS_ATTENTION_SPLIT_MIN_KEYS",
    "ATLAS_ATTENTION_SPLIT_TARGET", "ATLAS_ATTENTION_VPREFETCH", "ATLAS_ATTENTION_WARPS",
    "ATLAS_ATTENTION_WARP_MERGE", "ATLAS_CACHE_DIR", "ATLAS_COPY_STREAM", "ATLAS_DIMS_EARLY", "ATLAS_EARLY_QUANT",
    "ATLAS_EARLY_WEIGHTS", "ATLAS_FUSION_ENABLED", "ATLAS_INT4_PATH", "ATLAS_INT8_L2_HINT", "ATLAS_INT8_PATH",
    "ATLAS_LINEAR_EPILOGUE",
    "ATLAS_LINEAR_FT", "ATLAS_LINEAR_KSPLIT", "ATLAS_LINEAR_PATH", "ATLAS_LINEAR_PREFILL", "ATLAS_LINEAR_TMA",
    "ATLAS_LINEAR_TMA_GATED", "ATLAS_LINEAR_TMA_HEADS", "ATLAS_LINEAR_TMA_HEADS_KS", "ATLAS_LINEAR_TMA_KS_MIN_STEPS",
    "ATLAS_LINEAR_TMA_PIPE", "ATLAS_LINEAR_TMA_PLAIN", "ATLAS_LINEAR_U", "ATLAS_MAPPED_STAGING",
    "ATLAS_MASK_LENGTHS", "ATLAS_NORM_LOADS_AHEAD", "ATLAS_NORM_VEC", "ATLAS_NVCC", "ATLAS_NVCC_CHUNK", "ATLAS_PDL",
    "ATLAS_PREFETCH", "ATLAS_PROLOGUE_ACT8_GRID", "ATLAS_PROLOGUE_MAX_GRID", "ATLAS_QUANT_BULK",
    "ATLAS_QUANT_BULK_CHAIN", "ATLAS_QUANT_BULK_CONFIG", "ATLAS_QUANT_BULK_EARLY",
    "ATLAS_QUANT_BULK_G_EARLY",
    "ATLAS_QUANT_BULK_HOLD", "ATLAS_QUANT_BULK_INFLIGHT",
    "ATLAS_QUANT_BULK_KS", "ATLAS_QUANT_BULK_LOOP", "ATLAS_QUANT_BULK_MIN_N", "ATLAS_QUANT_BULK_MIN_RUN",
    "ATLAS_QUANT_KSPLIT",
    "ATLAS_QUANT_MIN_BLOCKS", "ATLAS_QUANT_OFS", "ATLAS_QUANT_PATH", "ATLAS_QUANT_PROLOGUE", "ATLAS_QUANT_SPLIT",
    "ATLAS_QUANT_STAGED_U", "ATLAS_QUANT_THREADS", "ATLAS_QUANT_U", "ATLAS_ROTARY_EPILOGUE", "ATLAS_SAMPLE_SPLIT",
    "ATLAS_SHARE_KERNELS", "ATLAS_SPLIT_DECODE", "ATLAS_TMA_NORM", "ATLAS_W4A8_PATH", "ATLAS_W8A8_EARLY",
})


# read by the repository's tests and scripts, not by the package (tests/conftest.py, examples/gpu_cache.py, the
# codegen snapshot tests): set while they run atlasc, so not warned about
REPOSITORY_TOOLS = frozenset({"ATLAS_GPU_PRECOMPILE", "ATLAS_UPDATE_SNAPSHOTS"})


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One warning per ATLAS_* name in `environ` that atlasc does not read, with the closest known name."""
    warnings = []
    for name in sorted(n for n in environ if n.startswith("ATLAS_") and n not in KNOWN | REPOSITORY_TOOLS):
        close = difflib.get_close_matches(name, KNOWN, n=1, cutoff=0.85)
        warnings.append(f"{name} is not a variable atlasc reads (ignored)" + (f"; did you mean {close[0]}?" if close
                                                                                else ""))
    return warnings
