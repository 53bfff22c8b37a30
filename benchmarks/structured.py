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
vocabulary). ``--shape NAME`` instead: a random-weight target and drafter of that shape
(benchmarks/shapes.py, built as benchmarks/arms.py builds them, byte-level tokenizer), at the same
scripted acceptance, so the ratio can be read where the passes cost what a real target's cost.
``--pieces 4,32``: also the host ms per cycle of each grammar piece (``pieces``) at those row
counts. Prints one JSON object; ``--out`` writes it to a file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import statistics
import time
from typing import Any, Dict, List, Optional

import dflash_batch.engine  # noqa: F401  (BLAS preload before mlx on Linux CPU)
from dflash_batch.engine import load_engine, sampling
from dflash_batch.engine.batch import BatchDecoder
from dflash_batch.engine.grammar import Grammars

import mlx.core as mx

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
    requests = [
        engine.request(p, max_tokens, index=i, response_format=fmt) for i, p in enumerate(prompts)
    ]
    mx.synchronize()
    start = time.perf_counter()
    done = dict(engine.run(requests, batch_size=len(prompts)))
    wall = time.perf_counter() - start
    tokens = sum(c.stats.generated_tokens for c in done.values())
    cycles = sum(c.stats.cycles for c in done.values())
    accepted = sum(c.stats.accepted_tokens for c in done.values())
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_cycle": round(tokens / max(cycles, 1), 3),
        "accepted": accepted,
        "outputs": {i: c.token_ids for i, c in done.items()},
    }


def shape_engine(name: str, dtype: Optional[str]):
    """The engine on a random-weight target and drafter of shape ``name`` (benchmarks/arms.py)."""
    from . import arms

    gpu = mx.default_device() == mx.gpu
    setup = arms.build_setup(
        name, getattr(mx, dtype or ("bfloat16" if gpu else "float32")), with_ar_draft=False
    )
    return arms.make_engine(
        setup,
        drafter=setup.drafter,
        adaptive_block=False,
        description={"target": f"{name} (random weights)"},
    )


def pieces(
    engine,
    prompts: List[List[int]],
    outputs: List[List[int]],
    rows: int,
    p_wrong: float,
    cycles: int = 12,
) -> Dict[str, float]:
    """Median host ms per cycle of each grammar piece, for ``rows`` constrained rows (the prompts'
    constrained greedy ``outputs``, repeated) at a whole block per cycle, device work forced
    (mx.eval) inside the piece that queued it: fetch (the drafts to the host), masks (llguidance
    along the drafts, and their upload), apply (masks applied to the logits: sampling.process),
    commit (the matchers' advance over the accepted tokens)."""
    T, V = engine.block_size, engine.target.vocab_size
    grammar = engine.request(prompts[0], 1, response_format=FORMAT).grammar
    grammars, rng = engine.grammars, random.Random(0)
    requests = [
        engine.request(prompts[b % len(prompts)], 1, response_format=FORMAT) for b in range(rows)
    ]
    logits = mx.random.normal((rows, T, V), key=mx.random.key(0))
    mx.eval(logits)

    def fresh(b):  # a row at its first output token: matcher, reference, tokens committed
        m = grammars.matcher(grammar)
        Grammars.commit(m, outputs[b % len(outputs)][:1])
        return [m, outputs[b % len(outputs)], 1]

    state = [fresh(b) for b in range(rows)]
    times: Dict[str, List[float]] = {k: [] for k in ("fetch", "masks", "apply", "commit")}
    for cycle in range(cycles + 2):  # the first two compile: not counted
        for b in range(rows):
            if state[b][2] + T >= len(state[b][1]):
                state[b] = fresh(b)
        drafted = mx.array(
            [
                [t + 1 if rng.random() < p_wrong else t for t in ref[n : n + T - 1]]
                for _, ref, n in state
            ]
        )
        mx.eval(drafted)
        marks = [time.perf_counter()]
        drafts = drafted.tolist()
        marks.append(time.perf_counter())
        allowed = grammars.masks([(b, s[0], drafts[b]) for b, s in enumerate(state)], rows, T)
        mx.eval(allowed)
        marks.append(time.perf_counter())
        mx.eval(sampling.process(logits, requests, [[]] * rows, None, allowed))
        marks.append(time.perf_counter())
        for b, (matcher, ref, n) in enumerate(state):
            a = next(
                (i for i, t in enumerate(drafts[b]) if t != ref[n + i]), len(drafts[b])
            )  # drafts kept
            Grammars.commit(matcher, ref[n : n + a + 1])
            state[b][2] += a + 1
        marks.append(time.perf_counter())
        if cycle >= 2:
            for k, start, end in zip(times, marks, marks[1:]):
                times[k].append(1000 * (end - start))
    return {k: round(statistics.median(v), 3) for k, v in times.items()}


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--target", default=None, help="model folder (default: the embedded default pair)"
    )
    ap.add_argument("--draft", default="auto")
    ap.add_argument(
        "--shape",
        default=None,
        help="a random-weight model of this shape instead (benchmarks/shapes.py)",
    )
    ap.add_argument(
        "--dtype", default=None, help="with --shape; default: bfloat16 on a GPU, float32 on CPU"
    )
    ap.add_argument(
        "--pieces",
        default=None,
        help="also time each grammar piece per cycle at these row counts (e.g. 4,32)",
    )
    ap.add_argument("--prompts", type=int, default=4, help="rows decoded together (at most 4)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--p-wrong", type=float, default=0.05, help="share of scripted drafts made wrong"
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--draft-walk",
        action="store_true",
        help="constrained rows pick their drafts under the grammar (Engine.grammar_drafts = True)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.shape:
        engine = shape_engine(args.shape, args.dtype)
    else:
        engine = load_engine(args.target, args.draft, adaptive_block=False)
    engine.grammar_drafts = args.draft_walk
    if engine.drafter is None:
        raise SystemExit("needs a drafter")
    prompts = [engine.encode(p) for p in PROMPTS[: args.prompts]]
    script = Script(args.p_wrong)
    # references: each kind's own greedy output, found with the real drafter
    refs = {
        None: _run(engine, prompts, args.max_tokens, None),
        "json": _run(engine, prompts, args.max_tokens, FORMAT),
    }
    real_drafter = {k: {"tokens_per_cycle": v["tokens_per_cycle"], "tok_s": round(v["tokens"] / v["wall_s"], 2)}
                    for k, v in (("unconstrained", refs[None]), ("constrained", refs["json"]))}  # fmt: skip
    timings: Dict[str, List[Dict[str, Any]]] = {"unconstrained": [], "constrained": []}
    BatchDecoder.draft = lambda decoder, last, rows: script.draft(decoder, last, rows)
    try:
        # scripted drafts are chains (grammar rows verify chains in any case)
        engine.settings = dataclasses.replace(engine.settings, drafts="chain")
        for rep in range(args.reps + 1):  # the first round compiles the shapes: not counted
            for name, key, fmt in (("unconstrained", None, None), ("constrained", "json", FORMAT)):
                script.references = {
                    tuple(p): p + refs[key]["outputs"][i] for i, p in enumerate(prompts)
                }
                script.rng = random.Random(rep)
                result = _run(engine, prompts, args.max_tokens, fmt)
                assert result["outputs"] == refs[key]["outputs"], (
                    "scripted drafts changed the output"
                )
                if rep:
                    timings[name].append(result)
    finally:
        BatchDecoder.draft = script.real
    outputs = [refs["json"]["outputs"][i] for i in range(len(prompts))]
    host_ms = None
    if args.pieces:
        host_ms = {
            int(n): pieces(engine, prompts, outputs, int(n), args.p_wrong)
            for n in args.pieces.split(",")
        }
    per_token = {
        k: statistics.median(r["wall_s"] / r["tokens"] for r in v) for k, v in timings.items()
    }
    out = {
        "machine": {
            "device": str(mx.default_device()),
            "platform": platform.platform(),
            "mlx": mx.__version__,
        },
        "target": engine.description.get("target"),
        "shape": args.shape,
        "vocab": engine.target.vocab_size,
        "block": engine.block_size,
        "draft_walk": engine.grammar_drafts,
        "rows": len(prompts),
        "max_tokens": args.max_tokens,
        "p_wrong": args.p_wrong,
        "reps": args.reps,
        "tokens_per_cycle": {k: [r["tokens_per_cycle"] for r in v] for k, v in timings.items()},
        "ms_per_token": {k: round(1000 * v, 3) for k, v in per_token.items()},
        "ratio": round(per_token["constrained"] / per_token["unconstrained"], 3),
        "real_drafter": real_drafter,
        **({"host_ms_per_cycle": host_ms} if host_ms else {}),
    }
    print(json.dumps(out), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
