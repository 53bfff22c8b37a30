"""Run a benchmark suite: ``python -m benchmarks.run --suite NAME [--out DIR]``.

One process, one set of prompt token ids per context length, every arm warmed up once and then
timed ``reps`` times (median reported). Results go to ``DIR/<machine>-<date>-<suite>.json``,
rewritten after every measurement so a run cut short keeps what it measured. Then
``python -m benchmarks.report`` turns the JSON files into tables and plots.

Acceptance settings (DFlash and mlx_lm speculative arms):
  random      random weights everywhere: proposals are noise, about one token per cycle
  full        target and draft final-norm scales zeroed: both always pick token 0, every block
              is accepted (all the compute still runs)
  drafted=R   scripted: the real drafter runs, its proposed ids are replaced by the target's
              known continuation corrupted so that a share R of drafted tokens is accepted
  tau=T       scripted, T committed tokens per cycle on average (bonus included)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import dflash_batch.engine  # noqa: F401  (preloads a fast BLAS before mlx on Linux CPU)

import mlx.core as mx

from . import arms
from .scripted import AcceptanceScript
from .shapes import SHAPES

SCRIPTED_NOTE = (
    "Random-weight models of the exact shapes: all compute is real. In 'full' runs the target's "
    "and draft's final-norm scales are zeroed so both always choose token 0; in scripted runs "
    "(drafted=R, tau=T) the real drafter runs every cycle but its proposed token ids are replaced "
    "by the target's known greedy continuation, corrupted at positions drawn to give the stated "
    "acceptance. Only the proposed ids are scripted."
)


@dataclass
class Plan:
    """What to run on one shape. Contexts run in the order given (the headline one first), in two
    passes: stream_generate and the engine at every context, then the batch, mlx-lm speculative,
    runner and ~1 token/cycle arms; a run cut short by the time budget keeps the core comparison."""

    shape: str
    contexts: List[int]
    batches: List[int] = field(default_factory=lambda: [1, 4, 8, 16])
    acceptance: List[str] = field(
        default_factory=lambda: ["drafted=0.89", "tau=9.57", "full", "random"]
    )
    mlx_speculative: List[str] = field(default_factory=lambda: ["full", "random"])
    engine_ar: bool = True
    runner: bool = False
    breakdown: bool = True
    share: float = 1.0  # share of the suite's time budget


@dataclass
class Suite:
    name: str
    plans: List[Plan]
    max_tokens: int
    reps: int
    dtype: str
    slow_tokens: int = 0  # max_tokens for the ~1 token/cycle arms (0: same as max_tokens)
    budget_s: float = 0.0  # stop starting new measurements after this long (0: no limit)
    note: str = ""


SUITES: Dict[str, Suite] = {
    s.name: s
    for s in [
        Suite(
            "smoke",
            [
                Plan(
                    "qwen3-tiny",
                    [64, 32],
                    batches=[1, 2],
                    acceptance=["drafted=0.89", "full", "random"],
                    runner=True,
                )
            ],
            max_tokens=48,
            reps=1,
            dtype="float32",
            note="harness smoke test on a tiny model",
        ),
        Suite(
            "cpu",
            [Plan("qwen3-small", [512, 256, 1024], runner=True)],
            max_tokens=64,
            reps=3,
            dtype="float32",
            slow_tokens=32,
            note="CPU: a scaled-down Qwen3 layout (hidden 512, 12 layers, vocab 32768) at contexts "
            "256/512/1024 (a quarter of the GPU contexts): 4B shapes are too slow for 2 shared cores",
        ),
        Suite(
            "cpu-hybrid",
            [Plan("qwen3.5-tiny", [256, 128, 512], batches=[1, 4], mlx_speculative=[])],
            max_tokens=48,
            reps=3,
            dtype="float32",
            note="CPU: tiny Qwen3.5 hybrid layout",
        ),
        Suite(
            "gpu",
            [
                Plan("qwen3-4b", [2048, 1024, 4096], share=0.6),
                # mlx-lm runs GatedDeltaNet as a Python loop over tokens on CUDA and a 9B-shaped
                # prefill takes seconds: the hybrid shape gets the headline context and B=1 only.
                Plan(
                    "qwen3.5-9b",
                    [2048],
                    batches=[1],
                    acceptance=["tau=9.57", "drafted=0.89", "full"],
                    mlx_speculative=[],
                    share=0.4,
                ),
            ],
            max_tokens=256,
            reps=3,
            dtype="bfloat16",
            slow_tokens=32,
            budget_s=330,
            note="GPU: Qwen3-4B and Qwen3.5-9B shapes in bf16, built in memory on the device",
        ),
        Suite(
            "gpu-qwen3-8b",
            [Plan("qwen3-8b", [2048, 1024, 4096])],
            max_tokens=128,
            reps=3,
            dtype="bfloat16",
            slow_tokens=32,
        ),
        Suite(
            "gpu-qwen3.5-4b",
            [Plan("qwen3.5-4b", [2048, 1024, 4096], mlx_speculative=[])],
            max_tokens=128,
            reps=3,
            dtype="bfloat16",
            slow_tokens=32,
        ),
    ]
}


def machine() -> Dict[str, Any]:
    """Backend, chip, versions, and the load on the machine when the run started."""
    import mlx_lm

    info: Dict[str, Any] = {}
    try:
        info = dict(mx.device_info())
    except Exception:  # older MLX
        pass
    gpu = mx.default_device() == mx.gpu
    backend = "cpu"
    if gpu:
        backend = (
            "cuda" if getattr(mx, "cuda", None) is not None and mx.cuda.is_available() else "metal"
        )
    chip = info.get("device_name") or platform.processor() or platform.machine()
    if not gpu:
        try:
            chip = next(
                l.split(":", 1)[1].strip()
                for l in open("/proc/cpuinfo")
                if l.startswith("model name")
            )
        except (OSError, StopIteration):
            pass
    from dflash_batch.engine.ops.blas import loaded_blas

    return {
        "backend": backend,
        "chip": chip,
        "cpu_count": os.cpu_count(),
        "memory_gb": info.get("memory_size", 0) / 1e9 if info.get("memory_size") else None,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "blas": loaded_blas(),
        "loadavg_start": os.getloadavg(),
    }


def copy_bandwidth(gbytes: float) -> float:
    """Device memory bandwidth in GB/s from an elementwise copy (read + write) of ``gbytes``
    (fp32: MLX's CPU bf16 elementwise path is compute-bound; on CPU it is one thread, a lower bound)."""
    a = mx.random.normal((int(gbytes * 1e9 / 4),))
    mx.eval(a)
    for _ in range(3):
        mx.eval(a * 1)
    times = []
    for _ in range(10):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(a * 1)
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 2 * a.nbytes / times[len(times) // 2] / 1e9


def script_for(acceptance: str, block_size: int) -> AcceptanceScript:
    kind, value = acceptance.split("=")
    if kind == "drafted":
        return AcceptanceScript.of_drafted(float(value), block_size, seed=0)
    return AcceptanceScript.of_tokens_per_cycle(float(value), block_size, seed=0)


class Recorder:
    """Collects results and rewrites the JSON file after each one."""

    def __init__(self, path: Path, doc: Dict[str, Any], deadline: float):
        self.path, self.doc, self.deadline = path, doc, deadline
        self.doc.setdefault("results", [])

    def save(self) -> None:
        self.doc["load_end"] = os.getloadavg()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=1))
        tmp.replace(self.path)

    def run(
        self, key: Dict[str, Any], fn: Callable[[], Dict[str, Any]]
    ) -> Optional[Dict[str, Any]]:
        row = dict(key)
        if self.deadline and time.perf_counter() > self.deadline:
            row.update(status="skipped", error="time budget spent")
        else:
            t0 = time.perf_counter()
            try:
                row.update(status="ok", figures=fn())
            except arms.Unsupported as e:
                row.update(status="unsupported", error=str(e))
            except Exception as e:  # reported in the results: an arm that breaks is a finding
                row.update(
                    status="error",
                    error=f"{type(e).__name__}: {e}",
                    traceback=traceback.format_exc(limit=4),
                )
            row["elapsed_s"] = round(time.perf_counter() - t0, 2)
        self.doc["results"].append(row)
        self.save()
        status = row["status"]
        fig = row.get("figures") or {}
        print(
            f"[{status}] {key} decode {fig.get('decode_tps', 0):.1f} tok/s {row.get('error', '')}",
            flush=True,
        )
        return row.get("figures")


def run_shape(
    rec: Recorder, suite: Suite, plan: Plan, engine_options: Optional[Dict[str, Any]] = None
) -> None:
    name = plan.shape
    dtype = getattr(mx, suite.dtype)
    t0 = time.perf_counter()
    setup = arms.build_setup(name, dtype, with_ar_draft=bool(plan.mlx_speculative))
    bandwidth = rec.doc["bandwidth_gbps"]
    rec.doc["shapes"][name] = {
        "source": setup.shape.source,
        "unverified": setup.shape.unverified,
        "target_config": setup.shape.target,
        "drafter_config": setup.shape.drafter,
        "ar_draft": setup.shape.ar_draft,
        "target_gb": setup.target_bytes / 1e9,
        "drafter_gb": setup.drafter_bytes / 1e9,
        "build_s": round(time.perf_counter() - t0, 1),
        # One decode step reads every weight once: bandwidth / weight bytes is the ceiling.
        "physical_limit_tps": bandwidth * 1e9 / setup.target_bytes,
        "plan": asdict(plan),
    }
    rec.save()
    slow = suite.slow_tokens or suite.max_tokens
    reps, n = suite.reps, suite.max_tokens
    # The engine gets its own copy of the target (same seed, same weights): it wraps layers of
    # the model it is given, and mlx-lm's arms must run on a pristine one.
    engine_ar = engine = engine_setup = None
    engine_error = None
    try:
        engine_setup = arms.engine_setup(setup)
        engine_ar = arms.make_engine(engine_setup) if plan.engine_ar else None
        if engine_setup.drafter is not None:
            engine = arms.make_engine(engine_setup, engine_setup.drafter, **(engine_options or {}))
    except Exception as e:
        engine_error = f"engine refuses this target: {type(e).__name__}: {e}"

    def unsupported(message):
        raise arms.Unsupported(message)

    for ctx in plan.contexts:
        p = arms.prompt_ids(ctx, setup.vocab_size, seed=ctx)
        base = {"shape": name, "context": ctx}
        rec.run(
            dict(base, arm="mlx_lm.stream_generate"),
            lambda: arms.measure(lambda: arms.stream_generate(setup, p, n), reps),
        )
        for acc in [a for a in plan.acceptance if a != "random"]:
            key = dict(base, arm="dflash.engine", acceptance=acc)
            if engine is None:
                rec.run(key, lambda: unsupported(engine_error or "no drafter"))
                continue
            if acc == "full":
                with arms.zeroed_final_norm(engine_setup.model, engine_setup.drafter):
                    rec.run(
                        key, lambda: arms.measure(lambda: arms.engine_generate(engine, p, n), reps)
                    )
                continue
            scripted = arms.scripted_drafter(engine_setup, script_for(acc, engine.block_size))
            key["script"] = {
                "label": scripted.script.label,
                "q": scripted.script.q,
                "expected_tokens_per_cycle": 1 + scripted.script.expected_accepted,
            }
            engine.drafter = scripted
            try:
                with arms.zeroed_final_norm(engine_setup.model):
                    rec.run(
                        key,
                        lambda: arms.measure(
                            lambda: arms.engine_generate(engine, p, n, scripted), reps
                        ),
                    )
            finally:
                engine.drafter = engine_setup.drafter
        if plan.breakdown and engine is not None:
            # keep 10 of 16 rows per cycle: about the published acceptance (tau 9.6)
            rec.run(
                dict(base, arm="dflash.cycle-breakdown", keep=10),
                lambda: arms.cycle_breakdown(engine, p, keep=10),
            )
        if engine_ar is not None:
            rec.run(
                dict(base, arm="dflash.engine-ar"),
                lambda: arms.measure(lambda: arms.engine_generate(engine_ar, p, n), reps),
            )
        elif plan.engine_ar:
            rec.run(dict(base, arm="dflash.engine-ar"), lambda: unsupported(engine_error))

    # Second pass: the arms that matter less for the headline, and the slow ones, last.
    for ctx in plan.contexts:
        p = arms.prompt_ids(ctx, setup.vocab_size, seed=ctx)
        base = {"shape": name, "context": ctx}
        for acc in [a for a in plan.mlx_speculative if a != "random"]:
            with arms.zeroed_final_norm(setup.model, setup.ar_draft):
                rec.run(
                    dict(base, arm="mlx_lm.speculative", acceptance=acc),
                    lambda: arms.measure(lambda: arms.mlx_speculative(setup, p, n), reps),
                )
        for b in plan.batches:
            rec.run(
                dict(base, arm="mlx_lm.batch_generate", batch=b),
                lambda: arms.measure(lambda: arms.batch_generate(setup, p, n, b), reps),
            )
        if plan.runner and engine is not None:
            acc = next((a for a in plan.acceptance if "=" in a), None)
            if acc:
                engine.drafter = arms.scripted_drafter(
                    engine_setup, script_for(acc, engine.block_size)
                )
            try:
                with arms.zeroed_final_norm(engine_setup.model):
                    rec.run(
                        dict(base, arm="dflash.runner", acceptance=acc or "random"),
                        lambda: arms.measure(lambda: arms.runner_end_to_end(engine, ctx, n), reps),
                    )
            finally:
                engine.drafter = engine_setup.drafter
        # The slow (about one token per cycle) arms last.
        if "random" in plan.mlx_speculative:
            rec.run(
                dict(base, arm="mlx_lm.speculative", acceptance="random"),
                lambda: arms.measure(lambda: arms.mlx_speculative(setup, p, slow), reps),
            )
        if "random" in plan.acceptance:
            key = dict(base, arm="dflash.engine", acceptance="random")
            if engine is None:
                rec.run(key, lambda: unsupported(engine_error or "no drafter"))
            else:
                rec.run(
                    key, lambda: arms.measure(lambda: arms.engine_generate(engine, p, slow), reps)
                )
    del engine, engine_ar, setup, engine_setup
    mx.clear_cache()


def main(argv: Optional[List[str]] = None, engine_options: Optional[Dict[str, Any]] = None) -> Path:
    """``engine_options`` go to the drafting engine (a test pins its widths: ``cost_model``)."""
    # the arms script a chain's acceptance (scripted drafters, zeroed norms): their cycles verify
    # chains wherever they run (draft trees, engine/tree.py, are measured by default_pair.py)
    return _main(argv, dict(engine_options or {}, drafts="chain"))


def _main(argv: Optional[List[str]], engine_options: Optional[Dict[str, Any]]) -> Path:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--suite", required=True, choices=sorted(SUITES))
    ap.add_argument("--out", default="docs/results", help="folder for the JSON results")
    ap.add_argument("--shapes", help="comma-separated subset of the suite's shapes")
    ap.add_argument("--contexts", help="comma-separated context lengths (override)")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument(
        "--budget-s", type=float, help="stop starting measurements after this many seconds"
    )
    ap.add_argument("--tag", default="", help="added to the file name")
    args = ap.parse_args(argv)
    suite = SUITES[args.suite]
    if args.shapes:
        suite.plans = [p for p in suite.plans if p.shape in args.shapes.split(",")]
    if args.contexts:
        for plan in suite.plans:
            plan.contexts = [int(c) for c in args.contexts.split(",")]
    suite.reps = args.reps or suite.reps
    suite.max_tokens = args.max_tokens or suite.max_tokens
    if args.budget_s is not None:
        suite.budget_s = args.budget_s

    info = machine()
    now = dt.datetime.now(dt.timezone.utc)
    chip = "".join(c if c.isalnum() else "-" for c in str(info["chip"]).lower()).strip("-")
    while "--" in chip:
        chip = chip.replace("--", "-")
    stem = (
        f"{info['backend']}-{chip}-{now:%Y-%m-%d}-{suite.name}{'-' + args.tag if args.tag else ''}"
    )
    path = Path(args.out) / f"{stem}.json"
    doc: Dict[str, Any] = {
        "suite": asdict(suite),
        "command": "python -m benchmarks.run "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": now.isoformat(timespec="seconds"),
        "machine": info,
        "notes": [SCRIPTED_NOTE, suite.note]
        + (["EOS disabled: every run generates exactly max_tokens."]),
        "shapes": {},
    }
    start = time.perf_counter()
    doc["bandwidth_gbps"] = copy_bandwidth(2.0 if info["backend"] != "cpu" else 0.5)
    rec = Recorder(path, doc, 0.0)
    rec.save()
    budget = suite.budget_s
    for i, plan in enumerate(suite.plans):
        # Each shape gets its share of what is left of the budget.
        if budget:
            left = budget - (time.perf_counter() - start)
            rec.deadline = time.perf_counter() + left * plan.share / sum(
                p.share for p in suite.plans[i:]
            )
        try:
            run_shape(rec, suite, plan, engine_options)
        except Exception as e:  # e.g. out of memory while building: record and go on
            rec.doc.setdefault("failures", []).append(
                {
                    "shape": plan.shape,
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc(limit=6),
                }
            )
            rec.save()
            print(f"[failed] {plan.shape}: {e}", flush=True)
        mx.clear_cache()
    doc["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    doc["elapsed_s"] = round(time.perf_counter() - start, 1)
    rec.save()
    print(f"wrote {path}", flush=True)
    return path


if __name__ == "__main__":
    main()
