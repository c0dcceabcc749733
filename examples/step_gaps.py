"""Where the time between two pipelined decode steps goes, measured with CUDA events on the streams.

`atlasc bench` runs decode steps back to back (GpuModel.submit: per step the staged input copy (dims and inputs),
the device copy of the previous tokens where they are not in place, the step's CUDA graph, the tokens' copy back,
on a second stream by default: ATLAS_COPY_STREAM). Its ms/step exceeds the step replayed alone
(examples/replay_ab.py) by ~20-25 us (docs/perf.md v18). This runs one generate() with an event recorded on its
stream before and after every one of those operations and prints, as medians over the decode steps, how long each
took on the GPU and how long the main stream sat before it (operations on the copy stream: their time only). The
events are stream work of their own, so the sum runs a little above the uninstrumented step (printed beside it).

    python examples/step_gaps.py model.atlas --batch 1 --prompt 128 --gen 64

It times the copies' path: ATLAS_MAPPED_STAGING is 0 here unless set (with mapped staging, the default since
docs/perf.md v24, a step has no copies: examples/staging_ab.py compares the two paths).

GPU machine only (pycuda)."""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import numpy as np

from atlasc.artifact import open_artifact
from atlasc.runtime.device import Device
from atlasc.runtime.generate import generate
from atlasc.runtime.gpu import GpuModel


class _Recorder:
    """Stands in for pycuda.driver on the model's Device: every async copy is bracketed by two events on the
    stream it is issued on (its last argument)."""

    def __init__(self, cuda, stream):
        self._cuda, self._stream = cuda, stream
        # (label of the operation that starts, or "end"; event; whether on the main stream), in issue order
        self.marks: list[tuple[str, object, bool]] = []
        self.on = False

    def mark(self, label: str, stream=None) -> None:
        if self.on:
            event = self._cuda.Event()
            event.record(stream or self._stream)
            self.marks.append((label, event, stream is None or stream is self._stream))

    def _wrap(self, name: str, label: str):
        fn = getattr(self._cuda, name)

        def call(*args, **kwargs):
            stream = kwargs.get("stream", args[-1] if args else None)
            main = stream is None or stream is self._stream
            self.mark(label if main else f"{label} (copy stream)", stream)
            result = fn(*args, **kwargs)
            self.mark("end", stream)
            return result
        return call

    def __getattr__(self, name):
        labels = {"memcpy_htod_async": "copy host to device", "memcpy_dtod_async": "copy device to device",
                  "memcpy_dtoh_async": "copy device to host"}
        return self._wrap(name, labels[name]) if name in labels else getattr(self._cuda, name)


def measure(model: GpuModel, batch: int, prompt: int, gen: int, seed: int = 0) -> None:
    """Print the median GPU time of each operation of a decode step and of the idle time before it."""
    vocab = int(model.manifest.entries["prefill"].outputs[0].shape[-1])
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(1, vocab, size=prompt)) for _ in range(batch)]
    generate(model, prompts, min(gen, 4))  # warm up: graphs captured
    plain = generate(model, prompts, gen)
    rec = _Recorder(model.dev.cuda, model.dev.stream)
    model.dev.cuda = rec
    enqueue = model.enqueue

    def traced(entry: str) -> None:
        rec.mark(f"graph {model.routed.get(entry, entry)}")
        enqueue(entry)
        rec.mark("end")
    model.enqueue = traced
    rec.on = True
    try:
        generate(model, prompts, gen)
    finally:
        rec.on = False
        model.dev.cuda = rec._cuda
        model.enqueue = enqueue
    model.dev.stream.synchronize()
    marks = rec.marks
    # one cycle: from a decode graph's start to the next one's. Every operation is a start mark with its end mark
    # right after it (issue order); on the main stream the gap from the previous main operation's end is idle time
    starts = [i for i, (label, _, _) in enumerate(marks) if label.startswith("graph decode")]
    cycles: list[list[tuple[str, float]]] = []
    for a, b in zip(starts, starts[1:]):
        cycle, last_end, last = [], None, ""
        for i in range(a, min(b + 1, len(marks) - 1)):
            label, event, main = marks[i]
            if label == "end" or (i == b and last_end is None):
                continue
            if main and last_end is not None:
                cycle.append((f"idle after {last}", event.time_since(last_end) * 1e3))
            if i == b:
                break
            cycle.append((label, marks[i + 1][1].time_since(event) * 1e3))
            if main:
                last_end, last = marks[i + 1][1], label
        cycles.append(cycle)
    cycles = cycles[2:]  # the first steps still fill the pipeline
    shape = max({tuple(k for k, _ in c) for c in cycles}, key=lambda s: sum(tuple(k for k, _ in c) == s
                                                                           for c in cycles))
    same = [c for c in cycles if tuple(k for k, _ in c) == shape]
    step_ms = statistics.median(plain.decode_seconds) * 1e3
    total = statistics.median(sum(us for k, us in c if not k.endswith("(copy stream)")) for c in same)  # main
    print(f"batch {batch}, prompt {prompt}, {gen} tokens: {len(same)} of {len(cycles)} steps in this order "
          f"(medians, us)")
    for n, label in enumerate(shape):
        print(f"  {label:36s} {statistics.median(c[n][1] for c in same):9.2f}")
    print(f"  {'one step, instrumented':36s} {total:9.2f}")
    print(f"  {'one step, generate() without events':36s} {step_ms * 1e3:9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    args = ap.parse_args()
    os.environ.setdefault("ATLAS_MAPPED_STAGING", "0")  # the copies' path (read at load)
    model = GpuModel(open_artifact(args.artifact), device=Device())
    measure(model, args.batch, args.prompt, args.gen)


if __name__ == "__main__":
    main()
