"""One job on the default pair three ways, side by side in one process:

    python -m benchmarks.runner [--prompts 16 | --prompts-file FILE] [--batch 16] [--max-tokens 32] [--runs 3] [--cli]

  runner                  ``dflash_batch.run`` on a JSONL file with the loaded engine: the whole
                          job loop (lock, journal fsynced per row, Parquet parts, status)
  Engine.generate_batch   the same prompts straight into the batched engine
  mlx_lm.batch_generate   the same prompt token ids, ``completion_batch_size=B``, stock attention
  dflash-batch run        (``--cli``) the command in a subprocess: load and convert-check included

All greedy, ``max_tokens`` each, batch size B. Each arm runs the job once to warm up; then
``--runs`` rounds each time every arm in turn (the runner into a fresh output dir each time), so
a slow spell of a shared machine or the engine's cost model learning as it runs favours no arm.
The median wall time is reported as generated tokens / second of the whole job, and each arm's
ratio to batch_generate. On a shared CPU only the ratios mean anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import dflash_batch.engine  # noqa: F401  (preloads a fast CPU BLAS before mlx.core)
from dflash_batch.engine.engine import Prompt

import mlx.core as mx

from . import arms

TOPICS = ["rivers", "glass", "bees", "winter", "clocks", "salt", "maps", "bridges", "owls", "paper", "tides",
          "copper", "moss", "trains", "kites", "ink", "caves", "wool", "lamps", "coral"]  # fmt: skip


def job_prompts(n: int) -> List[str]:
    """``n`` distinct short instructions (chat-templated by each arm's tokenizer)."""
    return [f"Write two sentences about {TOPICS[i % len(TOPICS)]} (note {i})." for i in range(n)]


def file_prompts(path: str) -> List[Prompt]:
    """The prompts of a job file, in order, read as the runner reads them (``runner.items``); a
    row's ``system`` becomes its first turn, as ``Engine.encode`` places it. Other per-row options
    (``max_tokens``, ``stop``) are not applied: every arm decodes ``--max-tokens`` for each."""
    from dflash_batch.runner.items import read_items

    prompts = []
    for item in read_items(path):
        if item.error:
            raise ValueError(f"{path} {item.where}: {item.error}")
        turns = (
            [{"role": "user", "content": item.prompt}]
            if isinstance(item.prompt, str)
            else item.prompt
        )
        system = item.options.get("system")
        first = system is not None and turns[0]["role"] != "system"
        prompts.append([{"role": "system", "content": system}] + turns if first else item.prompt)
    return prompts


def job_row(i: int, prompt: Prompt) -> str:
    """One JSONL job row for ``prompt`` (a string or chat messages)."""
    return (
        json.dumps({"id": f"p{i}", "messages" if isinstance(prompt, list) else "prompt": prompt})
        + "\n"
    )


def rounds(arms_: Dict[str, Callable[[], Dict[str, Any]]], runs: int) -> Dict[str, Dict[str, Any]]:
    """Warm each arm up once (compilation, the engine's cost model at this batch size), then
    ``runs`` rounds of every arm in turn; per arm the median wall time."""
    for run in arms_.values():
        run()
    timed: Dict[str, List[Dict[str, Any]]] = {name: [] for name in arms_}
    for _ in range(runs):
        for name, run in arms_.items():
            timed[name].append(run())
    out = {}
    for name, ts in timed.items():
        wall = statistics.median(t["wall_s"] for t in ts)
        out[name] = {"tokens": ts[0]["tokens"], "wall_s": wall, "tok_s": ts[0]["tokens"] / wall,
                     "walls": [round(t["wall_s"], 3) for t in ts]}  # fmt: skip
    return out


def fresh(engine) -> None:
    """Forget prompt prefixes kept from an earlier run: each run prefills its job from scratch
    (within a job, prompts still share their common prefix, as in any job)."""
    if getattr(engine, "prefixes", None) is not None:
        engine.prefixes.clear()


def run_runner(
    engine, prompts: List[Prompt], max_tokens: int, B: int, work: Path
) -> Dict[str, Any]:
    from dflash_batch import api

    fresh(engine)

    src = work / "job.jsonl"
    src.write_text("".join(job_row(i, p) for i, p in enumerate(prompts)))
    out = Path(tempfile.mkdtemp(dir=work, prefix="out-"))  # fresh: nothing skipped
    start = time.perf_counter()
    job = api.run(
        src,
        engine=engine,
        home=work / "home",
        max_tokens=max_tokens,
        batch_size=B,
        output_dir=str(out),
    )
    wall = time.perf_counter() - start
    table = job.to_arrow()
    assert table.num_rows == len(prompts) and set(table.column("status").to_pylist()) == {"ok"}
    return {"tokens": sum(table.column("completion_tokens").to_pylist()), "wall_s": wall}


def run_engine(engine, prompts: List[Prompt], max_tokens: int, B: int) -> Dict[str, Any]:
    fresh(engine)
    mx.synchronize()
    start = time.perf_counter()
    done = engine.generate_batch(prompts, max_tokens=max_tokens, batch_size=B)
    return {
        "tokens": sum(c.stats.generated_tokens for c in done),
        "wall_s": time.perf_counter() - start,
    }


def run_mlx_lm(
    model, tokenizer, prompt_ids: List[List[int]], max_tokens: int, B: int
) -> Dict[str, Any]:
    from mlx_lm import batch_generate

    with arms.stock_ops():
        mx.synchronize()
        start = time.perf_counter()
        resp = batch_generate(model, tokenizer, prompt_ids, max_tokens=max_tokens, completion_batch_size=B,
                              prefill_batch_size=min(B, 8))  # fmt: skip
        wall = time.perf_counter() - start
    return {"tokens": resp.stats.generation_tokens, "wall_s": wall}


def run_cli(prompts: List[Prompt], max_tokens: int, B: int, work: Path) -> Dict[str, Any]:
    src = work / "cli.jsonl"
    src.write_text("".join(job_row(i, p) for i, p in enumerate(prompts)))
    out = Path(tempfile.mkdtemp(dir=work, prefix="cli-"))
    cmd = [sys.executable, "-m", "dflash_batch.cli", "--home", str(work / "home"), "run", str(src), "-q", "--json",
           "--max-tokens", str(max_tokens), "--batch-size", str(B), "--output-dir", str(out)]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    import pyarrow.dataset as ds

    tokens = sum(
        ds.dataset(out, format="parquet")
        .to_table(columns=["completion_tokens"])
        .column(0)
        .to_pylist()
    )
    assert json.loads(proc.stdout)["state"] == "completed"
    return {"tokens": tokens, "wall_s": wall}


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument(
        "--prompts-file",
        help="a JSONL job file's prompts instead (e.g. examples/prompts.jsonl, the README's job)",
    )
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3, help="timed runs per arm (median)")
    ap.add_argument(
        "--cli", action="store_true", help="also time `dflash-batch run` in a subprocess (one run)"
    )
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)

    from dflash_batch.engine import load_engine, pick_dtype
    from dflash_batch.engine.models import loading
    from dflash_batch.engine.models.default_model import ensure_default_pair

    engine = load_engine()  # the embedded default pair, fp32
    model, tokenizer, _ = loading.load_target(ensure_default_pair()[0], None, pick_dtype("auto"))
    prompts = file_prompts(args.prompts_file) if args.prompts_file else job_prompts(args.prompts)
    prompt_ids = [
        engine.request(p, max_tokens=args.max_tokens).ids for p in prompts
    ]  # the engine's own encoding
    B, n = args.batch, args.max_tokens
    results: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dflash-runner-bench-") as tmp:
        work = Path(tmp)
        results.update(rounds({
            "mlx_lm.batch_generate": lambda: run_mlx_lm(model, tokenizer, prompt_ids, n, B),
            "Engine.generate_batch": lambda: run_engine(engine, prompts, n, B),
            "runner (dflash_batch.run)": lambda: run_runner(engine, prompts, n, B, work),
        }, args.runs))  # fmt: skip
        if args.cli:
            results["dflash-batch run (subprocess)"] = run_cli(prompts, n, B, work)
            results["dflash-batch run (subprocess)"]["tok_s"] = (
                results["dflash-batch run (subprocess)"]["tokens"]
                / results["dflash-batch run (subprocess)"]["wall_s"]
            )
    base = results["mlx_lm.batch_generate"]["tok_s"]
    doc = {"prompts": len(prompts), "prompts_file": args.prompts_file, "batch": B, "max_tokens": n, "runs": args.runs, "device": str(mx.default_device()),
           "results": results}  # fmt: skip
    print(
        f"{len(prompts)} prompts, batch {B}, max_tokens {n}, median of {args.runs} runs, {mx.default_device()}"
    )
    print(f"{'arm':32} {'tokens':>7} {'wall s':>8} {'tok/s':>8} {'x batch_generate':>17}")
    for arm, r in results.items():
        print(
            f"{arm:32} {r['tokens']:>7} {r['wall_s']:>8.2f} {r['tok_s']:>8.1f} {r['tok_s'] / base:>17.2f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2))
    return doc


if __name__ == "__main__":
    main()
