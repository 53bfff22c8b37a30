"""What speculation saved, as the runner reports it: the result columns, the job's figures in
``status``, the run summary and the Python API, and ``--control`` (its rows decoded plainly).

The fake engine (tests/fake_engine.py) gives each row known figures: a row of 11 tokens decodes
10 in 5 cycles of 4 ms a row (its share: 20 ms), 30 ms at a plain cycle's 3 ms a row; a control
row takes 10 cycles (40 ms) for the same 30 ms plain. So drafted rows run 1.5x plain decoding, at
500 tok/s against 333.3 estimated for plain and 250 measured on the control rows."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dflash_batch
from dflash_batch.cli import main
from dflash_batch.request import control_row
from dflash_batch.runner import saved
from dflash_batch.runner.spec import SpecError
from dflash_batch.runner.store import RESULT_SCHEMA
from tests.runner_fixtures import engine, fake_models, home, write_jsonl  # noqa: F401

ROWS = [{"id": f"q{i}", "prompt": f"Question {i}: what is it?"} for i in range(8)]
CONTROL = {r["id"] for r in ROWS if control_row(0.5, r["id"])}


def test_the_rows_are_split_between_control_and_drafted():
    assert 0 < len(CONTROL) < len(ROWS)  # the tests below need both kinds


def test_result_rows_carry_what_speculation_saved(tmp_path, home, engine):
    src = write_jsonl(tmp_path / "in.jsonl", ROWS)
    job = dflash_batch.run(
        src, engine=engine, max_tokens=11, control=0.5, output_dir=str(tmp_path / "out")
    )
    assert {r.id for r in engine.requests if r.control} == CONTROL
    df = pd.read_parquet(tmp_path / "out").set_index("id")
    assert pq.read_schema(next((tmp_path / "out").glob("part-*.parquet"))).equals(
        RESULT_SCHEMA, check_metadata=False
    )
    for row_id, row in df.iterrows():
        control = row_id in CONTROL
        assert row["control"] == control
        assert row["plain_seconds_est"] == pytest.approx(0.03)
        assert row["decode_share_s"] == pytest.approx(0.04 if control else 0.02)
        assert row["speedup_vs_plain"] == pytest.approx(0.75 if control else 1.5)
        assert (row["drafted_tokens"] == 0) == control
    assert len(job.to_pandas()) == len(ROWS)


def test_status_and_the_api_give_the_jobs_figures(tmp_path, home, engine):
    src = write_jsonl(tmp_path / "in.jsonl", ROWS)
    job = dflash_batch.run(
        src, engine=engine, max_tokens=11, control=0.5, output_dir=str(tmp_path / "out")
    )
    drafted = len(ROWS) - len(CONTROL)
    f = job.speculation()
    assert f == job.status()["speculation"]
    assert job.status()["speedup_vs_plain"] == pytest.approx(1.5)
    assert (f["rows"], f["control_rows"]) == (drafted, len(CONTROL))
    assert f["decode_s"] == pytest.approx(0.02 * drafted) and f["plain_s_est"] == pytest.approx(
        0.03 * drafted
    )
    assert f["speedup"] == pytest.approx(1.5)
    assert f["tokens_per_s"] == pytest.approx(500.0)
    assert f["plain_tokens_per_s_est"] == pytest.approx(1000 / 3)
    assert f["control_tokens_per_s"] == pytest.approx(250.0)
    assert f["control_speedup"] == pytest.approx(2.0)


def test_the_run_summary_and_status_say_it(tmp_path, home, fake_models, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", ROWS)
    flags = [
        "--target",
        fake_models["target"],
        "--draft",
        fake_models["draft"],
        "--max-tokens",
        "11",
        "--no-progress",
    ]
    assert main(["run", str(src), *flags, "--control", "0.5"]) == 0
    said = capsys.readouterr().out
    drafted = len(ROWS) - len(CONTROL)
    assert (
        f"speculation: 1.50x plain decoding on this job ({0.02 * drafted:.2f} s of decoding against "
        f"{0.03 * drafted:.2f} s estimated for plain decoding, {drafted} rows)"
    ) in said
    assert (
        f"control: {len(CONTROL)} rows decoded plainly in the same batch ran at 250.0 tok/s, the drafted "
        "rows at 500.0 (2.00x); plain decoding estimated at 333.3"
    ) in said
    assert main(["status"]) == 0
    assert "speculation: 1.50x plain decoding on this job" in capsys.readouterr().out
    # without control rows: the estimate alone
    assert main(["run", str(src), *flags, "-o", str(tmp_path / "plain")]) == 0
    said = capsys.readouterr().out
    assert (
        "speculation: 1.50x plain decoding on this job (0.16 s of decoding against 0.24 s" in said
    )
    assert "control:" not in said


@pytest.mark.parametrize(
    "value, says",
    [
        ("1.5", "got 1.5"),
        ("-0.1", "got -0.1"),
        ("nan", "got nan"),
        ("inf", "got inf"),
    ],
)
def test_bad_control_values_are_refused(tmp_path, home, fake_models, capsys, value, says):
    src = write_jsonl(tmp_path / "in.jsonl", ROWS[:2])
    assert (
        main(
            [
                "run",
                str(src),
                "--target",
                fake_models["target"],
                f"--control={value}",
                "--no-progress",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "'control' must be a number from 0 to 1" in err and says in err
    assert not (home / "jobs").exists()  # refused before any record


def test_control_is_refused_where_it_cannot_mean_anything(
    tmp_path, home, fake_models, capsys, engine
):
    src = write_jsonl(tmp_path / "in.jsonl", ROWS[:2])
    with pytest.raises(SystemExit) as refused:  # argparse's own refusal
        main(["run", str(src), "--target", fake_models["target"], "--control", "x"])
    assert refused.value.code == 2
    assert "argument --control: must be a number from 0 to 1, got 'x'" in capsys.readouterr().err
    assert main(["submit", str(src), "--no-draft", "--control", "0.2"]) == 2
    assert "'control' needs a drafter" in capsys.readouterr().err
    (tmp_path / "job.yaml").write_text(f"input: {src}\ncontrol: lots\n")
    with pytest.raises(
        SpecError, match=r"job.yaml: 'control' must be a number from 0 to 1 .*got 'lots'"
    ):
        dflash_batch.run(tmp_path / "job.yaml", engine=engine)
    with pytest.raises(SpecError, match="'control' must be a number"):
        dflash_batch.submit(src, control=True)


def test_control_rows_are_a_stable_share():
    ids = [f"item-{i}" for i in range(4000)]
    picked = [i for i in ids if control_row(0.2, i)]
    assert 0.18 * len(ids) < len(picked) < 0.22 * len(ids)
    assert picked == [i for i in ids if control_row(0.2, i)]  # the same rows every time
    assert set(picked) <= {i for i in ids if control_row(0.5, i)}  # a larger share keeps them
    assert not any(control_row(0.0, i) for i in ids) and all(control_row(1.0, i) for i in ids)
    differ = sum(
        control_row(0.5, i, 0) != control_row(0.5, i, 1) for i in ids
    )  # an item's samples drawn apart
    assert 0.45 * len(ids) < differ < 0.55 * len(ids)


def test_rows_without_a_drafter_or_an_estimate_claim_nothing():
    plain = {
        "status": "ok",
        "block_size": 0,
        "completion_tokens": 9,
        "decode_share_s": 0.1,
        "plain_seconds_est": 0.1,
    }
    fixed = dict(
        plain, block_size=8, plain_seconds_est=None
    )  # a fixed width: no plain cycle measured
    for rows in ([plain], [fixed], []):
        f = saved.figures(rows)
        assert f["speedup"] is None and saved.text(f) is None


def test_parts_from_before_the_columns_still_read(tmp_path, home, engine):
    """A part written before these columns existed: its rows count, with no figures."""
    src = write_jsonl(tmp_path / "in.jsonl", ROWS[:3])
    job = dflash_batch.run(src, engine=engine, max_tokens=5, output_dir=str(tmp_path / "out"))
    [part] = (tmp_path / "out").glob("part-*.parquet")
    old = pq.read_table(part).drop_columns(
        ["decode_share_s", "plain_seconds_est", "speedup_vs_plain", "control"]
    )
    pq.write_table(old, part)
    status = job.status()
    assert status["ok"] == 3 and status["speculation"]["speedup"] is None
    assert job.to_arrow().column("control").null_count == 3
    assert isinstance(job.to_arrow().schema.field("speedup_vs_plain").type, pa.DataType)


def test_the_serve_status_page_shows_it(tmp_path, home, engine):
    from dflash_batch.server import page

    src = write_jsonl(tmp_path / "in.jsonl", ROWS[:3])
    job = dflash_batch.run(src, engine=engine, max_tokens=11, output_dir=str(tmp_path / "out"))
    data = page.figures(home, {})
    [shown] = data["jobs"]
    assert shown["id"] == job.id and shown["speedup_vs_plain"] == pytest.approx(1.5)
    assert '<td class="num">1.50x</td>' in page.html_page(data)
