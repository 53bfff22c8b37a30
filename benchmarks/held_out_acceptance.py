"""A drafter's acceptance on many held-out prompts, decoded in batches: the figure issue 15's
goal (mean tokens per cycle >= 4.0) is about, over more prompts than ``default_pair.py`` can
time one by one.

    python -m benchmarks.held_out_acceptance --samples benchmarks/data/smollm2-held-out-prompts.jsonl \\
        --prompts 64 --max-tokens 128 --out docs/results/held-out-acceptance-<machine>.json

Every cycle verifies the whole block (``adaptive_block=False``), as in ``default_pair.py`` and the
sweep: tokens per cycle = committed tokens / verify cycles, the bonus token included and the
prefill's first token not. Greedy; each output is checked against the engine's own plain decoding
of the same batch (no drafter), which the tests hold equal to ``mlx_lm``'s.
"""

from __future__ import annotations

import argparse
import sys

import dflash_batch.engine  # noqa: F401  (BLAS preload before mlx)
from dflash_batch.engine import load_engine

import mlx.core as mx

from benchmarks.default_pair import command_line, held_out_options, held_out_prompts, write_result
from dflash_batch.training.sweep import decode_rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    held_out_options(ap, prompts=64, max_tokens=128)
    ap.add_argument("--batch", type=int, default=16, help="rows decoded at once")
    args = ap.parse_args(argv)

    drafted = load_engine(args.target, args.draft or "auto", adaptive_block=False)
    if drafted.drafter is None:
        print("no drafter: nothing to measure", file=sys.stderr)
        return 2
    plain = load_engine(
        args.target, None
    )  # a model of its own: the target capture wraps its layers
    prompts = held_out_prompts(drafted.tokenizer, args.prompts, args.samples)
    with_drafter = decode_rows(drafted, prompts, args.max_tokens, args.batch)
    reference = decode_rows(plain, prompts, args.max_tokens, args.batch)
    hist, cycles = with_drafter["hist"], with_drafter["cycles"]
    kinds = sorted({p["kind"] for p in prompts})
    result = {
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "engine": drafted.description,
        "prompts": len(prompts),
        "kinds": {k: sum(p["kind"] == k for p in prompts) for k in kinds},
        "max_tokens": args.max_tokens,
        "block_size": drafted.block_size,
        "tokens_per_cycle": round(with_drafter["committed"] / max(cycles, 1), 3),
        "cycles": cycles,
        "acceptance_histogram": hist,
        "exact_prompts": sum(
            with_drafter["outputs"][i] == reference["outputs"][i] for i in range(len(prompts))
        ),
        "command": command_line("held_out_acceptance", argv),
    }
    write_result(result, args.out)
    return 0 if result["exact_prompts"] == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
