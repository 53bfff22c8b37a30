"""Rows in flight when a job is one stream, against the same job cut into windows that each drain
the batch (what ``Engine.generate_requests`` did before it pulled requests as slots freed up):
``python -m benchmarks.stream_fill``.

Both arms decode the same requests (random weights of ``--shape``, the random drafter, greedy,
budgets 4..40 tokens) at batch ``--batch``: ``windowed`` calls ``generate_requests`` once per
``--window`` requests, ``stream`` once for all. Counted per arm: cycles, mean rows per cycle,
cycles with a free slot; and the job's seconds (median of ``--reps``, the arms alternating).
On a CPU a cycle's cost grows with its rows, so the seconds say little there: the counts are the
result; the throughput gain needs a GPU, where a cycle of B rows costs about one of fewer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import dflash_batch.engine  # noqa: F401  (BLAS preload before mlx on Linux CPU)
from dflash_batch.engine import Engine
from dflash_batch.engine.batch import BatchDecoder

import mlx.core as mx

from dflash_batch.request import Options, Request

from . import arms


def _requests(count: int, vocab: int):
    return [Request(f"r{i}", [(7 * i + j) % (vocab - 2) + 1 for j in range(8 + i % 24)], Options(max_tokens=4 + (i * 7) % 37))
            for i in range(count)]  # fmt: skip


def _run(engine: Engine, requests, batch: int, window: int, rows: list) -> float:
    """One arm: ``window`` 0 is the stream; returns seconds, ``rows`` gets each cycle's live rows."""
    started = time.perf_counter()
    cuts = (
        [requests]
        if not window
        else [requests[i : i + window] for i in range(0, len(requests), window)]
    )
    for part in cuts:
        for _, outcome in engine.generate_requests(iter(part), batch):
            assert not isinstance(outcome, Exception), outcome
    return time.perf_counter() - started


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-tiny")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--window", type=int, default=12)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    setup = arms.engine_setup(arms.build_setup(args.shape, mx.float32, with_ar_draft=False))
    engine = Engine(
        setup.model, setup.tokenizer, setup.drafter, config=arms.text_config(setup.shape.target)
    )
    requests = _requests(args.requests, arms.text_config(setup.shape.target)["vocab_size"])
    rows: list = []
    run = BatchDecoder.run

    def counted(decoder, width):
        rows.append(sum(r is not None for r in decoder.rows))
        return run(decoder, width)

    BatchDecoder.run = counted
    _run(
        engine, requests[: args.batch], args.batch, 0, rows
    )  # warm-up: compile and time the passes
    result = {}
    for _ in range(args.reps):
        for name, window in (("windowed", args.window), ("stream", 0)):
            rows.clear()
            seconds = _run(engine, requests, args.batch, window, rows)
            arm = result.setdefault(name, {"seconds": []})
            arm["seconds"].append(round(seconds, 3))
            arm.update(cycles=len(rows), mean_rows=round(sum(rows) / len(rows), 3),
                       cycles_with_a_free_slot=sum(r < args.batch for r in rows))  # fmt: skip
    for arm in result.values():
        arm["median_seconds"] = statistics.median(arm["seconds"])
    print(
        json.dumps(
            {
                "shape": args.shape,
                "requests": args.requests,
                "batch": args.batch,
                "window": args.window,
                **result,
            }
        )
    )


if __name__ == "__main__":
    main()
