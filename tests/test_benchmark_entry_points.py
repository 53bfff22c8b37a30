"""Every benchmark entry point starts, so none rots unseen: each ``benchmarks/*.py`` with a
``__main__`` guard answers ``python -m benchmarks.X --help`` with its usage, every other module
imports without running anything, the shell scripts parse, and the scale-out benchmark runs its
CPU path end to end on a tiny pair (two arms, each warmed before it is timed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import scaleout

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
MODULES = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "__init__.py")
ENTRY_POINTS = [p.stem for p in MODULES if '__name__ == "__main__"' in p.read_text()]
LIBRARY = [p.stem for p in MODULES if p.stem not in ENTRY_POINTS]


def python(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [sys.executable, *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_the_entry_points_are_found():
    assert {"run", "scaleout", "readme_job", "ncu_attention", "ncu_summary"} <= set(ENTRY_POINTS)
    assert {"shapes", "scripted", "arms"} <= set(LIBRARY)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_entry_point_prints_its_usage(name):
    done = python("-m", f"benchmarks.{name}", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: "), done.stdout
    assert "Traceback" not in done.stderr
    assert "imported before dflash_batch.engine" not in done.stderr  # MLX's slow BLAS on a CPU


@pytest.mark.parametrize("name", LIBRARY)
def test_library_module_imports_without_running(name):
    done = python("-c", f"import benchmarks.{name}")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.sh")))
def test_shell_script_parses(script):
    done = subprocess.run(["bash", "-n", str(BENCHMARKS / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# -- scale-out -------------------------------------------------------------------------------


def test_scaleout_worker_counts():
    assert scaleout.counts("1,2") == [1, 2]
    assert scaleout.counts("2") == [1, 2]  # a single N: 1 and N, as before
    assert scaleout.counts("1,2,1,2") == [1, 2, 1, 2]
    args = scaleout.checked_args(["--devices", "0,1,2,3"])
    assert args.workers == [1, 4] and args.dtype == "float32"
    assert scaleout.checked_args(["--shape", "qwen3-4b"]).dtype == "bfloat16"


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--workers", "0"], "--workers"),
        (["--workers", "1,x"], "--workers"),
        (["--devices", "gpu0"], "--devices"),
        (["--rows", "0"], "--rows"),
        (["--chunk-size", "-1"], "--chunk-size"),
        (["--warmup-jobs", "-1"], "--warmup-jobs"),
        (["--target", "/no/such/model"], "--target"),
    ],
)
def test_scaleout_refuses_bad_arguments_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        scaleout.checked_args(argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_scaleout_refuses_an_unknown_shape_before_starting_workers(tmp_path):
    out = tmp_path / "r.json"
    done = python("-m", "benchmarks.scaleout", "--shape", "qwen9-huge", "--out", str(out))
    assert done.returncode == 2, done.stderr
    assert "--shape" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()


def test_scaleout_stops_when_a_worker_cannot_load_the_model(tmp_path):
    (tmp_path / "empty").mkdir()  # a folder, but no model in it: the worker's load fails
    done = python("-m", "benchmarks.scaleout", "--target", str(tmp_path / "empty"),
                  "--workers", "1", "--load-timeout", "300")  # fmt: skip
    assert done.returncode == 1
    assert "a worker could not load the model" in done.stderr and "config.json" in done.stderr
    assert done.stdout == ""  # no result for a run that did not happen


LOG = """\
INFO worker: chunk 0 of warm-1 (with chunks [0, 1]): 4 generated (0 errors), 0 already done
INFO worker: chunk 3 of warm-1 is held by vm-1-ab: dropped
INFO worker: chunk 2 of timed-1 (with chunks [2]): 2 generated (0 errors), 0 already done
INFO worker: chunk 0 of timed-1 (with chunks [0, 1, 3]): 6 generated (0 errors), 0 already done
"""


def test_scaleout_counts_the_chunks_of_one_job_only(tmp_path):
    log = tmp_path / "worker.log"
    log.write_text(LOG)
    assert scaleout.chunks_of("warm-1", log) == 2
    assert scaleout.chunks_of("timed-1", log) == 4
    assert scaleout.chunks_of("timed", log) == 0


def fake_warm_up(monkeypatch, ran_by_job, warmup_jobs):
    """``scaleout.warm_up`` with jobs that finish at once; ``ran_by_job[k]``: the chunks each
    worker ran of job k."""
    submitted = []

    def submit_job(root, arm, model, args, name):
        submitted.append(name)
        return SimpleNamespace(id=name, wait=lambda **kw: {"state": "completed"})

    def chunks_by_worker(job_id, logs, chunks):
        return ran_by_job[submitted.index(job_id)]

    monkeypatch.setattr(scaleout, "submit_job", submit_job)
    monkeypatch.setattr(scaleout, "chunks_by_worker", chunks_by_worker)
    args = SimpleNamespace(warmup_jobs=warmup_jobs, rows=8, chunk_size=2, timeout=60)
    logs = [Path("a.log"), Path("b.log")]
    return scaleout.warm_up(Path("root"), "arm", logs, {}, args), submitted


def test_scaleout_warms_until_every_worker_has_run_a_chunk(monkeypatch):
    warm, jobs = fake_warm_up(monkeypatch, [[4, 0], [1, 3], [2, 2]], warmup_jobs=3)
    assert jobs == ["warmup-1", "warmup-2"]  # the second job reached the idle worker: no third
    assert warm["jobs"] == 2 and warm["states"] == ["completed"] * 2
    assert warm["chunks_per_worker"] == [5, 3] and warm["every_worker_warm"] is True


def test_scaleout_says_when_a_worker_stayed_cold(monkeypatch):
    warm, jobs = fake_warm_up(monkeypatch, [[4, 0], [4, 0]], warmup_jobs=2)
    assert jobs == ["warmup-1", "warmup-2"]
    assert warm["every_worker_warm"] is False and warm["chunks_per_worker"] == [8, 0]
    warm, jobs = fake_warm_up(monkeypatch, [], warmup_jobs=0)
    assert jobs == [] and warm["jobs"] == 0 and warm["every_worker_warm"] is False


@pytest.mark.slow
def test_scaleout_cpu_path_runs_two_warmed_arms_and_writes_every_id_once(tmp_path):
    out = tmp_path / "scaleout.json"
    done = python(
        "-m",
        "benchmarks.scaleout",
        "--workers",
        "1,2",
        "--rows",
        "8",
        "--chunk-size",
        "2",
        "--max-tokens",
        "4",
        "--out",
        str(out),
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["model"] == "qwen3-tiny (random weights, float32)"
    assert "warm-up jobs identical to the timed job" in result["warmup"]
    assert [r["workers"] for r in result["runs"]] == [1, 2]
    for run in result["runs"]:
        assert run["state"] == "completed" and run["every_id_exactly_once"]
        assert run["warmup"]["jobs"] >= 1 and set(run["warmup"]["states"]) == {"completed"}
        assert sum(run["chunks_per_worker"]) == 4  # the timed job's own chunks, warm-up ones apart
        assert len(run["chunks_per_worker"]) == run["workers"]
    assert result["runs"][0]["speedup"] == 1.0
    assert result["speedup"] == result["runs"][1]["speedup"]
