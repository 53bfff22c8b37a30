"""Nothing a job is given (flags, YAML fields, input rows, job ids, schedule names) places a file
outside the job's own folder under the home, or outside an output folder given explicitly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import dflash_batch
from dflash_batch import checks
from dflash_batch.runner.spec import SpecError, load_spec
from tests.runner_fixtures import cli, engine, fake_models, home, write_jsonl  # noqa: F401

TRAVERSALS = ["../../escape", "../escape", "/tmp/dflash-escape", "a/../../escape", "..", ".", ".hidden",
              "a\\..\\b", "new\nline", "tab\tname", "", " lead", "trail ", "x" * 250, "nul\x00byte"]  # fmt: skip
FINE = ["articles-qa", "job.v2", "under_score", "résumé 2026", "数据集", "_private", "A1"]


def files(root: Path) -> set:
    """Every file, folder and link under ``root`` (links not followed)."""
    return {p for p in root.rglob("*")}


def created_outside(root: Path, before: set, *allowed: Path) -> list:
    return sorted(
        str(p) for p in files(root) - before if not any(p == a or a in p.parents for a in allowed)
    )


def model_flags(fake_models):
    return [
        "--target",
        fake_models["target"],
        "--draft",
        fake_models["draft"],
        "--max-tokens",
        "2",
        "--no-progress",
    ]


@pytest.mark.parametrize("name", TRAVERSALS)
def test_plain_name_refuses_paths_and_odd_names(name):
    with pytest.raises(checks.BadValue, match="must be a plain name"):
        checks.plain_name(name)


@pytest.mark.parametrize("name", FINE)
def test_plain_names_that_are_fine(tmp_path, name):
    assert checks.plain_name(name) == name
    spec = load_spec(write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}]), name=name)
    assert (
        spec.resolved_output_dir(tmp_path / "home")
        == (tmp_path / "home" / "results" / name).resolve()
    )


def test_name_flag_cannot_leave_the_home(tmp_path, home, fake_models):
    src = write_jsonl(tmp_path / "one.jsonl", [{"id": "a", "prompt": "Hello"}])
    before = files(tmp_path)
    for name in ("../../escape_cli", str(tmp_path / "abs_cli"), "sub/dir", ".hidden", ".."):
        out = cli("run", src, "--name", name, *model_flags(fake_models), home=home)
        assert out.returncode == 2, (name, out.stdout, out.stderr)
        assert "'name' must be a plain name" in out.stderr and "Traceback" not in out.stderr
    assert created_outside(tmp_path, before, home) == []
    assert not (home / "jobs").exists()  # refused before anything was written


def test_yaml_fields_cannot_leave_the_home(tmp_path, home, fake_models):
    write_jsonl(tmp_path / "one.jsonl", [{"id": "a", "prompt": "Hello"}])
    model = f"model: {{target: {fake_models['target']}, draft: {fake_models['draft']}}}\n"
    cases = {
        "name: ../../escape_yaml\n": "'name' must be a plain name",
        f"name: {tmp_path / 'abs_yaml'}\n": "'name' must be a plain name",
        "output_dir: '{home.parent}/escape_attr'\n": "'output_dir' may use only the placeholders",
        "output_dir: '{home!r}/escape_conv'\n": "'output_dir' may use only the placeholders",
        "output_dir: '{name:>20}'\n": "'output_dir' may use only the placeholders",
        "output_dir: '{}/escape_positional'\n": "'output_dir' may use only the placeholders",
        "model: {target_revision: ../../../escape_rev}\n": "'target_revision' must be a branch, tag or commit",
        "model: {draft_revision: /abs/escape}\n": "'draft_revision' must be a branch, tag or commit",
        "name: ../escape_cron\nschedule: '@daily'\n": "'name' must be a plain name",
    }
    before = files(tmp_path)
    for text, message in cases.items():
        spec = tmp_path / "job.yaml"
        spec.write_text("input: one.jsonl\n" + (model if "model:" not in text else "") + text)
        for command in ("run", "submit"):
            out = cli(command, spec, home=home)
            assert out.returncode == 2 and message in out.stderr, (text, command, out.stderr)
    assert created_outside(tmp_path, before, home, tmp_path / "job.yaml") == []
    assert not (home / "schedules").exists() and not (home / "jobs").exists()


def test_a_symlink_in_the_home_does_not_lead_outside(tmp_path, home, fake_models):
    src = write_jsonl(tmp_path / "one.jsonl", [{"id": "a", "prompt": "Hello"}])
    outside = tmp_path / "outside"
    outside.mkdir()
    (home / "results").mkdir(parents=True)
    (home / "results" / "linked").symlink_to(outside)
    before = files(tmp_path)
    out = cli("run", src, "--name", "linked", *model_flags(fake_models), home=home)
    assert out.returncode == 2 and "outside" in out.stderr and "set output_dir" in out.stderr
    assert created_outside(tmp_path, before, home) == [] and not list(outside.iterdir())
    # An output dir given explicitly may be anywhere, but its lock and journals are not symlinks.
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out_dir = tmp_path / "explicit"
    out_dir.mkdir()
    (out_dir / ".lock").symlink_to(victim)
    out = cli("run", src, "--output-dir", out_dir, *model_flags(fake_models), home=home)
    assert out.returncode == 2 and ".lock is a symlink" in out.stderr
    assert victim.read_text() == "keep me"
    (out_dir / ".lock").unlink()
    (out_dir / ".inflight").symlink_to(outside)
    out = cli("run", src, "--output-dir", out_dir, *model_flags(fake_models), home=home)
    assert out.returncode == 2 and ".inflight is a symlink" in out.stderr
    assert not list(outside.iterdir())


def test_job_ids_and_schedule_names_are_not_paths(tmp_path, home):
    outside = tmp_path / "outside-job"
    outside.mkdir()
    (outside / "job.json").write_text("{}")
    (outside / "keep.yaml").write_text("input: x.jsonl\n")
    (home / "jobs").mkdir(parents=True)
    for job in ("../../outside-job", str(outside), "../", ""):
        for command in (["status", job], ["cancel", job], ["retry", job], ["results", job]):
            out = cli(*command, home=home)
            assert out.returncode == 4 and "is not a job id" in out.stderr, (command, out.stderr)
    assert sorted(p.name for p in outside.iterdir()) == [
        "job.json",
        "keep.yaml",
    ]  # no 'cancelled' marker
    for name in ("../../outside-job/keep", str(outside / "keep"), ".hidden"):
        out = cli("unschedule", name, home=home)
        assert out.returncode == 4 and "is not a schedule name" in out.stderr
    assert (outside / "keep.yaml").exists()


def test_input_rows_do_not_reach_the_file_system(tmp_path, home, engine):
    rows = [
        {"id": "../../escape_row", "prompt": "Hello", "metadata": {"path": "/etc/passwd"}},
        {"id": "/tmp/dflash-abs-row", "prompt": "Hello again"},
        {
            "custom_id": "../../../escape_openai",
            "body": {"model": "../../m", "messages": [{"role": "user", "content": "Hi"}]},
        },
        {"id": ".hidden\nrow", "prompt": "odd"},
        {"id": "{home}/x", "prompt": "braces"},
    ]
    src = write_jsonl(tmp_path / "rows.jsonl", rows)
    before = files(tmp_path)
    job = dflash_batch.run(src, engine=engine, max_tokens=2, export_openai=True, name="rows")
    assert job.status()["ok"] == 5
    assert created_outside(tmp_path, before, home) == []
    assert job.output_dir == (home / "results" / "rows").resolve()
    ids = set(job.to_pandas()["id"])
    assert {
        "../../escape_row",
        "/tmp/dflash-abs-row",
        "../../../escape_openai",
        ".hidden\nrow",
        "{home}/x",
    } == ids
    exported = [
        json.loads(x)["custom_id"]
        for x in (job.output_dir / "_openai_output.jsonl").read_text().splitlines()
    ]
    assert sorted(exported) == sorted(ids)


def test_default_names_from_odd_file_names_stay_plain(tmp_path):
    for stem in ("we ird;name$", "..", "-dash", "ünï cödé", "a" * 300):
        path = write_jsonl(tmp_path / f"{stem[:200]}.jsonl", [{"prompt": "x"}])
        spec = load_spec(path)
        out = spec.resolved_output_dir(tmp_path / "home")
        assert out.parent == (tmp_path / "home" / "results").resolve(), stem
        checks.plain_name(out.name)


def test_revisions_git_accepts_are_accepted(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    for rev in ("main", "v1.2", "refs/pr/1", "a" * 40, "release/2026-01"):
        assert load_spec(src, target="org/m", target_revision=rev).target_revision == rev
    for rev in (
        "../x",
        "a/../b",
        "/abs",
        "a//b",
        "x.lock",
        "a b",
        "@{1}",
        ".hidden",
        "a/.b",
        "end/",
    ):
        with pytest.raises(SpecError, match="'target_revision' must be a branch, tag or commit"):
            load_spec(src, target="org/m", target_revision=rev)


def test_empty_paths_are_refused_not_read_as_the_current_folder(tmp_path, home, engine):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello"}])
    for key in ("output_dir", "target", "id_field", "prompt_field", "messages_field"):
        with pytest.raises(SpecError, match=f"'{key}' is empty"):
            load_spec(src, **{key: ""})
    out = cli("run", src, "--output-dir", "", home=home)
    assert out.returncode == 2 and "'output_dir' is empty" in out.stderr
    job = dflash_batch.run(src, engine=engine, max_tokens=2)
    for fmt in ("jsonl", "parquet"):
        out = cli(
            "results",
            job.id,
            "--format",
            fmt,
            "--out",
            tmp_path / "no-such-dir" / f"x.{fmt}",
            home=home,
        )
        assert (
            out.returncode == 2 and "cannot write" in out.stderr and "Traceback" not in out.stderr
        )
