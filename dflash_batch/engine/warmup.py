"""Warm-up: compile the passes a job runs and time them, for the scheduler's cost model.

At batch 1 and at the job's batch size, over a short context (rows of slightly different lengths,
as in a job), time target passes of 1 and of ``block`` rows and one drafter pass (each once to compile, then the fastest of three: other
work on the machine only ever adds time). The first
job of a process no longer pays for compilation inside its first items, and the scheduler gets
costs measured on this machine, for this model, in this dtype.
"""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx

from . import decode
from .batch_cache import Lengths
from .scheduler import CostModel

CONTEXT = 64  # tokens each row holds while passes are timed


def measure_costs(engine, batch_size: int) -> CostModel:
    target, drafter = engine.target, engine.drafter
    block = max(engine.block_size, 2)
    targets, drafts = {}, {}
    for B in sorted({1, batch_size}):
        lengths = Lengths([0] * B)
        cache = target.make_cache(lengths)
        ids = mx.array([[(7 * i + b) % target.vocab_size for i in range(CONTEXT)] for b in range(B)])
        _, hidden = target(ids, cache)
        lengths.advance([CONTEXT - b % 4 for b in range(B)])  # rows of their own lengths, as in a job
        mx.eval(hidden)
        for T in (1, block):
            tokens = ids[:, :T]
            targets[(B, T)] = _time(lambda: target.verify(tokens, cache))
            target.rollback(cache, [T] * B)  # nothing kept back; disarms recurrent layers
        if drafter is not None and hidden is not None:
            draft_lengths = Lengths([0] * B)
            draft_cache = drafter.make_cache(draft_lengths)
            drafter.add_context(hidden, draft_cache)
            draft_lengths.advance([CONTEXT - b % 4 for b in range(B)])
            last = ids[:, :1].astype(mx.int32)
            context = hidden[:, :block]
            drafts[B] = _time(lambda: decode.draft_block(drafter, target, last, context, None, draft_cache, block - 1))
    return CostModel.fit(targets, drafts)


def _time(run: Callable, reps: int = 3) -> float:
    mx.eval(run())  # compiles
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - start)
    return min(times)
