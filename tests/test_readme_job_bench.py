"""benchmarks/readme_job.py's summary: medians per arm and part, the ratio, and the check that
the drafter never changes the text (no job is run here: each run is a 20 s process)."""

from benchmarks import readme_job


def _run(arm, whole, outputs, warm=0.0):
    return {
        "arm": arm,
        "start": 0.4,
        "load": 1.5,
        "warm-up": warm,
        "decode": whole - 1.9 - warm,
        "whole": whole,
        "outputs": outputs,
    }


def test_summary_takes_medians_and_the_ratio_of_plain_to_drafter():
    same = {"a": "hello", "b": "world"}
    runs = [_run("draft", w, same, 1.0) for w in (18.0, 19.0, 30.0)] + [
        _run("no-draft", w, same) for w in (17.0, 17.1, 16.9)
    ]
    s = readme_job.summary(runs)
    assert s["median_s"]["draft"]["whole"] == 19.0 and s["median_s"]["no-draft"]["whole"] == 17.0
    assert s["median_s"]["draft"]["warm-up"] == 1.0
    assert s["ratio"] == round(17.0 / 19.0, 3)
    assert s["pair_ratios"] == [round(17.0 / 18.0, 3), round(17.1 / 19.0, 3), round(16.9 / 30.0, 3)]
    assert s["outputs_identical"]


def test_summary_flags_outputs_that_differ_between_runs():
    runs = [_run("draft", 18.0, {"a": "hello"}), _run("no-draft", 17.0, {"a": "hullo"})]
    assert not readme_job.summary(runs)["outputs_identical"]
