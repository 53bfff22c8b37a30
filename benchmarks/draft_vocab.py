"""What a draft vocabulary (``draft_vocab.json``, engine/decode.py: ``DraftHead``) costs in
acceptance and buys in speed: one drafter with draft vocabularies of several sizes, side by side
in one process, on held-out prompts.

    python -m benchmarks.draft_vocab --data .train-run/data --self-prompts 20000 --sizes 0,4096,8192,16384 \\
        --samples benchmarks/data/smollm2-held-out-prompts.jsonl --out docs/results/draft-vocab-<machine>.json

Size 0 is the whole vocabulary. Each size's vocabulary is rebuilt from the training answers of
``--data`` (``train-drafter``'s rule: the most written tokens, EOS among them), so the figures
hold for any size, the shipped one included. Per size:

  * tokens per cycle with the whole block verified every cycle (the drafter's acceptance),
    decoded in batches over ``--prompts`` prompts, and whether every output equals the whole
    vocabulary's (it must: verification keeps the whole head);
  * decode tokens/s at batch 1 (the engine's adaptive width, as users run it; counted as
    ``default_pair.py`` counts it) over
    ``--speed-prompts`` prompts, the sizes taking turns prompt by prompt after a warm-up; the
    ratio to size 0 over all of them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import dflash_batch.engine  # noqa: F401  (BLAS preload before mlx)
from dflash_batch.engine import load_engine
from dflash_batch.engine.models import loading
from dflash_batch.engine.models.default_model import ensure_default_pair

import mlx.core as mx

from benchmarks.default_pair import (
    command_line,
    held_out_options,
    held_out_prompts,
    run_engine,
    write_result,
)
from dflash_batch.training import export
from dflash_batch.training.sweep import decode_rows
from dflash_batch.training.trainer import TrainConfig, answer_samples


def drafter_with_vocab(
    src: Path, dst: Path, size: int, answers: list, vocab_size: int, eos: list
) -> Path:
    shutil.copytree(src, dst)
    (dst / loading.DRAFT_VOCAB_FILE).unlink(missing_ok=True)
    if size:
        export.save_draft_vocab(dst, export.draft_vocab(answers, vocab_size, size, eos))
    return dst


def decode_time(engine, prompt, max_tokens: int) -> tuple:
    """(decode tokens, decode seconds) as ``default_pair.py`` counts them: the tokens after the
    first, from the first token to the last."""
    ids, tps, _, _ = run_engine(engine, prompt, max_tokens)
    return (len(ids) - 1, (len(ids) - 1) / tps) if len(ids) > 1 else (0, 0.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    held_out_options(ap, prompts=32, max_tokens=128)
    ap.add_argument("--data", required=True, help="a train-drafter data folder with stored answers")
    ap.add_argument(
        "--self-prompts", type=int, default=0, help="as train-drafter's, for the data folder"
    )
    ap.add_argument("--sizes", default="0,4096,8192,16384")
    ap.add_argument("--speed-prompts", type=int, default=12)
    ap.add_argument("--speed-max-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if 0 not in sizes:
        sizes = [0] + sizes

    target, draft = args.target, args.draft
    if target is None or draft is None:
        default_target, default_draft = ensure_default_pair()
        target, draft = target or default_target, draft or default_draft
    cfg = TrainConfig(
        out=str(Path(args.data).parent), data=args.data, self_prompts=args.self_prompts
    )
    meta = json.loads((Path(args.data) / "meta.json").read_text())
    _, train, _ = answer_samples(cfg)
    answers = [s["answer"] for s in train]

    with tempfile.TemporaryDirectory() as tmp:
        folders = {k: drafter_with_vocab(Path(draft), Path(tmp) / f"v{k}", k, answers, meta["vocab_size"], meta["eos_token_ids"])
                   for k in sizes}  # fmt: skip
        fixed = {k: load_engine(target, str(f), adaptive_block=False) for k, f in folders.items()}
        prompts = held_out_prompts(fixed[0].tokenizer, args.prompts, args.samples)
        rows = {}
        base = None
        for k in sizes:
            r = decode_rows(fixed[k], prompts, args.max_tokens, 16)
            base = base or r["outputs"]
            rows[k] = {
                "size": k,
                "coverage": None
                if not k
                else json.loads((folders[k] / loading.DRAFT_VOCAB_FILE).read_text())["coverage"],
                "tokens_per_cycle": round(r["committed"] / max(r["cycles"], 1), 3),
                "same_output_prompts": sum(r["outputs"][i] == base[i] for i in range(len(prompts))),
            }
            print(json.dumps(rows[k]), file=sys.stderr)
        del fixed
        engines = {k: load_engine(target, str(f)) for k, f in folders.items()}
        timed = prompts[: args.speed_prompts]
        for k in sizes:
            decode_time(engines[k], timed[0]["prompt"], args.speed_max_tokens)  # warm-up
        tokens = {k: 0 for k in sizes}
        seconds = {k: 0.0 for k in sizes}
        for i, p in enumerate(timed):
            order = sizes[i % len(sizes) :] + sizes[: i % len(sizes)]  # each size leads in turn
            for k in order:
                n, s = decode_time(engines[k], p["prompt"], args.speed_max_tokens)
                tokens[k] += n
                seconds[k] += s
        for k in sizes:
            rows[k]["decode_tps"] = round(tokens[k] / seconds[k], 2)
            rows[k]["speed_vs_whole_vocabulary"] = round(
                rows[k]["decode_tps"] / (tokens[0] / seconds[0]), 3
            )
    result = {
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "target": str(target),
        "draft": str(draft),
        "vocab_size": meta["vocab_size"],
        "training_answers": len(answers),
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "speed_prompts": len(timed),
        "speed_max_tokens": args.speed_max_tokens,
        "sizes": [rows[k] for k in sizes],
        "command": command_line("draft_vocab", argv),
    }
    write_result(result, args.out)
    return 0 if all(r["same_output_prompts"] == len(prompts) for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
