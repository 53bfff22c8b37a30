"""Answers for drafter training: the batched engine into the token store against mlx-lm's
BatchGenerator (the generation before it), on the same pre-encoded prompts of a train-drafter
data folder. Prints both times, their ratio, and whether the greedy answers agree.

    python benchmarks/answer_generation.py --data RUN/data --prompts 16 --max-tokens 32 --batch 16
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from dflash_batch.training import data
from dflash_batch.training import generate as gen
from dflash_batch.training.store import AnswerStore
from dflash_batch.training.trainer import (
    TrainConfig,
    all_prompts,
    generation_engine,
    load_target_model,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--target")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    cfg = TrainConfig(out=args.data, data=args.data, target=args.target, gen_batch=args.batch)
    meta = json.loads((Path(args.data) / "meta.json").read_text())
    prompts = [p for p in all_prompts(cfg, meta) if p["kind"] != "self"][: args.prompts]
    model, config = load_target_model(args.target, "float32")

    start = time.perf_counter()
    old = data.generate_answers(model, prompts, meta["eos_token_ids"], args.max_tokens, args.batch)
    old_s = time.perf_counter() - start

    engine = generation_engine(cfg, model, config, meta["eos_token_ids"])
    with tempfile.TemporaryDirectory() as tmp:
        store = AnswerStore(tmp, meta["vocab_size"])
        start = time.perf_counter()
        got = gen.generate_to_store(
            engine, prompts, store, [0], max_tokens=args.max_tokens, batch_size=args.batch
        )
        new_s = time.perf_counter() - start
        answers = store.answers()
    eos = set(meta["eos_token_ids"])
    same = sum(
        [t for t in s["answer"] if t not in eos] == answers[(p["key"], 0)].tokens
        for s, p in zip(old, prompts)
    )
    print(json.dumps({
        "data": args.data, "prompts": len(prompts), "max_tokens": args.max_tokens, "batch": args.batch,
        "batchgenerator_s": round(old_s, 2), "engine_store_s": round(new_s, 2), "ratio_engine_over_batchgenerator": round(new_s / old_s, 3),
        "tokens": got["tokens"], "greedy_equal": f"{same}/{len(prompts)}",
    }))  # fmt: skip


if __name__ == "__main__":
    main()
