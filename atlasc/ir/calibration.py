"""The calibration prompts of `--calib prompts.npz`, read and checked once for every reader.

The quantization accuracy report (atlasc/accuracy.py load_calibration) and the passes that run the float graph on
the prompts (--gptq, --smooth: passes/gptq.py load_feeds) read the same file: `read_npz` opens it (never
unpickling), `check_token_ids` checks its token ids, both raising UsageError naming the file.
"""

from __future__ import annotations

import zipfile

import numpy as np

from atlasc.errors import UsageError
from atlasc.ir.graph import Graph

ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first local header, or the end record of an empty one


def read_npz(path) -> dict[str, np.ndarray]:
    """Every array of the calibration .npz at path, by name."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise UsageError(f"calibration file {path} cannot be read: {e.strerror or e}") from None
    if magic not in ZIP_MAGIC:
        raise UsageError(f"calibration file {path} is not an .npz archive",
                         hint="write it with numpy.savez(path, input_ids=ids)")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: np.asarray(z[k]) for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise UsageError(f"calibration file {path} is not a readable .npz: {e}") from None


def token_ids(path, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """The token-id array of a calibration .npz's arrays: `input_ids`, or the only array (np.savez(path, ids) names
    it arr_0); UsageError otherwise."""
    key = "input_ids" if "input_ids" in arrays else (next(iter(arrays)) if len(arrays) == 1 else None)
    if key is None:
        raise UsageError(f"calibration file {path} needs an `input_ids` array")
    return arrays[key]


def check_token_ids(ids: np.ndarray, vocab: int | None, max_seq: int | None = None) -> np.ndarray:
    """The calibration token ids as int64 [prompts, length]: a non-empty 2-D integer array of ids in [0, vocab)
    (vocab None: only >= 0), at most max_seq long; UsageError otherwise."""
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or ids.size == 0:
        raise UsageError(f"calibration input_ids must be a non-empty 2-D integer array [prompts, length], "
                         f"got {ids.dtype}{list(ids.shape)}")
    if max_seq is not None and ids.shape[1] > max_seq:
        raise UsageError(f"calibration prompts have {ids.shape[1]} tokens, more than --max-seq {max_seq}")
    lo, hi = ids.min(), ids.max()
    if lo < 0 or (vocab is not None and hi >= vocab):
        bound = f"[0, {vocab})" if vocab is not None else "[0, vocab)"
        raise UsageError(f"calibration token ids must lie in {bound}, got [{lo}, {hi}]")
    return ids.astype(np.int64)


RESHAPES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")


def embedding_rows(graph: Graph, name: str = "input_ids") -> int | None:
    """The rows of the constant embedding table that the graph input `name` indexes (through reshapes): the
    vocabulary its token ids must lie in; None when no such Gather reads it."""
    ids = {id(v) for v in graph.inputs if v.name == name}
    for node in graph.nodes:  # topological: a reshape of the ids comes before its reader
        if node.op in RESHAPES and node.inputs and node.inputs[0] is not None and id(node.inputs[0]) in ids:
            ids.add(id(node.outputs[0]))
        elif (node.op == "Gather" and id(node.inputs[1]) in ids and node.inputs[0].is_constant
              and node.inputs[0].shape):
            return int(node.inputs[0].shape[node.attrs.get("axis", 0) % len(node.inputs[0].shape)])
    return None
