"""Quantizing reports progress (issue 6: an 8B quantization takes a while): the compile driver's
callback gets one `quantize` event per weight with (bytes done, total bytes, "bytes"), monotonic, ending
below the total (the last weight is being quantized), and the CLI draws it as a bar (or as lines with the
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
    assert len(quant) == len(layers) > 0
    done = [e[2][0] for e in quant]
    totals = {e[2][1] for e in quant}
    assert totals == {program.quantization["bytes_before"]}
    assert done[0] == 0 and done == sorted(done) and done[-1] < totals.pop()
    assert [e[1] for e in quant] == [f"int4 {rec['weight']}" for rec in layers]
    assert {e[2][2] for e in quant} == {"bytes"}
