"""benchmarks/never_loses.py's smoke mode runs both parts end to end on this CPU (a tiny shape, a
tiny job) and writes its JSON and markdown; its figures are not checked against any speed."""

from __future__ import annotations

import json

from benchmarks import never_loses


def test_the_chat_prompts_are_short_and_distinct():
    prompts = never_loses.chat_prompts(100)
    assert len(prompts) == 32 == len(set(prompts))
    assert all(0 < len(p) < 100 for p in prompts)


def test_smoke_run_writes_both_parts_side_by_side(tmp_path):
    path = never_loses.main(["--smoke", "--out", str(tmp_path), "--machine", "test"])
    doc = json.loads(path.read_text())
    assert doc["smoke"] and doc["shape"] == "qwen3-tiny"
    assert set(doc["random_drafter"]) == {"2", "4"} and set(doc["default_pair"]) == {"2"}
    for part, arm in (("random_drafter", "random drafter"), ("default_pair", "drafter")):
        for figures in doc[part].values():
            plain, drafting = figures["plain"], figures[arm]
            assert plain["tokens"] == drafting["tokens"] > 0  # the same job on both arms
            assert figures["ratio"] == drafting["tok_s"] / plain["tok_s"]
            assert plain["cycles"] and drafting["cycles"]
            for arm_figures in (
                plain,
                drafting,
            ):  # the shapes each arm ran first: its warm-up job's at least
                assert (
                    arm_figures["warm_up_new_shape_cycles"]
                    >= arm_figures["warm_up_new_width_cycles"]
                    > 0
                )
                assert (
                    len(arm_figures["new_shape_cycles_runs"])
                    == len(arm_figures["new_width_cycles_runs"])
                    == 1
                )
                assert (
                    arm_figures["new_shape_cycles"]
                    == len(arm_figures["new_shapes"])
                    >= arm_figures["new_width_cycles"]
                )
    md = path.with_suffix(".md").read_text()
    assert "| 4 |" in md and "default pair" in md and "cycles of new shapes" in md
