"""Where a process's warm-up goes (issue 36, "warm-up paid once per machine"): the engine's own
warm-up (``Engine.prepare``, each timed pass's runs) and its first jobs, cycle by cycle.

    python -m benchmarks.warm_up_breakdown --out /root/out/a.json                # GPU, default pair
    DFLASH_BATCH_KERNEL_CHECK=0 python -m benchmarks.warm_up_breakdown ...        # without self-checks
    DFLASH_BATCH_ATTENTION=stock DFLASH_BATCH_MATMUL=stock python -m ...          # without kernels
    python -m benchmarks.warm_up_breakdown --smoke

One process: the embedded default pair, ``Engine.prepare`` for a job of ``--batch`` rows and
``--max-tokens`` new tokens, then the same job of ``--prompts`` chat prompts ``--jobs`` times. Run
it several times in a row on one model cache (``DFLASH_BATCH_CACHE``) to see a fresh machine
(the first run) against one that has run the model before (the next). Recorded, by wrapping the
engine's steps (timings of this process only; nothing in the engine changes):

  prepare      seconds, and each timed pass's runs in order (``t B16 T8``: a target pass of
               width 8 at 16 rows; ``d B16``: a drafter pass): the first of each includes what
               compiling it cost
  per job      wall seconds; per cycle kind (rows, verify width) the count, total and slowest
               milliseconds; the kernels' self-checks (engine/ops/kernels/selfcheck.py), which run
               inside the cycle that first needs a kernel; the drafter's prompt-context writes

The first job's excess over the second that no hook accounts for lies in the prefill passes
(built lazily and evaluated by the first read of their logits) and in the host.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, List, Tuple

import dflash_batch.engine  # noqa: F401  (BLAS preload before mlx on Linux CPU)
from dflash_batch.engine import batch, load_engine, warmup
from dflash_batch.engine.ops.kernels import selfcheck

from . import never_loses

Event = Tuple[str, str, float]  # (kind, label, milliseconds)


@contextmanager
def recording(events: List[Event]):
    """Wrap the warm-up's timed runs, the decoder's cycles and context writes and the kernels'
    self-checks so that each appends an event; restored on exit."""
    label = ["?"]
    saved = [
        (warmup, "_run_once"),
        (warmup._Passes, "target"),
        (warmup._Passes, "draft"),
        (batch.BatchDecoder, "run"),
        (batch.BatchDecoder, "write_prompts"),
        (selfcheck, "_problem"),
    ]
    originals = [getattr(owner, name) for owner, name in saved]
    run_once, target, draft, run, write_prompts, problem = originals

    def timed(kind, name, fn, *args):
        started = time.perf_counter()
        out = fn(*args)
        events.append((kind, name, round(1e3 * (time.perf_counter() - started), 2)))
        return out

    def target_pass(passes, T):
        label[0] = f"t B{passes.B} T{T}"
        return target(passes, T)

    def draft_pass(passes):
        label[0] = f"d B{passes.B}"
        return draft(passes)

    warmup._run_once = lambda fn: timed("pass", label[0], run_once, fn)
    warmup._Passes.target, warmup._Passes.draft = target_pass, draft_pass

    def cycle(decoder, width):
        started = time.perf_counter()
        out = run(decoder, width)
        # the width the pass ran at, which the cycle itself sets
        label = f"B{decoder.slots} T{getattr(decoder, 'last_width', width)}"
        events.append(("cycle", label, round(1e3 * (time.perf_counter() - started), 2)))
        return out

    batch.BatchDecoder.run = cycle
    batch.BatchDecoder.write_prompts = lambda d: timed("context", "", write_prompts, d)
    selfcheck._problem = lambda *a: timed("check", "", problem, *a)
    try:
        yield
    finally:
        for (owner, name), original in zip(saved, originals):
            setattr(owner, name, original)


def summary(events: List[Event]) -> Dict[str, List[float]]:
    """Per kind and label: [count, total ms, slowest ms]."""
    out: Dict[str, List[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for kind, label, ms in events:
        entry = out[f"{kind} {label}".strip()]
        entry[0] += 1
        entry[1] = round(entry[1] + ms, 2)
        entry[2] = max(entry[2], ms)
    return dict(sorted(out.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="a JSON file to write")
    ap.add_argument("--smoke", action="store_true", help="a small job, to check the script runs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.batch, args.prompts, args.max_tokens, args.jobs = 2, 2, 8, 2
    events: List[Event] = []
    out: Dict[str, Any] = {
        "command": "python -m benchmarks.warm_up_breakdown " + " ".join(argv or sys.argv[1:])
    }
    with recording(events):
        started = time.perf_counter()
        engine = load_engine(prefix_cache_mb=0)
        out["load_s"] = round(time.perf_counter() - started, 3)
        started = time.perf_counter()
        out["prepare"] = engine.prepare(args.batch, args.max_tokens)
        out["prepare_s"] = round(time.perf_counter() - started, 3)
        out["prepare_passes"] = [[label, ms] for kind, label, ms in events if kind == "pass"]
        out["prepare_checks_ms"] = [ms for kind, _, ms in events if kind == "check"]
        events.clear()
        prompts = never_loses.chat_prompts(args.prompts)
        out["jobs"] = []
        for _ in range(args.jobs):
            started = time.perf_counter()
            engine.generate_batch(prompts, max_tokens=args.max_tokens, batch_size=args.batch)
            wall = time.perf_counter() - started
            out["jobs"].append({"wall_s": round(wall, 3), "steps": summary(events)})
            events.clear()
    text = json.dumps(out, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
