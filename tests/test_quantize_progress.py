"""Quantizing reports progress (issue 6: an 8B quantization takes a while): the compile driver's
callback gets a `quantize` event when each weight starts and one as each of its row chunks completes, with
(bytes done, total bytes, "bytes"), monotonic, ending at the total, and the CLI draws it as a bar (or as lines with the
amounts in B / KiB / MiB / GiB: tests/test_progress_lines.py); the detail names the mode and the weight only."""

from __future__ import annotations

from atlasc.frontend import import_onnx
from atlasc.ir.program import CompileOptions, Program
from atlasc.pipeline import run_pipeline

from conftest import FIXTURES


def test_quantize_reports_bytes_done_per_weight():
    events = []
    program = Program({"main": import_onnx(FIXTURES / "llama.onnx")}, CompileOptions(quant="int4", group_size=16),
                      progress=lambda stage, detail, done=None: events.append((stage, detail, done)))
    program, _ = run_pipeline(program)
    quant = [e for e in events if e[0] == "quantize"]
    layers = program.quantization["layers"]
    done = [e[2][0] for e in quant]
    totals = {e[2][1] for e in quant}
    assert totals == {program.quantization["bytes_before"]}
    assert done[0] == 0 and done == sorted(done) and done[-1] == totals.pop()
    # each weight: a start event, then its chunks (the fixture's weights are one chunk each)
    names = [f"int4 {rec['weight']}" for rec in layers]
    assert [e[1] for e in quant] == [n for n in names for _ in range(2)]
    assert {e[2][2] for e in quant} == {"bytes"}


def test_a_large_weight_reports_its_chunks(monkeypatch):
    """Progress within one weight (before, a weight was one event however long it took; an 8B model's LM head is
    one 1 GB weight): one event per row chunk, in order, with the rows done."""
    import numpy as np

    from atlasc.passes import quantize as q

    monkeypatch.setattr(q, "CHUNK_ELEMENTS", q.CHUNK_MIN_ROWS * 256)  # chunks of CHUNK_MIN_ROWS rows at K = 256
    w = np.random.default_rng(0).standard_normal((q.CHUNK_MIN_ROWS * 5 + 7, 256)).astype(np.float16)
    rows = []
    q._quantize_layer(w, "int4", 128, seed=0, on_rows=rows.append)
    assert rows == [q.CHUNK_MIN_ROWS * i for i in range(1, 6)] + [w.shape[0]], rows
