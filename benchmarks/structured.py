"""Cost of structured output per token, as a ratio: ``python -m benchmarks.structured``.

The same prompts are decoded constrained (a JSON schema: a list of records) and unconstrained,
each at the same acceptance: the drafter's proposals are replaced by the row's own output (found
first by a plain greedy run of the same kind), corrupted with probability ``--p-wrong`` by one
seeded script, so both ways commit the same tokens per cycle; the verify width is the whole block
every cycle. Both run to ``--max-tokens`` (the schema's records outlast it), alternating,
``--reps`` times; the medians of wall seconds per committed token give

    ratio = (seconds per token, constrained) / (seconds per token, unconstrained)

What the constrained run adds: the host fetch of the drafts before the verify pass, the grammar masks
along the drafts (llguidance, computed while the pass runs), their upload and application, and
the matchers' advance over the committed tokens; with ``--draft-walk`` also the drafter's
proposals picked under the grammar (``Grammars.draft``; the scripted drafts then replace them, so
its cost is paid and its gain not seen). ``real_drafter``: both kinds with the real
drafter, each at its own acceptance (the first run of the process: compiling included).

``--target`` / ``--draft``: model folders (default: the embedded default pair, a 49k-token
vocabulary). Prints one JSON object; ``--out`` writes it to a file.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from typing import Any, Dict, List, Optional

import dflash_batch.engine  # noqa: F401  (BLAS preload before mlx on Linux CPU)
import mlx.core as mx

from dflash_batch.engine import load_engine
from dflash_batch.engine.batch import BatchDecoder

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 40, "maxItems": 40}
FORMAT = {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}}
PROMPTS = [
    "List forty people as JSON records with name, age and city.",
    "Make up a JSON list of people: their names, ages and home cities.",
    "Give me test data: a JSON array of persons (name, age, city).",
    "Write forty fictional customers as JSON objects.",
]


class Script:
    """Drafts = each row's reference continuation, a draft wrong with probability ``p_wrong``
    (one seeded stream per run, so both ways see the same corruption rate)."""

    def __init__(self, p_wrong: float):
        self.p_wrong = p_wrong
        self.references: Dict[tuple, List[int]] = {}
        self.rng = random.Random(0)
        self.real = BatchDecoder.draft

    def draft(self, decoder: BatchDecoder, last: mx.array, rows: int) -> mx.array:
        self.real(decoder, last, rows)
        out = []
        for b, row in enumerate(decoder.rows):
            if row is None:
                out.append([0] * rows)
                continue
            ref = self.references[tuple(row.request.ids)]
            pos = decoder.lengths.host[b]  # position of the row's newest token
            ids = [ref[pos + i] if pos + i < len(ref) else 0 for i in range(1, rows + 1)]
            out.append([(t + 1) if self.rng.random() < self.p_wrong else t for t in ids])
        return mx.array(out, dtype=mx.int32)


def _run(engine, prompts: List[List[int]], max_tokens: int, fmt: Optional[dict]) -> Dict[str, Any]:
    requests = [engine.request(p, max_tokens, index=i, response_format=fmt) for i, p in enumerate(prompts)]
    mx.synchronize()
    start = time.perf_counter()
    done = dict(engine.run(requests, batch_size=len(prompts)))
    wall = time.perf_counter() - start
    tokens = sum(c.stats.generated_tokens for c in done.values())
    cycles = sum(c.stats.cycles for c in done.values())
    accepted = sum(c.stats.accepted_tokens for c in done.values())
    return {"wall_s": wall, "tokens": tokens, "tokens_per_cycle": round(tokens / max(cycles, 1), 3),
            "accepted": accepted, "outputs": {i: c.token_ids for i, c in done.items()}}


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="model folder (default: the embedded default pair)")
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--prompts", type=int, default=4, help="rows decoded together (at most 4)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--p-wrong", type=float, default=0.05, help="share of scripted drafts made wrong")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--draft-walk", action="store_true",
                    help="constrained rows pick their drafts under the grammar (Engine.grammar_drafts = True)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    engine = load_engine(args.target, args.draft, adaptive_block=False)
    engine.grammar_drafts = args.draft_walk
    if engine.drafter is None:
        raise SystemExit("needs a drafter")
    prompts = [engine.encode(p) for p in PROMPTS[: args.prompts]]
    script = Script(args.p_wrong)
    # references: each kind's own greedy output, found with the real drafter
    refs = {None: _run(engine, prompts, args.max_tokens, None), "json": _run(engine, prompts, args.max_tokens, FORMAT)}
    real_drafter = {k: {"tokens_per_cycle": v["tokens_per_cycle"], "tok_s": round(v["tokens"] / v["wall_s"], 2)}
                    for k, v in (("unconstrained", refs[None]), ("constrained", refs["json"]))}  # fmt: skip
    BatchDecoder.draft = lambda decoder, last, rows: script.draft(decoder, last, rows)
    timings: Dict[str, List[Dict[str, Any]]] = {"unconstrained": [], "constrained": []}
    for rep in range(args.reps + 1):  # the first round compiles the shapes: not counted
        for name, key, fmt in (("unconstrained", None, None), ("constrained", "json", FORMAT)):
            script.references = {tuple(p): p + refs[key]["outputs"][i] for i, p in enumerate(prompts)}
            script.rng = random.Random(rep)
            result = _run(engine, prompts, args.max_tokens, fmt)
            assert result["outputs"] == refs[key]["outputs"], "scripted drafts changed the output"
            if rep:
                timings[name].append(result)
    BatchDecoder.draft = script.real
    per_token = {k: statistics.median(r["wall_s"] / r["tokens"] for r in v) for k, v in timings.items()}
    out = {
        "machine": {"device": str(mx.default_device()), "platform": platform.platform(), "mlx": mx.__version__},
        "target": engine.description["target"], "vocab": engine.target.vocab_size, "block": engine.block_size,
        "draft_walk": engine.grammar_drafts, "rows": len(prompts), "max_tokens": args.max_tokens, "p_wrong": args.p_wrong, "reps": args.reps,
        "tokens_per_cycle": {k: [r["tokens_per_cycle"] for r in v] for k, v in timings.items()},
        "ms_per_token": {k: round(1000 * v, 3) for k, v in per_token.items()},
        "ratio": round(per_token["constrained"] / per_token["unconstrained"], 3),
        "real_drafter": real_drafter,
    }
    print(json.dumps(out), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
