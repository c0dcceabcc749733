"""Quantizing reports progress (issue 6: an 8B quantization takes a while): the compile driver's
callback gets one `quantize` event per weight with (bytes done, total bytes), monotonic, ending
below the total (the last weight is being quantized), and the CLI draws it as a bar."""

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
    assert len(quant) == len(layers) > 0
    done = [e[2][0] for e in quant]
    totals = {e[2][1] for e in quant}
    assert totals == {program.quantization["bytes_before"]}
    assert done[0] == 0 and done == sorted(done) and done[-1] < totals.pop()
    assert all(rec["weight"] in e[1] for rec, e in zip(layers, quant))
