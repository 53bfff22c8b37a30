"""Held-out acceptance against data size and drafter size: a resumable sweep of training runs.

    python -m dflash_batch.training.sweep --data RUN/data --out RUN/sweep --answers 5000,20000,50000 \\
        --layers 2,4 --blocks 8,16 --steps 3000 --call-budget 540

Every configuration (training answers N, layers L, block size B) trains its own drafter in
``OUT/a{N}-l{L}-b{B}`` on the answers already stored in ``--data`` (nothing is generated), for
``--steps`` steps. By default the configurations vary one factor at a time around the largest
(N, L, B); ``--full-grid`` runs every combination. One call works for at most
``--call-budget`` seconds: a run cut there resumes from its last checkpoint at the next call,
finished runs are skipped; exit status 3 says some are left. Each finished run adds its final
held-out evaluation to ``OUT/curve.jsonl`` and the table ``OUT/curve.md``: the teacher-forced
acceptance of training's evaluation, and the tokens per cycle of real greedy DFlash decoding of
held-out prompts with the exported drafter (the whole block every cycle), the figure the
goal tau >= 4 is about.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

from .generate import IdsTokenizer
from .trainer import TrainConfig, Trainer, answer_samples, data_dir, load_target_model

Config = Tuple[int, int, int]  # (training answers, layers, block size)


def configurations(
    answers: List[int], layers: List[int], blocks: List[int], full_grid: bool
) -> List[Config]:
    """The sweep's (answers, layers, block) runs, smallest data first."""
    if full_grid:
        return sorted(itertools.product(answers, layers, blocks))
    base = (max(answers), max(layers), max(blocks))
    runs = (
        {(a, base[1], base[2]) for a in answers}
        | {(base[0], n, base[2]) for n in layers}
        | {(base[0], base[1], b) for b in blocks}
    )
    return sorted(runs)


def run_name(config: Config) -> str:
    return "a{}-l{}-b{}".format(*config)


def finished(folder: Path, steps: int) -> Optional[dict]:
    """The final evaluation of a run that reached ``steps``, else None."""
    log = folder / "train.log.jsonl"
    if not log.exists():
        return None
    finals = [
        e
        for e in map(json.loads, log.read_text().splitlines())
        if "final_eval" in e and e["step"] >= steps
    ]
    return finals[-1] if finals else None


def decode_acceptance(
    cfg: TrainConfig, drafter: Path, prompts: List[dict], max_tokens: int, batch_size: int
) -> dict:
    """Committed tokens per verify cycle of greedy DFlash decoding of ``prompts`` (ids) with the
    exported ``drafter``, the adaptive verify width off (every cycle verifies the whole block)."""
    from ..engine import Engine, load_drafter

    meta = json.loads((data_dir(cfg) / "meta.json").read_text())
    model, config = load_target_model(cfg.target, cfg.dtype)
    engine = Engine(
        model,
        IdsTokenizer(meta["eos_token_ids"]),
        load_drafter(drafter),
        config=config,
        adaptive_block=False,
    )
    run = decode_rows(engine, prompts, max_tokens, batch_size)
    committed, cycles = run["committed"], run["cycles"]
    return {"prompts": len(prompts), "max_tokens": max_tokens, "cycles": cycles,
            "tokens_per_cycle": committed / cycles if cycles else None}  # fmt: skip


def decode_rows(engine, prompts: List[dict], max_tokens: int, batch_size: int) -> dict:
    """Greedy decoding of ``prompts`` (``{"prompt": ids}``) in batches: each row's output
    (``outputs``, by position), the verify cycles of all rows (``cycles``) and their histogram
    of committed tokens per cycle (``hist``), and the tokens those cycles committed (``committed``,
    the prefills' first tokens aside)."""
    requests = [
        engine.request(p["prompt"], max_tokens=max_tokens, index=i) for i, p in enumerate(prompts)
    ]
    outputs, hist, cycles = {}, [0] * (max(engine.block_size, 1) + 1), 0
    for index, done in engine.run(requests, batch_size):
        if index is None:  # a refusal mark: never for these checked requests
            continue
        outputs[index] = done.token_ids
        for k, n in enumerate(done.stats.acceptance_histogram):
            hist[k] += n
        cycles += done.stats.cycles
    return {
        "outputs": outputs,
        "hist": hist,
        "cycles": cycles,
        "committed": sum(k * n for k, n in enumerate(hist)),
    }


def write_curve(out: Path, rows: List[dict]) -> None:
    (out / "curve.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = [
        "| training answers | answer tokens | layers | block | steps | held-out loss | teacher-forced acceptance | position-1 accuracy | decode tokens per cycle |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        e = r["final_eval"]
        lines.append(
            f"| {r['answers']} | {r['answer_tokens']} | {r['layers']} | {r['block_size']} | {r['steps']} | "
            f"{e['loss']:.3f} | {e['tau']:.3f} | {e['acc_pos1']:.3f} | {r['decode']['tokens_per_cycle']:.3f} |"
        )
    (out / "curve.md").write_text("\n".join(lines) + "\n")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dflash_batch.training.sweep", description=__doc__.split("\n\n")[0]
    )
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument(
        "--data",
        required=True,
        help="data folder with stored answers (train-drafter --generate-only)",
    )
    p.add_argument(
        "--out",
        required=True,
        help="sweep folder: one run folder per configuration, curve.jsonl, curve.md",
    )
    p.add_argument(
        "--target", help="as train-drafter's --target (default: the embedded SmolLM2 GGUF)"
    )
    p.add_argument("--answers", type=ints, default=[5000, 20000, 50000])
    p.add_argument("--layers", type=ints, default=[2, 4])
    p.add_argument("--blocks", type=ints, default=[8, 16])
    p.add_argument("--full-grid", action="store_true")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--call-budget", type=float, default=540, help="seconds this call may work")
    p.add_argument(
        "--samples", type=int, default=1, help="sampled answers per prompt stored (as generated)"
    )
    p.add_argument("--self-prompts", type=int, default=0, help="as generated")
    p.add_argument("--eval-percent", type=int, default=3, help="as prepared")
    p.add_argument("--eval-samples", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument(
        "--follow-anchors", type=float, default=0.0, help="as train-drafter's (every configuration)"
    )
    p.add_argument(
        "--distill", type=float, default=0.0, help="as train-drafter's (every configuration)"
    )
    p.add_argument("--max-len", type=int, default=448)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--taps", type=int, default=5)
    p.add_argument("--checkpoint-every", type=int, default=250)
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--decode-prompts", type=int, default=64, help="held-out prompts decoded with each drafter"
    )
    p.add_argument("--decode-tokens", type=int, default=128)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    rows, left = [], 0
    for config in configurations(args.answers, args.layers, args.blocks, args.full_grid):
        answers, layers, block = config
        folder = out / run_name(config)
        cfg = TrainConfig(
            out=str(folder), target=args.target, data=args.data, train_only=True, max_answers=answers,
            samples=args.samples, self_prompts=args.self_prompts, eval_percent=args.eval_percent,
            layers=layers, block_size=block, num_taps=args.taps, steps=args.steps, batch_size=args.batch_size,
            anchors=args.anchors, follow_anchors=args.follow_anchors, distill=args.distill, max_len=args.max_len, lr=args.lr,
            warmup=args.warmup, dtype=args.dtype,
            checkpoint_every=args.checkpoint_every, eval_every=max(args.steps // 6, 1), eval_samples=args.eval_samples,
        )  # fmt: skip
        done = finished(folder, args.steps)
        budget = args.call_budget - (time.perf_counter() - start)
        if done is None and budget > 60:
            log(f"{run_name(config)}: training ({budget:.0f}s left in this call)")
            cfg.time_budget = budget - 45  # room for the final evaluation and the export
            Trainer(cfg, log).run()
            done = finished(folder, args.steps)
        if done is None:
            left += 1
            continue
        _, train, held = answer_samples(cfg)
        measured = folder / "decode.json"
        if not measured.exists():
            greedy = [s for s in held if s["sample"] == 0][: args.decode_prompts]
            result = decode_acceptance(
                cfg, folder / "drafter", greedy, args.decode_tokens, args.batch_size
            )
            measured.write_text(json.dumps(result))
        rows.append({"answers": len(train), "answer_tokens": sum(len(s["answer"]) for s in train), "layers": layers,
                     "block_size": block, "steps": done["step"], "final_eval": done["final_eval"],
                     "decode": json.loads(measured.read_text()), "run": run_name(config)})  # fmt: skip
        write_curve(out, rows)
    log(f"{len(rows)} runs finished, {left} left")
    return 3 if left else 0


if __name__ == "__main__":
    sys.exit(main())
