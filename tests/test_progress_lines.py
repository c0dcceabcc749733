"""`atlasc compile`'s progress when stderr is not a terminal (atlasc/cli/compile_cmd.py `_ProgressLines`) and the
events behind it: amounts in B / KiB / MiB / GiB with a percentage (no raw byte counts), a line when a stage starts
and at most one per `EVERY` seconds while it counts its work, a held step printed by the clock alone; the accuracy
report's sub-steps; nvcc's cubins as they finish. A fake clock, no sleeping."""

from __future__ import annotations

import io
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from rich.console import Console

from atlasc.accuracy import accuracy_report
from atlasc.cli.compile_cmd import _ProgressLines
from atlasc.codegen.nvcc import _map_waking
from atlasc.frontend import import_onnx
from atlasc.ir.program import CompileOptions, Program
from atlasc.pipeline import run_pipeline

from conftest import FIXTURES, PROGRESS_LINE


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def progress_lines(clock) -> tuple[_ProgressLines, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, highlight=False, soft_wrap=True, markup=False)  # as the CLI's _err()
    return _ProgressLines(console, clock=clock), out


def test_amounts_have_adaptive_units_and_a_percentage():
    clock = FakeClock()
    log, out = progress_lines(clock)
    log.update("quantize", "int4 l0_wq", (0, 768606208, "bytes"))
    log.update("pass", "merge-linear", None)
    log.update("quantize", "int4 tiny", (1536, 360448, "bytes"))
    log.update("nvcc", "cubins built", (1, 2))
    lines = out.getvalue().splitlines()
    assert all(PROGRESS_LINE.match(ln) for ln in lines)
    assert [ln.split("] ", 1)[1] for ln in lines] == [
        "quantize: int4 l0_wq (0 B of 733.0 MiB, 0%)",
        "pass: merge-linear",
        "quantize: int4 tiny (1.5 KiB of 352.0 KiB, 0%)",
        "nvcc: cubins built (1 of 2, 50%)",
    ]
    assert not re.search(r"\d+/\d+", out.getvalue())  # the old line ended in a raw "(0/768606208)"


def test_a_counted_stage_prints_at_most_every_interval_and_a_held_step_on_time():
    clock = FakeClock()
    log, out = progress_lines(clock)
    every = _ProgressLines.EVERY

    def said() -> list[str]:
        return [ln.split("] ", 1)[1] for ln in out.getvalue().splitlines()]

    log.update("pass", "quantize", None)
    log.update("quantize", "int4 w0", (0, 400, "bytes"))  # a new stage: at once
    for i in range(1, 4):
        clock.now += 1
        log.update("quantize", f"int4 w{i}", (100 * i, 400, "bytes"))  # held: the stage printed 1-3 s ago
    assert said() == ["pass: quantize", "quantize: int4 w0 (0 B of 400 B, 0%)"]
    clock.now += every - 3.1
    log.tick()
    assert len(said()) == 2
    clock.now += 0.1
    log.tick()  # EVERY seconds since the last line: the latest held step, with no new event needed
    assert said()[2:] == ["quantize: int4 w3 (300 B of 400 B, 75%)"]
    assert out.getvalue().splitlines()[-1].startswith(f"[{every:7.1f} s]")
    clock.now += 60  # one weight for a minute: one line for it, not one per tick
    log.tick()
    assert len(said()) == 3
    log.update("quantize", "int4 w3", (300, 400, "bytes"))  # a repeat: dropped
    clock.now += 1
    log.update("quantize", "int4 lm_head", (350, 400, "bytes"))  # due already: at once
    assert said()[3:] == ["quantize: int4 lm_head (350 B of 400 B, 88%)"]
    clock.now += 1
    log.update("quantize", "int4 last", (399, 400, "bytes"))  # held, then superseded by the next stage
    log.update("pass", "merge-linear", None)
    clock.now += 60
    log.tick()
    assert said()[4:] == ["pass: merge-linear"]


def test_the_context_prints_a_held_step_from_its_own_thread():
    clock = FakeClock()
    log, out = progress_lines(clock)
    log.update("nvcc", "sm80: 30 kernels", None)
    log.update("nvcc", "cubins built", (1, 4))
    clock.now += _ProgressLines.EVERY
    with log:
        deadline = time.monotonic() + 30
        while "cubins built" not in out.getvalue():
            assert time.monotonic() < deadline, "the held step was never printed"
            time.sleep(0.01)
    assert out.getvalue().splitlines()[-1].endswith("nvcc: cubins built (1 of 4, 25%)")


def test_nothing_is_printed_after_the_context_ends():
    """A held step due while the context closes (its tick in flight on a slow console) is printed before __exit__
    returns or not at all: the report or the error line stays last (a review found a tick landing after it)."""
    clock = FakeClock()
    out = io.StringIO()
    entered = threading.Event()

    class SlowFile(io.StringIO):
        def write(self, text: str) -> int:
            entered.set()
            time.sleep(0.3)
            return out.write(text)

    log = _ProgressLines(Console(file=SlowFile(), highlight=False, soft_wrap=True, markup=False), clock=clock)
    log.update("nvcc", "sm80: 30 kernels", None)
    entered.clear()
    log.update("nvcc", "cubins built", (1, 4))
    clock.now += _ProgressLines.EVERY
    with log:
        assert entered.wait(30)  # the ticker is writing the held step now
    after_exit = out.getvalue()
    time.sleep(1.0)  # two of the ticker's periods
    assert out.getvalue() == after_exit and after_exit.splitlines()[-1].endswith("(1 of 4, 25%)")


def test_nvcc_reports_cubins_as_they_finish_in_the_callers_thread():
    calls = []
    with ThreadPoolExecutor(2) as pool:
        got = _map_waking(pool, lambda x: 2 * x, range(5),
                          lambda done, total: calls.append((done, total, threading.current_thread())))
    assert got == [0, 2, 4, 6, 8]
    assert [c[0] for c in calls] == sorted({c[0] for c in calls}) and calls[-1][:2] == (5, 5)
    assert {c[2] for c in calls} == {threading.current_thread()}


def test_the_accuracy_report_reports_its_prompts_and_layers():
    events = []
    program = Program({"main": import_onnx(FIXTURES / "llama.onnx")},
                      CompileOptions(max_batch=2, max_seq=32, quant="int4", group_size=16))
    program = run_pipeline(program)[0]
    ids = np.random.default_rng(1).integers(0, 256, size=(3, 12))
    report = accuracy_report(program, ids, progress=lambda stage, detail, done=None: events.append((stage, detail,
                                                                                                    done)))
    assert {e[0] for e in events} == {"accuracy"}
    details = [e[1] for e in events]
    for step in ("prompts 1-2 of 3: quantized prefill", "prompts 1-2 of 3: float prefill",
                 "prompt 3 of 3: quantized prefill", "prompt 3 of 3: float prefill"):
        assert step in details
    for layer in report["layer_rel_error_on_calibration"]:
        assert f"prompts 1-2 of 3: error of {layer}" in details and f"prompt 3 of 3: error of {layer}" in details
    done = [e[2][0] for e in events]
    assert done == sorted(done) and {e[2][1] for e in events} == {done[-1]}
