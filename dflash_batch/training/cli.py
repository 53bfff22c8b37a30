"""``dflash-batch train-drafter``: train a DFlash drafter for a target by self-distillation.

The target answers a prompt set (greedy, and sampled with ``--samples``) through the batched
engine into a token-id store; the drafter learns to predict the target's own tokens with the
DFlash block objective. Re-running with the same ``--out`` resumes: generation where it stopped
(``--gen-time-budget`` bounds one call; exit status 3 says some is left), training from the
last checkpoint (with ``--steps`` and ``--time-budget``, exit status 3 says steps are left).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import List, Optional

EXAMPLES = """\
examples:
  dflash-batch train-drafter --out runs/smollm2 --time-budget 300          # default target
  dflash-batch train-drafter --target ./my-model --out runs/mine --steps 2000 --layers 2
  dflash-batch train-drafter --out runs/smollm2 --prepare-only             # encode prompts only
  dflash-batch train-drafter --out runs/big --corpus offline --prompts 60000 --prepare-only
  dflash-batch train-drafter --out runs/big --self-prompts 20000 --samples 1 --generate-only --gen-time-budget 500
  dflash-batch train-drafter --out runs/more --data runs/big/data --train-only --init default --steps 20000
  dflash-batch train-drafter --out runs/big --write-draft-vocab ./my-drafter   # add a draft vocabulary
  dflash-batch train-drafter --out runs/big --evaluate default --eval-samples 185  # held-out acceptance
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-batch train-drafter",
        description="Train a DFlash drafter for a target model (self-distillation, MLX).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--target",
        help="target: MLX folder, hub repo id or .gguf (default: the embedded SmolLM2 GGUF)",
    )
    p.add_argument(
        "--out", required=True, help="run folder: data, checkpoints, log, exported drafter"
    )
    d = p.add_argument_group("data")
    d.add_argument(
        "--prompts",
        type=int,
        default=4000,
        dest="num_prompts",
        help="prompts to build (default 4000)",
    )
    d.add_argument(
        "--corpus",
        default="templates",
        choices=["templates", "offline"],
        help="prompt source: built-in templates, or offline (stdlib passages and code + templates)",
    )
    d.add_argument("--data", help="data folder (default OUT/data): runs of a sweep share one")
    d.add_argument(
        "--samples", type=int, default=0, help="sampled answers per prompt besides the greedy one"
    )
    d.add_argument("--sample-temperature", type=float, default=0.7)
    d.add_argument(
        "--self-prompts",
        type=int,
        default=0,
        help="prompts from user turns the target writes itself",
    )
    d.add_argument("--self-temperature", type=float, default=1.0)
    d.add_argument(
        "--gen-time-budget",
        type=float,
        help="seconds of generation per call; exit 3 when some is left",
    )
    d.add_argument(
        "--gen-drafter",
        help="generate with DFlash: 'default' or a drafter folder (default: plain AR)",
    )
    d.add_argument(
        "--max-answers", type=int, default=0, help="training answers used, at most (0: all)"
    )
    d.add_argument(
        "--train-only", action="store_true", help="train on the stored answers, generate nothing"
    )
    d.add_argument(
        "--eval-percent", type=int, default=3, help="share held out for evaluation (default 3)"
    )
    d.add_argument("--max-answer-tokens", type=int, default=256)
    d.add_argument("--gen-batch", type=int, default=128, help="prompts answered at once")
    d.add_argument(
        "--prepare-only",
        action="store_true",
        help="encode the prompts (needs the tokenizer) and stop",
    )
    d.add_argument(
        "--generate-only", action="store_true", help="also generate the answers, then stop"
    )
    m = p.add_argument_group("drafter")
    m.add_argument("--layers", type=int, default=4)
    m.add_argument(
        "--taps", type=int, default=5, dest="num_taps", help="target layers tapped (spread evenly)"
    )
    m.add_argument("--block-size", type=int, default=16)
    m.add_argument(
        "--mask-token-id", type=int, help="default: an unused special token of the tokenizer"
    )
    m.add_argument("--intermediate-size", type=int, help="default: the target's")
    m.add_argument(
        "--init",
        help="start from this exported drafter ('default': the shipped one); "
        "a checkpoint in --out still wins",
    )
    o = p.add_argument_group("optimisation")
    o.add_argument("--steps", type=int, default=0, help="training steps (0: fill --time-budget)")
    o.add_argument("--time-budget", type=float, help="seconds for the training loop")
    o.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    o.add_argument("--anchors", type=int, default=32, help="anchor blocks per sequence")
    o.add_argument(
        "--follow-anchors",
        type=float,
        default=0.0,
        metavar="F",
        help="share of the anchors (at most 0.5) placed where decoding anchors next after drawn "
        "ones, right after a draft the target overruled (default 0: all drawn)",
    )
    o.add_argument(
        "--distill",
        type=float,
        default=0.0,
        metavar="ALPHA",
        help="share of each position's loss that is the cross-entropy to the target's own "
        "distribution there, the rest to its token (default 0: the token only)",
    )
    o.add_argument(
        "--max-len", type=int, default=448, help="tokens per sequence (prompt + answer), padded"
    )
    o.add_argument("--lr", type=float, default=6e-4)
    o.add_argument("--warmup", type=int, default=100)
    o.add_argument(
        "--gamma", type=float, default=7.0, help="loss weight decay over block positions"
    )
    o.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="target compute dtype",
    )
    o.add_argument("--seed", type=int, default=0)
    k = p.add_argument_group("checkpoints and export")
    k.add_argument("--checkpoint-every", type=int, default=500)
    k.add_argument("--eval-every", type=int, default=250)
    k.add_argument("--eval-samples", type=int, default=64, help="held-out answers per evaluation")
    k.add_argument("--log-every", type=int, default=25)
    k.add_argument("--no-resume", action="store_true", help="start over even if checkpoints exist")
    k.add_argument(
        "--quantize-bits", type=int, default=8, help="export bits for linear layers (0: none)"
    )
    k.add_argument("--export-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    k.add_argument(
        "--draft-vocab",
        type=int,
        default=16384,
        help="tokens the drafter drafts from: those the target writes most (default 16384; 0: all)",
    )
    k.add_argument(
        "--write-draft-vocab",
        metavar="DRAFTER",
        help="write DRAFTER/draft_vocab.json from this run's training answers, then stop",
    )
    k.add_argument(
        "--evaluate",
        metavar="DRAFTER",
        help="evaluate DRAFTER ('default': the shipped one) on this run's held-out answers "
        "(loss, teacher-forced acceptance, tau_follow; --eval-samples of them, drawn as --batch-size, "
        "--anchors and --max-len say), print it, then stop",
    )
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0.0 <= args.follow_anchors <= 0.5:
        parser.error(f"--follow-anchors {args.follow_anchors}: a share from 0 to 0.5")
    if not 0.0 <= args.distill <= 1.0:
        parser.error(f"--distill {args.distill}: a share from 0 to 1")
    from .trainer import TrainConfig, Trainer, load_target_model, prepare_answers, prepare_prompts

    cfg = TrainConfig(
        out=args.out,
        target=args.target,
        num_prompts=args.num_prompts,
        corpus=args.corpus,
        data=args.data,
        samples=args.samples,
        sample_temperature=args.sample_temperature,
        self_prompts=args.self_prompts,
        self_temperature=args.self_temperature,
        gen_time_budget=args.gen_time_budget,
        gen_drafter=args.gen_drafter,
        max_answers=args.max_answers,
        train_only=args.train_only,
        eval_samples=args.eval_samples,
        eval_percent=args.eval_percent,
        max_answer_tokens=args.max_answer_tokens,
        gen_batch=args.gen_batch,
        layers=args.layers,
        num_taps=args.num_taps,
        block_size=args.block_size,
        mask_token_id=args.mask_token_id,
        intermediate_size=args.intermediate_size,
        init=args.init,
        steps=args.steps,
        time_budget=args.time_budget,
        batch_size=args.batch_size,
        anchors=args.anchors,
        follow_anchors=args.follow_anchors,
        distill=args.distill,
        max_len=args.max_len,
        lr=args.lr,
        warmup=args.warmup,
        gamma=args.gamma,
        dtype=args.dtype,
        seed=args.seed,
        checkpoint_every=args.checkpoint_every,
        eval_every=args.eval_every,
        log_every=args.log_every,
        quantize_bits=args.quantize_bits or None,
        export_dtype=args.export_dtype,
        draft_vocab=args.draft_vocab,
    )
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    for flag, value, ok in (
        ("--samples", args.samples, args.samples >= 0),
        ("--self-prompts", args.self_prompts, args.self_prompts >= 0),
        ("--max-answers", args.max_answers, args.max_answers >= 0),
        ("--sample-temperature", args.sample_temperature, args.sample_temperature > 0),
        ("--self-temperature", args.self_temperature, args.self_temperature > 0),
        (
            "--gen-time-budget",
            args.gen_time_budget,
            args.gen_time_budget is None or args.gen_time_budget > 0,
        ),
    ):
        if not ok:
            print(
                f"train-drafter: {flag} must be {'positive' if 'temp' in flag or 'budget' in flag else '0 or more'}, got {value}",
                file=sys.stderr,
            )
            return 2
    if args.draft_vocab < 0:
        print(
            f"train-drafter: --draft-vocab must be 0 or more, got {args.draft_vocab}",
            file=sys.stderr,
        )
        return 2
    if args.write_draft_vocab:
        from .trainer import write_draft_vocab

        folder = Path(args.write_draft_vocab)
        if not (folder / "config.json").exists():
            print(
                f"train-drafter: --write-draft-vocab {folder}: no drafter there (no config.json)",
                file=sys.stderr,
            )
            return 2
        try:
            written = write_draft_vocab(cfg, folder, log)
        except (FileNotFoundError, ValueError) as e:
            print(f"train-drafter: {e}", file=sys.stderr)
            return 2
        if written is None:
            print(
                "train-drafter: --draft-vocab covers the whole vocabulary: nothing written",
                file=sys.stderr,
            )
        return 0
    if args.evaluate:
        return evaluate(cfg, args.evaluate, log)
    if not args.steps and not args.time_budget and not (args.prepare_only or args.generate_only):
        print("train-drafter: give --steps or --time-budget", file=sys.stderr)
        return 2
    prepare_prompts(cfg, log)
    if args.prepare_only:
        return 0
    if args.generate_only:
        model, config = load_target_model(cfg.target, cfg.dtype)
        # 3: time budget reached, rerun to resume
        return 0 if prepare_answers(cfg, model, log, config) else 3
    trainer = Trainer(cfg, log)
    print(trainer.run(resume=not args.no_resume))
    # 3: stopped by --time-budget, rerun to go on
    return 3 if args.steps and trainer.step < args.steps else 0


def evaluate(cfg, drafter: str, log) -> int:
    """``--evaluate``: the held-out evaluation of an exported drafter, its shape read from it."""
    import dataclasses
    import json

    from ..engine.models.default_model import DRAFTER_ASSET
    from .trainer import Trainer

    folder = DRAFTER_ASSET if drafter == "default" else Path(drafter)
    try:
        config = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        print(
            f"train-drafter: --evaluate {folder}: no drafter there (no config.json)",
            file=sys.stderr,
        )
        return 2
    dflash = config.get("dflash_config", {})
    cfg = dataclasses.replace(
        cfg, init=str(folder), train_only=True, layers=config["num_hidden_layers"],
        block_size=dflash.get("block_size", config.get("block_size")),
        taps=dflash.get("target_layer_ids", config.get("target_layer_ids")),
        intermediate_size=config["intermediate_size"],
    )  # fmt: skip
    trainer = Trainer(cfg, log)
    try:
        trainer.setup()
    except (FileNotFoundError, ValueError) as e:
        print(f"train-drafter: {e}", file=sys.stderr)
        return 2
    result = {
        "drafter": str(folder),
        "eval_samples": min(cfg.eval_samples, len(trainer.eval_samples)),
    }
    print(json.dumps(dict(result, **trainer.evaluate())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
