"""A schedule removed (`unschedule`) while a worker that registered it runs: each time the
removed cron fires, one quiet log line, not an ERROR traceback."""

from __future__ import annotations

import datetime
import logging

from dflash_batch import api
from dflash_batch.runner.cron import Cron
from dflash_batch.runner.queue import Queue
from tests.runner_fixtures import fake_models, home, write_jsonl  # noqa: F401

PROMPTS = [{"id": f"p{i}", "prompt": f"Prompt number {i}."} for i in range(2)]


def test_a_removed_schedule_firing_in_a_worker_is_one_quiet_line(
    tmp_path, home, fake_models, caplog
):
    write_jsonl(tmp_path / "docs.jsonl", PROMPTS[:2])
    spec = tmp_path / "nightly.yaml"
    spec.write_text(
        f"name: nightly\ninput: docs.jsonl\nschedule: '0 2 * * *'\n"
        f"model: {{target: {fake_models['target']}}}\n"
    )
    registered = api.add_schedule(spec, home=home)
    cron = Cron(Queue(home))
    cron.add_schedule(registered)  # as the running worker did at its start
    api.remove_schedule("nightly", home=home)
    caplog.set_level(logging.INFO)
    for day in (1, 2):
        [tick] = cron.queue.huey.read_periodic(datetime.datetime(2026, 1, day, 2, 0))
        cron.queue.huey.execute(tick)
    said = [r for r in caplog.records if r.name == "dflash_batch.worker"]
    assert [r.levelno for r in said] == [logging.INFO, logging.INFO]
    assert "was removed" in said[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert api.jobs(home) == []
    # a schedule whose input went away: one error line a firing, no traceback
    api.add_schedule(spec, home=home)  # registered again, but its input goes
    (tmp_path / "docs.jsonl").unlink()
    caplog.clear()
    [tick] = cron.queue.huey.read_periodic(datetime.datetime(2026, 1, 3, 2, 0))
    cron.queue.huey.execute(tick)
    [line] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert line.levelno == logging.ERROR and "docs.jsonl" in line.getMessage() and not line.exc_info
