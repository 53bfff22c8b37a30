"""What a new process's first job pays before it runs at speed (issue 36, "warm-up paid once per
machine"): the first job's wall time less the same job's again in the same process.

    python -m benchmarks.first_job --model qwen3-4b --batch 16 --out docs/results      # GPU
    python -m benchmarks.first_job --model default-pair --batch 16 --out docs/results  # either
    python -m benchmarks.first_job --smoke

Three fresh processes, one after the other, share a model cache folder that starts empty
(``DFLASH_BATCH_CACHE``: the measured pass costs, engine/cost_tables.py, MLX's compiled CUDA
kernels and the custom kernels' passed self-checks, engine/ops/kernels/selfcheck.py, live
there): the first is a machine that has never run this model, the next two one that has. Each
process builds the engine, runs the job twice and reports both wall times and what the
warm-up did (``Engine.prepare``: timed passes or read them). The engine without a drafter runs the
same job in the first process, for scale, and first of all alone in a process of its own on a cache
of its own that starts empty (``plain_fresh``): what any engine's first job pays on a fresh machine
(MLX compiling its own kernels). Goals: warm-up <= 20 s on a fresh machine, <= 5 s after.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional

ROOT = Path(__file__).resolve().parent.parent
SMOKE = dict(model="qwen3-tiny", batch=2, prompts=2, context=16, max_tokens=8)


def child(args) -> Dict[str, Any]:
    """One process: the job twice with the drafter (and, if asked, twice without)."""
    import time

    from dflash_batch.engine import (
        Engine,
        load_engine,
    )  # first: the BLAS preload before mlx on Linux CPU
    from dflash_batch.engine.ops.kernels import selfcheck

    import mlx.core as mx

    from . import arms, batched, never_loses

    started = time.perf_counter()
    if args.model == "default-pair":
        drafting = None if args.plain_only else load_engine(prefix_cache_mb=0)
        plain = (
            load_engine(draft=None, prefix_cache_mb=0) if args.plain or args.plain_only else None
        )
        prompts = never_loses.chat_prompts(args.prompts)
    else:
        setup = arms.build_setup(
            args.model, mx.bfloat16 if args.dtype == "bfloat16" else mx.float32, with_ar_draft=False
        )
        config = arms.text_config(setup.shape.target)
        drafting = (
            None
            if args.plain_only
            else Engine(
                setup.model, setup.tokenizer, setup.drafter, config=config, prefix_cache_mb=0
            )
        )
        plain = (
            Engine(
                arms.engine_setup(setup).model,
                setup.tokenizer,
                None,
                config=config,
                prefix_cache_mb=0,
            )
            if args.plain or args.plain_only
            else None
        )
        prompts = batched.job_prompts(args.prompts, args.context, setup.vocab_size)
    out: Dict[str, Any] = {"load_s": time.perf_counter() - started}
    for name, engine in (("drafter", drafting), ("plain", plain)):
        if engine is None:
            continue
        walls = []
        for _ in range(2):
            t = time.perf_counter()
            engine.generate_batch(prompts, max_tokens=args.max_tokens, batch_size=args.batch)
            walls.append(time.perf_counter() - t)
        out[name] = {"first_s": walls[0], "again_s": walls[1], "warm_up_s": walls[0] - walls[1]}
    if drafting is not None:  # 0: every cost table was read from the cache
        out["measured_passes"] = drafting.measured_passes
    # kernel self-checks run in this process, and passes an earlier one kept (trusted instead)
    out["kernel_checks"] = selfcheck.counters()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default="qwen3-4b",
        help="a benchmarks/shapes.py shape (random weights) or default-pair",
    )
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument(
        "--context", type=int, default=1024, help="prompt tokens (random-weight shapes)"
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--machine", default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="a tiny shape, to check the script runs")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plain-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    flags = [
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--batch",
        str(args.batch),
        "--prompts",
        str(args.prompts),
        "--context",
        str(args.context),
        "--max-tokens",
        str(args.max_tokens),
    ]
    runs = []
    with tempfile.TemporaryDirectory(prefix="first-job-plain-") as cache:
        plain_fresh = _process(flags + ["--plain-only"], dict(os.environ, DFLASH_BATCH_CACHE=cache))
    if plain_fresh is None:
        return 1
    p = plain_fresh["plain"]
    print(f"plain alone, fresh cache: first job {p['first_s']:.2f} s, again {p['again_s']:.2f} s")
    with tempfile.TemporaryDirectory(prefix="first-job-cache-") as cache:
        # converting a model lands in load_s, not the job
        env = dict(os.environ, DFLASH_BATCH_CACHE=cache)
        for i in range(args.processes):
            done = _process(flags + (["--plain"] if i == 0 else []), env)
            if done is None:
                return 1
            runs.append(done)
            d = runs[-1]["drafter"]
            print(
                f"process {i + 1}: first job {d['first_s']:.2f} s, again {d['again_s']:.2f} s, "
                f"warm-up {d['warm_up_s']:.2f} s, passes timed {runs[-1]['measured_passes']}, "
                f"kernel checks run {runs[-1]['kernel_checks']['checked']} "
                f"(kept passes trusted {runs[-1]['kernel_checks']['kept']})",
                flush=True,
            )
    doc = {
        "date": dt.date.today().isoformat(),
        "machine": args.machine,
        "command": "python -m benchmarks.first_job "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "options": {
            k: v for k, v in vars(args).items() if k not in ("child", "plain", "plain_only", "out")
        },
        "plain_fresh": plain_fresh,
        "processes": runs,
    }
    if args.out is not None:
        path = (
            args.out
            / f"first-job-{args.machine or 'machine'}-{doc['date']}-{args.model}-b{args.batch}.json"
        )
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(path)
    return 0


def _process(flags, env) -> Optional[Dict[str, Any]]:
    """One child process's figures, None (its error written out) if it failed."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.first_job", "--child", *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
