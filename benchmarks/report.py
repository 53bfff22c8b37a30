"""Tables and plots from benchmark JSON: ``python -m benchmarks.report [FILES...]``.

For each results file ``docs/results/NAME.json`` this writes ``NAME.md`` (tables) and
``NAME-context.png`` / ``NAME-batch.png`` (plots, when matplotlib is installed: the ``bench``
extra), then refreshes the generated block of ``docs/results/benchmarks.md``. No MLX needed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

DOCS = Path("docs/results")
PAGE = Path("docs/results/benchmarks.md")
BEGIN, END = "<!-- generated tables: begin -->", "<!-- generated tables: end -->"
README_BEGIN, README_END = "<!-- README section: begin -->", "<!-- README section: end -->"
README_ARMS = [
    ("tau=9.57", "dflash, tau 9.57 (published)"),
    ("drafted=0.89", "dflash, 89% of drafted"),
    ("full", "dflash, full blocks"),
]
BASELINE = "mlx_lm.stream_generate"


def label(row: Dict[str, Any]) -> str:
    arm, acc = row["arm"], row.get("acceptance")
    if arm == "mlx_lm.stream_generate":
        return "mlx_lm stream_generate"
    if arm == "mlx_lm.batch_generate":
        return f"mlx_lm batch_generate B={row['batch']}"
    if arm == "mlx_lm.speculative":
        return f"mlx_lm speculative, AR draft ({acc})"
    if arm == "dflash.engine-ar":
        return "dflash engine, no drafter (AR)"
    if arm == "dflash.runner":
        return f"dflash runner end to end ({_acc(acc)}; per-item decode from its Parquet rows)"
    if arm == "dflash.engine":
        return f"dflash engine ({_acc(acc)})"
    return arm


def _acc(acc: Optional[str]) -> str:
    if not acc:
        return "random"
    if acc.startswith("drafted="):
        return f"scripted, {float(acc.split('=')[1]):.0%} of drafted"
    if acc.startswith("tau="):
        return f"scripted, tau {acc.split('=')[1]}"
    return {"full": "full blocks", "random": "random weights"}.get(acc, acc)


def _fmt(x: Optional[float], digits: int = 1) -> str:
    return "" if x is None else f"{x:,.{digits}f}"


def _rows(doc) -> List[Dict[str, Any]]:
    return [r for r in doc["results"] if r["arm"] != "dflash.cycle-breakdown"]


def _cell(row: Optional[Dict[str, Any]], base: Optional[float]) -> str:
    if row is None:
        return ""
    if row["status"] != "ok":
        return row["status"]
    if row.get("invalid"):
        return f"invalid ({row['figures']['decode_tps']:,.1f})"
    tps = row["figures"]["decode_tps"]
    ratio = f" ({tps / base:.2f}x)" if base else ""
    total = row["figures"].get("decode_tps_total")
    return f"{tps:,.1f}{ratio}" + (
        f"; total {total:,.0f}" if total and row.get("batch", 1) > 1 else ""
    )


def shape_tables(doc, shape: str) -> List[str]:
    rows = [r for r in _rows(doc) if r["shape"] == shape]
    contexts = sorted({r["context"] for r in rows})
    base = {
        r["context"]: r["figures"]["decode_tps"]
        for r in rows
        if r["arm"] == BASELINE and r["status"] == "ok"
    }
    labels: List[str] = []
    for r in rows:
        if label(r) not in labels:
            labels.append(label(r))
    info = doc["shapes"].get(shape, {})
    out = [f"### {shape}", ""]
    if info:
        out.append(
            f"Target {info['target_gb']:.2f} GB, drafter {info['drafter_gb']:.2f} GB ({doc['suite']['dtype']}); "
            f"{info['source']}."
            + (f" Unverified: {'; '.join(info['unverified'])}." if info.get("unverified") else "")
        )
        out.append(
            f"Physical limit (weight bytes / measured copy bandwidth {doc['bandwidth_gbps']:.0f} GB/s): "
            f"**{info['physical_limit_tps']:,.0f} tok/s per sequence** for plain decoding."
        )
        out.append("")
    out.append(
        "Decode tok/s per sequence (median), ratio to mlx_lm stream_generate at the same context "
        "(batch rows: per sequence; total = all sequences together):"
    )
    out.append("")
    out.append("| arm | " + " | ".join(f"ctx {c}" for c in contexts) + " |")
    out.append("| --- |" + " --- |" * len(contexts))
    for lab in labels:
        cells = []
        for c in contexts:
            row = next((r for r in rows if label(r) == lab and r["context"] == c), None)
            cells.append(_cell(row, base.get(c) if row is None or row["arm"] != BASELINE else None))
        out.append(f"| {lab} | " + " | ".join(cells) + " |")
    out.append("")
    out.append(
        "Details (median of the timed runs; peak memory is process-wide, so it includes the engine's "
        "second copy of the target and the draft models):"
    )
    out.append("")
    out.append(
        "| arm | ctx | decode tok/s | total tok/s | prefill tok/s | tokens/cycle | accepted/drafted | draft share of output | peak GB |"
    )
    out.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if r["status"] != "ok":
            out.append(
                f"| {label(r)} | {r['context']} | {r['status']}: {r.get('error', '')[:120]} | | | | | | |"
            )
            continue
        f = r["figures"]
        if r.get("invalid"):
            out.append(f"| {label(r)} | {r['context']} | {r['invalid']} | | | | | | |")
            continue
        out.append(
            f"| {label(r)} | {r['context']} | {_fmt(f.get('decode_tps'))} | {_fmt(f.get('decode_tps_total') or f.get('throughput_tps'))} | "
            f"{_fmt(f.get('prefill_tps'), 0)} | {_fmt(f.get('tokens_per_cycle'), 2)} | {_fmt(f.get('acceptance_drafted'), 3)} | "
            f"{_fmt(f.get('acceptance_generated'), 3)} | {_fmt(f.get('peak_memory_gb'), 2)} |"
        )
    out.append("")
    breakdown = breakdown_table(doc, shape)
    return out + breakdown


def cycle_ms(doc, shape: str, context: int) -> Tuple[Optional[float], str]:
    """Free-running cycle time: decode time / cycles of the tau=9.57 run, or of the full-block run
    when the scripted run did not reach two tokens per cycle (then it is not a valid cycle sample)."""
    for acceptance in ("tau=9.57", "full"):
        row = next(
            (
                r
                for r in doc["results"]
                if r["shape"] == shape
                and r["context"] == context
                and r["arm"] == "dflash.engine"
                and r.get("acceptance") == acceptance
                and r["status"] == "ok"
            ),
            None,
        )
        if (
            row is None
            or not row["figures"].get("cycles")
            or row["figures"].get("tokens_per_cycle", 0) < 2
        ):
            continue
        f = row["figures"]
        return f["decode_s"] / f["cycles"] * 1e3, acceptance
    return None, ""


def breakdown_table(doc, shape: str) -> List[str]:
    rows = [
        r for r in doc["results"] if r["shape"] == shape and r["arm"] == "dflash.cycle-breakdown"
    ]
    if not rows:
        return []
    out = [
        "Cycle breakdown: draft, verify and rollback each synchronised on its own (keeping 10 of 16 rows per "
        "cycle); cycle = decode time / cycles of a free-running run (tau 9.57, else full blocks); engine "
        "overhead = cycle - verify (goal: at most 25% of verify):",
        "",
        "| ctx | draft ms | verify ms | rollback ms | cycle ms (run) | draft / verify | overhead / verify |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["status"] != "ok":
            out.append(f"| {r['context']} | {r['status']}: {r.get('error', '')[:100]} | | | | | |")
            continue
        f = r["figures"]
        cyc, run = cycle_ms(doc, shape, r["context"])
        ratio = f"{(cyc - f['verify_ms']) / f['verify_ms']:.0%}" if cyc else ""
        out.append(
            f"| {r['context']} | {f['draft_ms']:.2f} | {f['verify_ms']:.2f} | {f['rollback_ms']:.2f} | "
            f"{_fmt(cyc, 2)} ({_acc(run) if run else 'none'}) | {f['draft_ms'] / f['verify_ms']:.0%} | {ratio} |"
        )
    out.append("")
    return out


def headline(doc) -> List[Tuple[str, int, str, float, float, float]]:
    """(shape, context, acceptance, dflash tok/s, stream_generate tok/s, ratio) for scripted/full runs."""
    out = []
    for r in doc["results"]:
        if (
            r["arm"] != "dflash.engine"
            or r["status"] != "ok"
            or r.get("acceptance") == "random"
            or r.get("invalid")
        ):
            continue
        base = next(
            (
                b
                for b in doc["results"]
                if b["arm"] == BASELINE
                and b["shape"] == r["shape"]
                and b["context"] == r["context"]
                and b["status"] == "ok"
            ),
            None,
        )
        if base:
            d, s = r["figures"]["decode_tps"], base["figures"]["decode_tps"]
            out.append((r["shape"], r["context"], r["acceptance"], d, s, d / s))
    return out


def machine_line(doc) -> str:
    m = doc["machine"]
    load = m.get("loadavg_start")
    load_end = doc.get("load_end")
    s = f"{m['backend']} / {m['chip']} / mlx {m['mlx']} / mlx-lm {m['mlx_lm']} / Python {m['python']}"
    if m["backend"] == "cpu":
        s += f" / {m['cpu_count']} cores / BLAS {m.get('blas') or 'bundled'}"
    if load:
        s += f" / load average at start {load[0]:.2f}" + (
            f", at end {load_end[0]:.2f}" if load_end else ""
        )
    return s


def file_markdown(doc, stem: str, plots: List[str]) -> str:
    suite = doc["suite"]
    out = [
        f"# Benchmark {stem}",
        "",
        f"- Machine: {machine_line(doc)}",
        f"- Command: `{doc.get('command', '')}` (started {doc.get('started')}, {doc.get('elapsed_s', '?')} s)",
        f"- Suite: {suite['name']}: "
        + "; ".join(f"{p['shape']} at contexts {p['contexts']}" for p in suite["plans"])
        + f"; max_tokens {suite['max_tokens']} "
        f"(~1 token/cycle arms: {suite.get('slow_tokens') or suite['max_tokens']}), warm-up 1, median of {suite['reps']}, {suite['dtype']}",
        f"- Measured device copy bandwidth: {doc['bandwidth_gbps']:.1f} GB/s",
        "",
    ]
    out += [f"> {n}" for n in doc.get("notes", []) if n] + [""]
    out += [f"> **{n}**" for n in doc.get("post_run_notes", [])] + (
        [""] if doc.get("post_run_notes") else []
    )
    for plot in plots:
        out.append(f"![{plot}]({plot})")
    out.append("")
    for shape in doc["shapes"]:
        out += shape_tables(doc, shape)
    for fail in doc.get("failures", []):
        out.append(f"- **{fail['shape']} failed**: {fail['error']}")
    return "\n".join(out) + "\n"


def plots(doc, stem: str, folder: Path) -> List[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plots")
        return []
    made = []
    shapes = list(doc["shapes"])
    rows = [r for r in _rows(doc) if r["status"] == "ok"]
    if not rows:
        return []
    # tok/s against context length, one line per arm (batch arms: B=1 only, per sequence).
    fig, axes = plt.subplots(1, len(shapes), figsize=(7 * len(shapes), 5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        mine = [
            r
            for r in rows
            if r["shape"] == shape and (r["arm"] != "mlx_lm.batch_generate" or r["batch"] == 1)
        ]
        for lab in dict.fromkeys(label(r) for r in mine):
            pts = sorted(
                (r["context"], r["figures"]["decode_tps"]) for r in mine if label(r) == lab
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=lab)
        limit = doc["shapes"][shape].get("physical_limit_tps")
        if limit:
            ax.axhline(limit, color="k", linestyle="--", label=f"physical limit {limit:,.0f} tok/s")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        contexts = sorted({r["context"] for r in mine})
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.set_xlabel("context length (prompt tokens)")
        ax.set_ylabel("decode tok/s per sequence")
        ax.set_title(f"{shape} ({doc['machine']['backend']}, {doc['machine']['chip']})", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    name = f"{stem}-context.png"
    fig.savefig(folder / name, dpi=110)
    plt.close(fig)
    made.append(name)
    # tok/s against batch size: mlx_lm batch_generate total and per sequence; DFlash (batch 1) as markers.
    fig, axes = plt.subplots(1, len(shapes), figsize=(7 * len(shapes), 5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        mine = [r for r in rows if r["shape"] == shape]
        for ctx in sorted({r["context"] for r in mine}):
            pts = sorted(
                (r["batch"], r["figures"]["decode_tps_total"], r["figures"]["decode_tps"])
                for r in mine
                if r["arm"] == "mlx_lm.batch_generate" and r["context"] == ctx
            )
            if pts:
                line = ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="o",
                    label=f"batch_generate total, ctx {ctx}",
                )
                ax.plot(
                    [p[0] for p in pts],
                    [p[2] for p in pts],
                    marker="x",
                    linestyle=":",
                    color=line[0].get_color(),
                    label=f"batch_generate per sequence, ctx {ctx}",
                )
            for r in mine:
                if (
                    r["arm"] == "dflash.engine"
                    and r["context"] == ctx
                    and r.get("acceptance") not in ("random", "full")
                ):
                    ax.scatter(
                        [1],
                        [r["figures"]["decode_tps"]],
                        marker="*",
                        s=80,
                        label=f"dflash ({_acc(r.get('acceptance'))}), ctx {ctx}",
                    )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        batches = sorted({r["batch"] for r in mine if r["arm"] == "mlx_lm.batch_generate"} | {1})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode tok/s")
        ax.set_title(f"{shape}: tok/s against batch size", fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    name = f"{stem}-batch.png"
    fig.savefig(folder / name, dpi=110)
    plt.close(fig)
    made.append(name)
    return made


def summary(docs: List[Tuple[str, Dict[str, Any]]]) -> List[str]:
    out = [
        "| machine | shape | ctx | acceptance | mlx_lm stream_generate tok/s | dflash tok/s | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for stem, doc in docs:
        m = doc["machine"]
        for shape, ctx, acc, d, s, ratio in headline(doc):
            out.append(
                f"| {m['backend']} {m['chip']} | {shape} | {ctx} | {_acc(acc)} | {s:,.1f} | {d:,.1f} | {ratio:.2f}x |"
            )
    return out


def run_tag(doc: Dict[str, Any]) -> str:
    """The run's --tag, from its recorded command ('' if none)."""
    words = doc.get("command", "").split()
    return words[words.index("--tag") + 1] if "--tag" in words[:-1] else ""


def readme_section(docs: List[Tuple[str, Dict[str, Any]]]) -> List[str]:
    """The short table for the README: each shape at its headline (first) context."""
    out = [
        "## Benchmarks (summary)",
        "",
        "Decode tok/s per sequence at each shape's headline context, ratio to `mlx_lm.stream_generate` on the "
        "same machine and prompt. Random-weight models of the exact shapes; DFlash acceptance is scripted "
        "(only the drafter's proposed ids are; all compute is real). Method and full tables: "
        "[../benchmarks.md](../benchmarks.md).",
        "",
        "| run (machine, start UTC, tag) | shape, context | mlx_lm stream_generate | "
        + " | ".join(l for _, l in README_ARMS)
        + " | physical limit |",
        "| --- | --- | --- |" + " --- |" * len(README_ARMS) + " --- |",
    ]
    invalid = False
    # GPU runs first, newest first; each row names its run (start time, and the --tag if any)
    newest_first = sorted(docs, key=lambda d: d[1].get("started", ""), reverse=True)
    for _, doc in sorted(newest_first, key=lambda d: d[1]["machine"]["backend"] == "cpu"):
        m = doc["machine"]
        tag = run_tag(doc)
        run = f"{m['backend']} {m['chip']}, {doc.get('started', '')[:16].replace('T', ' ')}" + (
            f" ({tag})" if tag else ""
        )
        for plan in doc["suite"]["plans"]:
            shape, ctx = plan["shape"], plan["contexts"][0]
            if shape not in doc["shapes"]:
                continue

            def find(arm, acc=None):
                return next(
                    (
                        r
                        for r in doc["results"]
                        if r["shape"] == shape
                        and r["context"] == ctx
                        and r["arm"] == arm
                        and r.get("acceptance") == acc
                    ),
                    None,
                )

            base = find(BASELINE)
            if base is None or base["status"] != "ok":
                continue
            b = base["figures"]["decode_tps"]
            rows = [find("dflash.engine", acc) for acc, _ in README_ARMS]
            invalid = invalid or any(r is not None and r.get("invalid") for r in rows)
            cells = [_cell(r, b) for r in rows]
            limit = doc["shapes"][shape]["physical_limit_tps"]
            out.append(
                f"| {run} | {shape}, {ctx} | {b:,.1f} | " + " | ".join(cells) + f" | {limit:,.0f} |"
            )
    out += [
        "",
        "Physical limit: weight bytes / measured copy bandwidth, tok/s per sequence for plain decoding "
        "(on CPU the copy runs on one MLX thread: a lower bound of the bandwidth, not a ceiling)."
        + (
            " invalid: a run made meaningless by the engine bug it exposed (fixed since; see "
            "below for the rerun)."
            if invalid
            else ""
        ),
    ]
    return out


def _replace_block(text: str, begin: str, end: str, lines: List[str]) -> str:
    if begin not in text or end not in text:
        return text
    head, rest = text.split(begin, 1)
    return head + begin + "\n" + "\n".join(lines) + "\n" + end + rest.split(end, 1)[1]


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("files", nargs="*", help="results JSON (default: docs/results/*.json)")
    ap.add_argument(
        "--page",
        default=str(PAGE),
        help="markdown page whose generated block is refreshed ('' to skip)",
    )
    args = ap.parse_args(argv)
    files = [Path(f) for f in args.files] or sorted(DOCS.glob("*.json"))
    docs = []
    for path in files:
        doc = json.loads(path.read_text())
        if not all(k in doc for k in ("suite", "machine", "results", "shapes")):
            print(f"skipped {path}: not a benchmarks.run results file")
            continue
        stem = path.stem
        made = plots(doc, stem, path.parent)
        (path.parent / f"{stem}.md").write_text(file_markdown(doc, stem, made))
        docs.append((stem, doc))
        print(f"wrote {path.parent / (stem + '.md')} and {len(made)} plots")
    page = Path(args.page) if args.page else None
    if page and page.exists():
        block = (
            [
                "",
                "Generated by `python -m benchmarks.report` from docs/results/*.json.",
                "",
                "All DFlash runs against mlx_lm stream_generate at the same context:",
                "",
            ]
            + summary(docs)
            + [""]
        )
        for stem, doc in docs:
            block.append(f"- [{stem}]({stem}.md): {machine_line(doc)}")  # the page sits beside them
        text = _replace_block(page.read_text(), BEGIN, END, block + [""])
        text = _replace_block(text, README_BEGIN, README_END, readme_section(docs))
        page.write_text(text)
        print(f"refreshed {page}")
        readme = page.parent.parent / "README.md"
        if readme.exists() and README_BEGIN in readme.read_text():
            readme.write_text(
                _replace_block(readme.read_text(), README_BEGIN, README_END, readme_section(docs))
            )
            print(f"refreshed {readme}")


if __name__ == "__main__":
    main()
