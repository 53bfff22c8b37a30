"""The README's commands run as written after its own set-up (programs from `.venv/bin`), and the
default-pair figures it quotes are the ones the benchmark command it names wrote."""

from __future__ import annotations

import json
import re

from tests.helpers import BARE, README, REPO, SET_UP, command_lines


def test_readme_commands_name_the_programs_of_the_venv():
    for command in SET_UP:  # the two fresh-machine commands stay as they are
        assert f"\n{command}\n" in README, command
    bare = [line for line in command_lines(README) if BARE.search(line)]
    assert bare == [], f"not on PATH after the README's install: {bare}"
    assert ".venv/bin/dflash-batch submit examples/prompts.jsonl" in README
    assert ".venv/bin/dflash-batch results $JOB --text" in README  # the answers, one command


def test_readme_speed_table_quotes_its_result_files():
    """Each row of the speed table: the figures are those of the result file it links."""
    rows = [
        line
        for line in README.split("\n## ")[0].splitlines()
        if "](docs/results/" in line and line.startswith("|")
    ]
    assert len(rows) == 2, rows
    cpu, gpu = rows
    result = json.loads(
        (REPO / re.search(r"\((docs/results/default-pair-cpu[\w.-]+)\.md\)", cpu).group(1))
        .with_suffix(".json")
        .read_text()
    )
    assert f"| {result['all_prompts_mlx_lm_decode_tps']:.2f} tok/s |" in cpu
    assert (
        f"| {result['all_prompts_dflash_decode_tps']:.2f} tok/s (**{result['all_prompts_speedup']:.2f}x**)"
        in cpu
    )
    assert f"{result['exact_prompts']}/{result['held_out_prompts']} identical" in cpu
    assert f"{result['held_out_prompts']} held-out prompts" in cpu
    page = (
        REPO / re.search(r"\((docs/results/batched-h100[\w.-]+\.md)\)", gpu).group(1)
    ).read_text()
    plain, dflash = re.search(r"\| ([\d,]+) tok/s \| ([\d,]+) tok/s \(\*\*([\d.]+)x", gpu).groups()[
        :2
    ]
    ratio = re.search(r"\(\*\*([\d.]+)x\*\*\)", gpu).group(1)
    assert re.search(rf"^\| mlx_lm.batch_generate \|.*\| {plain} \(gen \d+\) \|$", page, re.M), (
        plain
    )
    assert re.search(rf"^\| dflash tau=6.5 \|.*\| {dflash} \({ratio}x\) \|$", page, re.M), (
        dflash,
        ratio,
    )
