"""benchmarks/cycle_host.py on the tiny shape: every cycle's pieces are timed, they add up to the
host total, and the job it times is the engine's own (no timing assertions)."""

import json

import dflash_batch.engine  # noqa: F401  (BLAS before mlx)

from benchmarks import cycle_host


def test_cycle_host_times_every_piece_of_every_cycle(capsys):
    cycle_host.main(["--batches", "2", "--max-tokens", "40", "--reps", "1"])
    (line,) = capsys.readouterr().out.strip().splitlines()
    result = json.loads(line)
    pieces = result["ms_per_cycle"]
    assert (
        result["rows"] == 2 and result["tokens"] == 80 and result["cycles"] == 3
    )  # 1 + 16 + 16 + 7 per row
    for name in (
        "device",
        "draft",
        "verify",
        "feed",
        "accepted (width policy)",
        "width_policy.width (adaptive, on the side)",
    ):
        assert pieces[name] > 0, name
    host = sum(v for k, v in pieces.items() if k not in ("device", cycle_host.PREFILL))
    assert abs(host - result["host_ms_per_cycle"]) < 0.01 * len(pieces)


def test_cycle_host_whole_jobs_run_unwrapped(capsys):
    cycle_host.main(["--batches", "2", "--max-tokens", "24", "--reps", "1", "--whole"])
    result = json.loads(capsys.readouterr().out.strip())
    assert result["whole"] and result["tokens"] == 48 and result["decode_tok_s"] > 0
