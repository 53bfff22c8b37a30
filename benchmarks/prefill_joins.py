"""Where the drafter arm's extra prefill time goes (issue 36, the default pair at B=16 on a CPU):
``python -m benchmarks.prefill_joins``.

Two parts, on the benchmark's short chat prompts (benchmarks/data/chat-prompts.jsonl):

  taps   one packed group of the first ``--batch`` prompts prefilled to its end, by the engine
         with its drafter (the target's taps kept for the drafter's deferred context) and
         without one: the seconds of the whole group, and of copying the rows' states out
         (``JoinGroup.state``), medians of ``--reps`` rounds taking turns
  joins  the job (``--prompts`` prompts, ``--max-tokens`` new tokens, batch ``--batch``) with
         the joins gathered into fewer prefill passes (engine/batch.py: ``_gather``) and with
         each join at once, by the engine with its drafter and without one, the four arms
         taking turns: wall seconds, prefill passes and seconds, decoding seconds, cycles per
         width (medians of ``--reps``). The drafter arm's cost model is the one its warm-up
         job left, frozen (learning nothing from cycles), so that other work on the machine
         does not move its width choices between arms

``--smoke``: 4 prompts, 8 new tokens, batch 2, one round (the CPU tests run it).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List

import dflash_batch.engine  # noqa: F401  (BLAS preload before mlx on Linux CPU)
from dflash_batch.engine import Engine, batch, load_engine, prefill

import mlx.core as mx

from .never_loses import chat_prompts

SMOKE = dict(prompts=4, max_tokens=8, batch=2, reps=1)


def group_seconds(engine: Engine, prompts: List[str]) -> Dict[str, float]:
    """One packed group of ``prompts`` prefilled to its end at the batch's pass width: seconds in
    all, of them copying the rows' states out, and passes."""
    ids = [engine.encode(p) for p in prompts]
    group = prefill.JoinGroup(engine.target, engine.drafter, None)
    for slot, row in enumerate(ids):
        group.add(prefill.Joiner(None, slot, list(row), 0), None)
    width = max(1, min(engine.prefill_chunk, engine.prefill_tokens // len(ids)))
    states, copy_state = [0.0], prefill.JoinGroup.state

    def timed_state(self, *args):
        started = time.perf_counter()
        out = copy_state(self, *args)
        states[0] += time.perf_counter() - started
        return out

    prefill.JoinGroup.state = timed_state
    try:
        mx.synchronize()
        started = time.perf_counter()
        while group.joiners:
            group.prefill(width)
        seconds = time.perf_counter() - started
    finally:
        prefill.JoinGroup.state = copy_state
    return {"seconds": seconds, "state_seconds": states[0], "passes": group.counts["passes"]}


def taps_part(engines: Dict[str, Engine], prompts: List[str], reps: int) -> Dict[str, Any]:
    for engine in engines.values():
        group_seconds(engine, prompts)  # warm-up
    runs: Dict[str, list] = {name: [] for name in engines}
    order = list(engines.items())
    for rep in range(reps):
        for name, engine in order if rep % 2 == 0 else order[::-1]:
            runs[name].append(group_seconds(engine, prompts))
    return {name: _medians(done) for name, done in runs.items()}


def job(engine: Engine, prompts: List[str], max_tokens: int, B: int, gather: bool) -> dict:
    real = batch.BatchDecoder._gather
    if not gather:
        batch.BatchDecoder._gather = lambda self: False
    try:
        mx.synchronize()
        started = time.perf_counter()
        engine.generate_batch(prompts, max_tokens=max_tokens, batch_size=B)
        wall = time.perf_counter() - started
    finally:
        batch.BatchDecoder._gather = real
    counts = engine.decode_counts
    return {
        "seconds": wall,
        "passes": engine.prefill_counts["passes"],
        "prefill_seconds": engine.prefill_counts["seconds"],
        "decode_seconds": sum(s for _, s, _ in counts.values()),
        "cycles": {str(T): n for T, (n, _, _) in sorted(counts.items())},
    }


def joins_part(engines: Dict[str, Engine], prompts, max_tokens: int, B: int, reps: int) -> dict:
    for engine in engines.values():
        job(engine, prompts, max_tokens, B, True)  # warm-up: the job itself
    drafter = engines["drafter"]
    if drafter.cost:  # frozen: the warm-up's costs, learning nothing from the timed jobs
        frozen = copy.deepcopy(drafter.cost[max(drafter.cost)])
        frozen.window = 0
        drafter.cost_model = frozen
    arms = [(f"{name}{' gathered' if g else ''}", e, g) for name, e in engines.items()
            for g in (True, False)]  # fmt: skip
    runs: Dict[str, list] = {name: [] for name, _, _ in arms}
    for rep in range(reps):
        for name, engine, gather in arms if rep % 2 == 0 else arms[::-1]:
            runs[name].append(job(engine, prompts, max_tokens, B, gather))
    return {name: _medians(done) for name, done in runs.items()}


def _medians(runs: List[dict]) -> dict:
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)):
            out[key] = statistics.median(r[key] for r in runs)
            out[key + "_runs"] = [round(r[key], 3) for r in runs]
    return out


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--machine", default="cpu")
    ap.add_argument("--out", help="write the result here (JSON)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    prompts = chat_prompts(args.prompts)
    engines = {
        "drafter": load_engine(prefix_cache_mb=0),
        "plain": load_engine(draft=None, prefix_cache_mb=0),
    }
    doc = {
        "machine": args.machine,
        "args": vars(args),
        "taps": taps_part(engines, prompts[: args.batch], args.reps),
        "joins": joins_part(engines, prompts, args.max_tokens, args.batch, args.reps),
    }
    text = json.dumps(doc, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return doc


if __name__ == "__main__":
    main()
