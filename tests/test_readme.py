"""The README's commands run as written after its own set-up (programs from `.venv/bin`), and the
default-pair figures it quotes are the ones the benchmark command it names wrote."""

from __future__ import annotations

import json
import re

from tests.runner_fixtures import REPO

README = (REPO / "README.md").read_text()
SET_UP = ("bash .ci/install && .venv/bin/dflash-batch run examples/prompts.jsonl", "bash .ci/install && .venv/bin/python -m pytest -q")
# A program the install puts in .venv/bin, named where a command starts (not as part of a path).
BARE = re.compile(r"(?<![\w./-])(?<!-m )(dflash-batch|python3?|pytest|pip3?|honcho)(?=\s|$)")


def shell_blocks(text: str):
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def command_lines(text: str):
    """Lines of the bash blocks and inline code spans that are commands, without comments."""
    lines = [line.split(" # ")[0].strip() for block in shell_blocks(text) for line in block.splitlines()]
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    lines += [s for s in spans if BARE.match(s) or s.startswith((".venv/bin/", "bash "))]
    return [line for line in lines if line and not line.startswith("#")]


def test_readme_commands_name_the_programs_of_the_venv():
    for command in SET_UP:  # the two fresh-machine commands stay as they are
        assert f"\n{command}\n" in README, command
    bare = [line for line in command_lines(README) if BARE.search(line)]
    assert bare == [], f"not on PATH after the README's install: {bare}"
    assert ".venv/bin/dflash-batch submit examples/prompts.jsonl" in README
    assert ".venv/bin/python -c \"import pandas" in README


def test_readme_default_pair_figures_are_what_the_benchmark_measured():
    paragraph = " ".join(README[README.index("Default pair (SmolLM2-135M-Instruct") :].split("\n\n")[0].split())
    named = re.search(r"`(docs/results/default-pair-cpu-[\w.-]+)\.md`", paragraph)  # the file it quotes
    assert named, "the paragraph names no CPU default-pair result"
    result = json.loads((REPO / f"{named.group(1)}.json").read_text())
    command = ".venv/bin/" + result["command"]
    assert f"`{command}`" in paragraph, command
    tau = re.search(r"mean acceptance length \*\*([\d.]+)\*\*", paragraph)
    assert tau and float(tau.group(1)) == round(result["mean_acceptance_length"], 2)
    assert f"{result['exact_prompts']}/{result['held_out_prompts']} outputs identical" in paragraph
    over_all = re.search(r"over all held-out prompts: \*\*([\d.]+)x\*\*", paragraph)
    assert over_all and float(over_all.group(1)) == round(result["all_prompts_speedup"], 2)
    first = re.search(r"on the first \d+ prompts: \*\*([\d.]+)x\*\*", paragraph)
    assert first and float(first.group(1)) == round(result["speedup_median"], 2)
    if result["all_prompts_speedup"] < 1:
        assert "slower than plain decoding" in paragraph and "does not help" in paragraph
