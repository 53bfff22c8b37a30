"""Where the host time of one batched decoding cycle goes: ``python -m benchmarks.cycle_host``.

A job of ``--batch`` rows (random weights of ``--shape``, fp32, greedy, every row the same budget)
decodes through ``BatchDecoder.steps()`` with its pieces wrapped in timers. Each piece is timed
exclusive of the timed pieces it calls, so the pieces add up to the cycle:

  device            the wait at the cycle's sync (``mx.eval`` of the chosen tokens), wall time: the
                    passes computing. Everything else is Python on the host (MLX only builds
                    graphs), timed in the thread's CPU time
  width_policy.width (adaptive, on the side)  the adaptive width policy's width choice over the live rows (timed on the side:
                    the job itself verifies the whole block every cycle, so that every cycle has
                    the same shape)
  draft / verify / choose   building the drafter, target and sampling graphs
  accept_lengths, rollback, lengths, pack_context, accepted (width policy), commit
  run: rest         the rest of ``run``: limits, the last-token array, per-row Steps
  feed              ``RowOutput.feed``: EOS, detokenising, stop strings, statistics
  postprocess: rest ``_emit`` and the loop around ``feed``
  admit, shrink     the step's admission check and shrink check (nothing waiting)

``--acceptance full`` (target and drafter choose token 0 everywhere: every draft accepted, the
whole block committed per row per cycle), ``random`` (the random drafter: about one token per
cycle) or ``tau=X`` (scripted: X tokens per cycle on average, benchmarks/scripted.py). Prints
one JSON line per batch size: ms per cycle per piece, the device wait, and host = the rest.
``--whole``: whole jobs instead, nothing wrapped, the adaptive width policy choosing the widths:
the engine's decode tokens per second.
On a shared CPU only ratios mean anything; on a GPU the host share is GPU idle time.

Measured (shared 2-core CPU VM, 2026-11-23, qwen3-tiny fp32, block 16, full acceptance: 16 tokens
per row per cycle; ``--reps 3 --max-tokens 160``, the code before this benchmark's branch and
after it (a7fbffb) run alternately three times, medians; docs/results/cycle-host-*-cpu-2026-11-23.jsonl),
host ms per cycle, before -> after:

  piece                  B=16          B=64
  feed                   0.83 -> 0.50  2.60 -> 1.56   (mlx-lm's detokenizer is most of what is left)
  draft graph            0.90 -> 0.75  0.79 -> 0.84   (model code: about the same)
  verify graph           0.85 -> 0.63  0.56 -> 0.60
  run: rest              0.30 -> 0.25  0.62 -> 0.58
  accepted (width policy)   0.16 -> 0.14  0.54 -> 0.49
  width_policy.width        0.18 -> 0.10  0.45 -> 0.30
  postprocess: rest      0.09 -> 0.08  0.30 -> 0.25
  lengths                0.10 -> 0.09  0.20 -> 0.10
  choose                 0.05 -> 0.02  0.10 -> 0.03
  all host               3.33 -> 2.75  7.01 -> 5.00   (1.21x, 1.40x less)

The device wait (50-300 ms a cycle here, varying 2x from run to run on the loaded VM) dwarfs the
host on a CPU, so whole-job rates cannot show the gain here: ``--whole`` (at 73aed89) gave 3330 -> 3430 tok/s
at B=16 and 2425 -> 2639 at B=64 (medians of 9 runs each, run-to-run spread 2x). On the GPU
figure that motivated this (16 ms of host in a 75 ms cycle at B=64) the host share is GPU idle.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from contextlib import ExitStack, contextmanager
from typing import Callable, Dict, List

import dflash_batch.engine  # noqa: F401  (BLAS preload before mlx on Linux CPU)
from dflash_batch.engine import Engine, batch, decode, output, widths
from dflash_batch.engine.batch import BatchDecoder
from dflash_batch.engine.models import target
from dflash_batch.engine.ops import batch_cache

import mlx.core as mx

from . import arms
from .scripted import AcceptanceScript, ScriptedDrafter, head_rows_of

PREFILL = "prefill (joining rows, not per cycle)"


class Pieces:
    """Exclusive seconds per named piece: a piece's time less that of the timed pieces it calls.
    Host pieces are timed in this thread's CPU time (other processes on a shared CPU do not
    count), the device wait in wall time (``wall``)."""

    def __init__(self, clock: Callable[[], float] = time.thread_time):
        self.clock = clock
        self.seconds: Dict[str, float] = {}
        self.wall: Dict[str, float] = {}
        self.stack: List[float] = []  # time spent in children, per open piece
        self.names: List[str] = []  # the open pieces

    def time(self, name: str, call: Callable):
        if PREFILL in self.names:  # a joining row's pieces belong to its admission, not to a cycle
            name = PREFILL
        self.names.append(name)
        self.stack.append(0.0)
        started = self.clock()
        try:
            return call()
        finally:
            spent = self.clock() - started
            children = self.stack.pop()
            self.names.pop()
            self.seconds[name] = self.seconds.get(name, 0.0) + spent - children
            if self.stack:
                self.stack[-1] += spent

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            return self.time(name, lambda: fn(*args, **kwargs))

        return timed

    def wrap_generator(self, name: str, fn: Callable) -> Callable:
        """A generator function whose every resumption is timed (not the consumer's work between)."""

        def timed(*args, **kwargs):
            inner = fn(*args, **kwargs)
            while True:
                try:
                    item = self.time(name, lambda: next(inner))
                except StopIteration as end:
                    return end.value
                yield item

        return timed


@contextmanager
def patched(owner, name: str, replacement):
    saved = owner.__dict__[name]
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def instrument(pieces: Pieces, side: widths.WidthPolicy, cycles: List[int]) -> ExitStack:
    """Wrap the cycle's pieces (whichever exist in this version of the engine) in timers."""
    stack = ExitStack()
    plain = [
        (target.Target, "verify", "verify"),
        (BatchDecoder, "draft", "draft"),
        (BatchDecoder, "choose", "choose"),
        (decode, "accept_lengths", "accept_lengths"),
        (decode, "pack_context", "pack_context"),
        (target.Target, "rollback", "rollback"),
        (batch_cache.Lengths, "set", "lengths"),
        (batch_cache.Lengths, "advance", "lengths"),
        (widths.WidthPolicy, "accepted", "accepted (width policy)"),
        (BatchDecoder, "_commit", "commit"),
        (output.RowOutput, "feed", "feed"),
    ]
    for owner, attr, name in plain:
        if attr in owner.__dict__:
            stack.enter_context(patched(owner, attr, pieces.wrap(name, owner.__dict__[attr])))
    generators = (
        ("postprocess", "postprocess: rest"),
        ("admit", "admit"),
        ("_fill", PREFILL),
        ("_prefill_pass", PREFILL),
    )
    for attr, name in generators:
        stack.enter_context(
            patched(BatchDecoder, attr, pieces.wrap_generator(name, BatchDecoder.__dict__[attr]))
        )
    stack.enter_context(
        patched(BatchDecoder, "shrink", pieces.wrap("shrink", BatchDecoder.__dict__["shrink"]))
    )
    run, choose = BatchDecoder.__dict__["run"], BatchDecoder.choose

    def timed_run(self, width):
        self.in_cycle = True
        live = [
            r for r in self.rows if r is not None
        ]  # the adaptive choice over these rows, on the side
        budgets = [r.budget for r in live]
        # at the job's tail the width policy weighs the time to finish (engine/widths.py)
        left = budgets if self._closed() else None
        pieces.time(
            "width_policy.width (adaptive, on the side)",
            lambda: side.width([r.acceptance for r in live], budgets, left),
        )
        cycles.append(len(live))
        try:
            return pieces.time("run: rest", lambda: run(self, width))
        finally:
            self.in_cycle = False

    def synced_choose(self, *args, **kwargs):
        chosen, scores = choose(self, *args, **kwargs)
        if getattr(self, "in_cycle", False):  # not a joining row's first token
            started = time.perf_counter()  # the passes compute: the rest of the sync is conversion
            pieces.time("device", lambda: mx.eval(chosen))
            pieces.wall["device"] = pieces.wall.get("device", 0.0) + time.perf_counter() - started
        return chosen, scores

    stack.enter_context(patched(BatchDecoder, "run", timed_run))
    stack.enter_context(patched(BatchDecoder, "choose", synced_choose))
    return stack


def build(shape: str, acceptance: str):
    """(engine, context manager zeroing final norms) for one acceptance setting."""
    setup = arms.engine_setup(arms.build_setup(shape, mx.float32, with_ar_draft=False))
    config, drafter, model = arms.text_config(setup.shape.target), setup.drafter, setup.model
    zeroed = arms.zeroed_final_norm()
    if acceptance == "full":
        zeroed = arms.zeroed_final_norm(model, drafter)
    elif acceptance.startswith("tau="):
        script = AcceptanceScript.of_tokens_per_cycle(
            float(acceptance[4:]), drafter.args.block_size, seed=7
        )
        drafter = ScriptedDrafter(drafter, head_rows_of(model), script, setup.vocab_size)
        zeroed = arms.zeroed_final_norm(model)
    # the cycle timed is a chain's: a zeroed drafter finds every token equally likely, over which
    # a draft tree (engine/tree.py, the CPU's default) would branch at its first position
    engine = Engine(
        model,
        setup.tokenizer,
        drafter,
        config=config,
        adaptive_block=False,
        prefix_cache_mb=0,
        drafts="chain",
    )
    return engine, zeroed, setup.vocab_size


def job(
    engine: Engine, rows: int, max_tokens: int, vocab: int, stop: List[str]
) -> List[batch.EncodedRequest]:
    return [engine.request([(7 * i + j) % (vocab - 2) + 1 for j in range(16 + i % 8)], max_tokens=max_tokens,
                           stop=stop or None, index=i) for i in range(rows)]  # fmt: skip


def measure(
    engine: Engine, rows: int, max_tokens: int, vocab: int, stop: List[str], side_cost
) -> Dict:
    """One job: per-piece ms per cycle over its cycles (every cycle counted, the first included)."""
    decoder = BatchDecoder(engine, job(engine, rows, max_tokens, vocab, stop), rows,
                           engine._width_policy(rows), capacity=64 + max_tokens + engine.block_size)  # fmt: skip
    pieces, cycles = Pieces(), []
    side = widths.WidthPolicy(engine.block_size, side_cost)
    collecting = []  # Python's garbage collections during the job: [start, seconds]

    def on_gc(phase, info):
        if phase == "start":
            collecting.append([time.perf_counter(), 0.0])
        elif collecting:
            collecting[-1][1] = time.perf_counter() - collecting[-1][0]

    gc.callbacks.append(on_gc)
    try:
        with instrument(pieces, side, cycles):
            started = time.perf_counter()
            tokens = sum(len(piece.token_ids) for _, piece in decoder.steps())
            wall = time.perf_counter() - started
    finally:
        gc.callbacks.remove(on_gc)
    seconds = dict(pieces.seconds)
    prefill = decoder.group.counts[
        "seconds"
    ]  # the prefill passes, wall time (as benchmarks/batched.py)
    n = len(cycles)
    device = seconds["device"] = pieces.wall.get("device", 0.0)
    per_cycle = {
        k: round(1e3 * v / n, 3) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])
    }
    host = sum(v for k, v in seconds.items() if k not in ("device", PREFILL))
    return {"cycles": n, "rows": statistics.mean(cycles), "tokens": tokens, "ms_per_cycle": per_cycle,
            "host_ms_per_cycle": round(1e3 * host / n, 3), "device_ms_per_cycle": round(1e3 * device / n, 3),
            "decode_tok_s": round(tokens / (wall - prefill), 1),
            "gc_ms_per_cycle (inside the pieces)": round(1e3 * sum(s for _, s in collecting) / n, 3)}  # fmt: skip


def whole_job(engine: Engine, rows: int, max_tokens: int, vocab: int, stop: List[str]) -> Dict:
    """A job through ``Engine.run`` with nothing wrapped and the adaptive width policy: decode tokens
    per second (prefill passes' seconds left out, as benchmarks/batched.py)."""
    requests = job(engine, rows, max_tokens, vocab, stop)
    started = time.perf_counter()
    tokens = sum(len(c.token_ids) for _, c in engine.run(requests, rows))
    wall = time.perf_counter() - started
    cycles = sum(c[0] for c in engine.decode_counts.values())
    return {
        "tokens": tokens,
        "cycles": cycles,
        "decode_tok_s": round(tokens / (wall - engine.prefill_counts["seconds"]), 1),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-tiny")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--acceptance", default="full", help="full, random or tau=X")
    ap.add_argument(
        "--stop", default="", help="comma-separated stop strings for every row (none by default)"
    )
    ap.add_argument(
        "--reps", type=int, default=3, help="timed jobs per batch size (the median job's pieces)"
    )
    ap.add_argument(
        "--whole",
        action="store_true",
        help="time whole jobs (adaptive widths, nothing wrapped) instead",
    )
    args = ap.parse_args(argv)
    engine, zeroed, vocab = build(args.shape, args.acceptance)
    engine.adaptive_block = args.whole
    stop = [s for s in args.stop.split(",") if s]
    # the side width policy's cost model: passes of a GPU's proportions (only the choice's host time matters)
    side_cost = widths.CostModel(t0=0.02, t1=2e-5, d0=0.005, d1=1e-5)
    with zeroed:
        for rows in [int(b) for b in args.batches.split(",")]:
            if args.whole:
                whole_job(
                    engine, rows, 2 * engine.block_size, vocab, stop
                )  # warm-up: the pass costs, compiling
                runs = [
                    whole_job(engine, rows, args.max_tokens, vocab, stop) for _ in range(args.reps)
                ]
                rates = sorted(r["decode_tok_s"] for r in runs)
                print(json.dumps({"shape": args.shape, "acceptance": args.acceptance, "batch": rows, "stop": stop,
                                  "whole": True, "decode_tok_s_runs": rates, **runs[0], "decode_tok_s": rates[len(rates) // 2]}))  # fmt: skip
                continue
            measure(
                engine, rows, engine.block_size * 2, vocab, stop, side_cost
            )  # warm-up: compile the shapes
            runs = [
                measure(engine, rows, args.max_tokens, vocab, stop, side_cost)
                for _ in range(args.reps)
            ]
            runs.sort(key=lambda r: r["host_ms_per_cycle"])
            best = runs[len(runs) // 2]
            print(json.dumps({"shape": args.shape, "acceptance": args.acceptance, "batch": rows, "stop": stop,
                              "host_ms_runs": [r["host_ms_per_cycle"] for r in runs], **best}))  # fmt: skip


if __name__ == "__main__":
    main()
