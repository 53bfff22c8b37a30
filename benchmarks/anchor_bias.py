"""Why real decoding accepts less than teacher forcing: the drafter's acceptance at the anchors
real decoding reaches, against its acceptance at every anchor of the same text.

    python -m benchmarks.anchor_bias --samples benchmarks/data/smollm2-held-out-prompts.jsonl --prompts 16 --max-tokens 96

For each held-out prompt the engine decodes greedily with the whole block verified (tokens per
cycle: ``real``). Over the text it wrote (prompt + output), the training objective's forward
(``objective.packed_forward``: context rows s < p, block ``[x_p, MASK...]``) gives a(p), the
drafts accepted from anchor p, at every answer position p at once. Then:

    chained   p_0 = prompt length;  p_(i+1) = p_i + a(p_i) + 1   (as decoding moves: tokens per cycle)
    uniform   mean over p of a(p) + 1, anchors with a whole block of text after them

``chained`` equals ``real`` up to near-ties in the drafter's argmax (the engine drafts what the
objective computes, the tests hold the logits equal, but here they come from one pass over the
text and there cycle by cycle, so fp32 rounding differs): what is left between ``uniform`` and
``real`` is where decoding puts its anchors. A block starts right after the target overruled a draft, so anchors fall on harder
positions than a uniform draw (teacher-forced evaluation draws anchors uniformly).
"""

from __future__ import annotations

import argparse
import sys

import dflash_batch.engine  # noqa: F401  (BLAS preload before mlx)
from dflash_batch.engine import load_engine

import mlx.core as mx
import numpy as np

from benchmarks.default_pair import command_line, held_out_options, held_out_prompts, write_result
from dflash_batch.training import objective
from dflash_batch.training.trainer import tapped_hidden


def accepted_at_every_anchor(engine, seq: list, start: int) -> dict:
    """a(p) for p in [start, len(seq) - 1): drafts accepted from anchor p, at most B - 1 and at
    most the text left after p."""
    drafter, target = engine.drafter, engine.target
    B = drafter.args.block_size
    anchors = np.arange(start, len(seq) - 1)[None]
    host = objective.blocks_at(
        np.array([seq], np.int32), np.array([len(seq)]), anchors, B, drafter.args.mask_token_id, 1.0
    )
    context = tapped_hidden(target, mx.array(host["tokens"])).astype(mx.float32)
    emb = target.embed(mx.array(host["block"].reshape(1, -1))).astype(mx.float32)
    h = objective.packed_forward(drafter, emb, context, mx.array(host["anchors"]))
    h = h.reshape(1, anchors.shape[1], B, -1)[:, :, 1:, :]
    drafts = (
        engine.draft_head(h)
        if engine.draft_head is not None
        else mx.argmax(target.lm_head(h), axis=-1)
    )
    accepted = objective.leading_matches(
        drafts, mx.array(host["labels"]), mx.array(host["weights"])
    )
    return dict(zip(anchors[0].tolist(), accepted[0].tolist()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    held_out_options(ap, prompts=16, max_tokens=96)
    args = ap.parse_args(argv)

    engine = load_engine(args.target, args.draft or "auto", adaptive_block=False)
    if engine.drafter is None:
        print("no drafter: nothing to measure", file=sys.stderr)
        return 2
    B = engine.block_size
    eos = sorted(engine.tokenizer.eos_token_ids)
    totals = dict(
        real_tokens=0,
        real_cycles=0,
        chained_tokens=0,
        chained_cycles=0,
        uniform_sum=0,
        uniform_anchors=0,
    )
    for p in held_out_prompts(engine.tokenizer, args.prompts, args.samples):
        done = engine.generate(p["prompt"], max_tokens=args.max_tokens)
        out = list(done.token_ids)
        if done.finish_reason == "stop" and len(eos) == 1:
            out.append(eos[0])  # committed by the last cycle, not part of the text
        committed = sum(
            k * n for k, n in enumerate(done.stats.acceptance_histogram)
        )  # by the cycles
        if committed < 1:
            continue
        seq, start = p["prompt"] + out, len(p["prompt"])
        a = accepted_at_every_anchor(engine, seq, start)
        at, tokens, cycles = start, 0, 0  # tokens the cycles committed (the prefill's first aside)
        while tokens < committed:
            step = min(a.get(at, 0), committed - tokens - 1) + 1
            tokens, cycles, at = tokens + step, cycles + 1, at + step
        totals["real_tokens"] += committed
        totals["real_cycles"] += done.stats.cycles
        totals["chained_tokens"] += tokens
        totals["chained_cycles"] += cycles
        whole = [q for q in a if q + B < len(seq)]
        totals["uniform_sum"] += sum(a[q] + 1 for q in whole)
        totals["uniform_anchors"] += len(whole)
    result = {
        "device": str(mx.default_device()),
        "engine": engine.description,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "real_tokens_per_cycle": round(totals["real_tokens"] / max(totals["real_cycles"], 1), 3),
        "chained_tokens_per_cycle": round(
            totals["chained_tokens"] / max(totals["chained_cycles"], 1), 3
        ),
        "uniform_anchor_tokens_per_cycle": round(
            totals["uniform_sum"] / max(totals["uniform_anchors"], 1), 3
        ),
        **totals,
        "command": command_line("anchor_bias", argv),
    }
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
