"""The status page: as HTML while a job waits (it reloads itself), and in a real headless
Chromium after a batch completed, its screenshot kept as an artifact of the run
($DFLASH_BATCH_TEST_ARTIFACTS, else pytest's base temp folder). Skipped where no Chromium is
installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dflash_batch import api
from tests.runner_fixtures import fake_models, home  # noqa: F401
from tests.serve_fixtures import (  # noqa: F401
    CHAT,
    jsonl,
    request_line,
    servers,
    wait_batch,
)

TestClient = pytest.importorskip("starlette.testclient").TestClient
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def test_page_reloads_itself_while_a_job_waits(home):  # noqa: F811
    from dflash_batch.server.app import create_app

    client = TestClient(create_app(home, submit=api.submit))
    answer = client.post(
        "/v1/files",
        data={"purpose": "batch"},
        files={"file": ("in.jsonl", jsonl([request_line("w-1")]))},
    )
    body = {"input_file_id": answer.json()["id"], "endpoint": CHAT, "completion_window": "24h"}
    batch = client.post("/v1/batches", json=body).json()
    html = client.get("/").text
    assert '<meta http-equiv="refresh"' in html and batch["id"] in html
    assert "no verify cycles yet" in html  # nothing ran: an empty histogram, said so
    figures = client.get("/status.json").json()
    assert figures["active"] and figures["jobs"][0]["state"] == "queued"
    assert figures["jobs"][0]["batch"] == {"id": batch["id"], "status": "in_progress"}


def browser():
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no Chromium installed (apt-get install chromium)")


def artifacts(tmp_path_factory) -> Path:
    folder = os.environ.get("DFLASH_BATCH_TEST_ARTIFACTS")
    path = Path(folder) if folder else tmp_path_factory.getbasetemp() / "artifacts"
    path.mkdir(parents=True, exist_ok=True)
    return path


def headless(program: str, *args: str) -> subprocess.CompletedProcess:
    flags = (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--window-size=1400,400",
    )
    return subprocess.run([program, *flags, *args], capture_output=True, timeout=120)


def test_page_in_a_headless_browser(servers, tmp_path_factory):
    program = browser()
    server = servers("--worker")
    client = server.client
    source = client.files.create(
        file=("in.jsonl", jsonl([request_line(f"b-{i}", f"p {i}", 9) for i in range(4)])),
        purpose="batch",
    )
    batch = client.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="24h")
    batch, _ = wait_batch(client, batch.id)
    dom = headless(program, "--dump-dom", server.url + "/")
    assert dom.returncode == 0, dom.stderr.decode(errors="replace")
    text = dom.stdout.decode()
    assert batch.id in text and "<svg" in text and text.count("<rect") >= 2
    shot = artifacts(tmp_path_factory) / "serve-status-page.png"
    shot.unlink(missing_ok=True)
    out = headless(program, f"--screenshot={shot}", server.url + "/")
    assert out.returncode == 0 and shot.is_file(), out.stderr.decode(errors="replace")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000
    print(f"status page screenshot: {shot}")
