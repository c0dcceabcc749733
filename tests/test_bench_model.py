"""The byte count behind `atlasc bench`'s roofline (CPU: it reads only the manifest)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from atlasc.artifact import open_artifact
from atlasc.compiler import compile_model
from atlasc.ir.program import CompileOptions
from atlasc.runtime.bench import _gathered_tables, decode_bytes

from conftest import FIXTURES


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_decode_bytes_counts_weights_once_embedding_rows_and_the_cache(tmp_path):
    path = tmp_path / "llama.atlas"
    compile_model(FIXTURES / "llama.onnx", path, CompileOptions(archs=("sm80",), max_batch=4, max_seq=64))
    with open_artifact(path) as art:
        m = art.manifest
        tables = _gathered_tables(m)
        assert len(tables) == 1  # the token embedding: read by Gather only
        (name, row), = tables.items()
        table = next(w for w in m.weights if w.name == name)
        assert row == table.nbytes // table.shape[0] == table.shape[1] * 4
        others = sum(w.nbytes for w in m.weights if w.name != name)
        kv = m.kv_cache
        per_token = 2 * kv.layers * kv.kv_heads * kv.head_dim * np.dtype(kv.dtype).itemsize
        assert decode_bytes(m, 1, 10) == others + row + 10 * per_token
        assert decode_bytes(m, 3, 20) == others + 3 * row + 3 * 20 * per_token
