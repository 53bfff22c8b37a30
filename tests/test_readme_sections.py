"""Every command of the README's sections after the set-up and the queue block (which
tests/test_readme_sequence.py runs), run as written and in order on a fresh home.

The fake engine answers, except in "Your own model on a Mac": there the real engine loads the
README's Hugging Face repo ids from an offline hub cache where tiny seeded models (mlx-lm's
format; a z-lab-format drafter) stand under those names, so `hf download`, the registered
drafter and the run are the ones a Mac user gets, minus the download."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from dflash_batch import api
from tests.helpers import README, SET_UP, command_lines, sh, shell_blocks, shim
from tests.runner_fixtures import fake_models, home, wait_for  # noqa: F401  (fixtures)

RUN_ELSEWHERE = ("Set up", "Queue and workers")  # tests/test_readme_sequence.py
BACKGROUND = re.compile(r" (worker|serve --worker)$")  # "another terminal", "on each machine"
MAC = "Your own model on a Mac"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def sections():
    """[(heading, command lines of its bash blocks)] in README order."""
    found = []
    for part in re.split(r"^## ", README, flags=re.M)[1:]:
        lines = [
            line.split(" # ")[0].strip()
            for block in shell_blocks(part)
            for line in block.splitlines()
        ]
        found.append((part.splitlines()[0].strip(), [line for line in lines if line]))
    return found


def test_every_readme_command_is_run_by_a_test():
    ran = {line for heading, lines in sections() for line in lines}
    assert set(command_lines(README)) <= ran | set(SET_UP), "an inline command no test runs"
    assert {h for h, lines in sections() if lines} >= set(RUN_ELSEWHERE) | {MAC}


def hub_cache(root):
    """A Hugging Face hub cache holding tiny models under the README's repo ids."""
    from tests import synthetic

    def snapshot(repo):
        folder = root / f"models--{repo.replace('/', '--')}"
        (folder / "refs").mkdir(parents=True)
        (folder / "refs" / "main").write_text(COMMIT)
        return folder / "snapshots" / COMMIT

    cfg = synthetic.tiny_qwen3_config()
    synthetic.save_target(snapshot("mlx-community/Qwen3-4B-bf16"), cfg, seed=0)
    synthetic.save_drafter(
        snapshot("z-lab/Qwen3-4B-DFlash-b16"), synthetic.drafter_config(cfg, block_size=8), seed=1
    )
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


class Background:
    """The README's long-running lines (a worker, the server), started as written."""

    def __init__(self, bin_dir, env, log):
        self.bin_dir, self.env, self.log, self.procs = bin_dir, env, log, []

    def start(self, line: str) -> None:
        if "serve" in line:
            port = free_port()
            line += f" --port {port}"
        command = "exec " + line.replace(".venv/bin/", f"{self.bin_dir}/")
        out = open(self.log, "ab")
        self.procs.append(
            subprocess.Popen(["bash", "-c", command], env=self.env, stdout=out, stderr=out)
        )
        if "serve" in line:
            wait_for(
                lambda: answers(f"http://127.0.0.1:{port}/v1/models"),
                timeout=120,
                what="the server",
            )

    def kill(self) -> None:
        """After a failure: none of them outlives the test."""
        for proc in self.procs:
            proc.kill()
            proc.wait(timeout=30)

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGINT)  # Ctrl-C, as in their terminal
        codes = [proc.wait(timeout=120) for proc in self.procs]
        self.procs = []
        # a worker stops cleanly; the server reports Ctrl-C as an interruption (130)
        assert set(codes) <= {0, 130}, (codes, self.log.read_text())


def check(line: str, out: subprocess.CompletedProcess, home):  # noqa: F811
    """What a line must have done, besides exiting 0."""
    if "--dry-run" in line:
        assert "8 rows, 0 of them error rows" in out.stdout and api.jobs(home) == []
    if line.endswith("--text"):
        assert out.stdout.count("--- ") == 8
    if "--columns" in line:
        assert len(out.stdout.splitlines()) == 8 and '"finish_reason"' in out.stdout
    if "hf download" in line:
        path = re.search(r"(/\S+/snapshots/\w+)", out.stdout)
        assert path and os.path.isfile(os.path.join(path.group(1), "config.json")), out.stdout
    if "drafters" in line:
        assert "z-lab/Qwen3-4B-DFlash-b16" in out.stdout


def run_section(heading, lines, background, redis_url, home):  # noqa: F811
    for line in lines:
        line = line.replace("redis://127.0.0.1:6379/0", redis_url)
        if BACKGROUND.search(line):
            background.start(line)
            continue
        out = sh(line, background.bin_dir, background.env, timeout=600)
        assert out.returncode == 0, f"{heading}: {line}\n{out.stdout}\n{out.stderr}"
        check(line, out, home)
    if background.procs:  # what they were given is done before they stop
        wait_for(lambda: all(j.status()["state"] == "completed" for j in api.jobs(home)), timeout=240,
                 what="the jobs of the workers")  # fmt: skip
        background.stop()


def test_the_readme_sections_run_as_written(tmp_path, home, fake_models, request):  # noqa: F811
    try:  # a machine without redis-server still runs every other section
        redis_url = request.getfixturevalue("redis_url")  # noqa: F811
    except pytest.skip.Exception:
        redis_url = None
    bin_dir = shim(tmp_path)
    hf = bin_dir / "hf"  # the Hugging Face CLI the install puts in .venv/bin
    hf.write_text(
        f'#!/bin/sh\nexec {sys.executable} -c "from huggingface_hub.cli.hf import main; main()" "$@"\n'
    )
    hf.chmod(0o755)
    fake_env = dict(os.environ, DFLASH_BATCH_HOME=str(home))
    mac_env = {k: v for k, v in fake_env.items() if k != api.ENGINE_ENV}
    mac_env.update(HF_HUB_CACHE=str(hub_cache(tmp_path / "hub")), HF_HUB_OFFLINE="1")
    for heading, lines in sections():
        if heading in RUN_ELSEWHERE:
            continue
        env = mac_env if heading == MAC else fake_env
        if redis_url is None and any("--redis" in line for line in lines):
            continue
        background = Background(bin_dir, env, tmp_path / "background.log")
        try:
            run_section(heading, lines, background, redis_url, home)
        finally:
            background.kill()
    jobs = {j.record.data["name"]: j for j in api.jobs(home)}
    assert {"short", "sampled", "as-json", "qwen3-4b"} | (
        {"shared"} if redis_url else set()
    ) <= set(jobs)
    assert jobs["sampled"].status()["ok"] == 16  # --n 2: two rows an item
    qwen = jobs["qwen3-4b"].to_pandas()
    assert len(qwen) == 8 and (qwen["block_size"] == 8).all()  # the registered drafter drafted
    assert (qwen["drafted_tokens"] > 0).any()


def test_the_readme_python_names_what_the_package_has():
    """The Python blocks parse, and every `dflash_batch.X` and method they call exists with the
    keyword arguments they pass (their engine calls run for real in tests/test_engine_*.py)."""
    import ast
    import inspect

    from dflash_batch.engine import Engine

    import dflash_batch

    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks
    owners = {"dflash_batch": dflash_batch, "engine": Engine, "job": dflash_batch.Job}
    for block in blocks:
        for call in [n for n in ast.walk(ast.parse(block)) if isinstance(n, ast.Call)]:
            f = call.func
            if not (
                isinstance(f, ast.Attribute)
                and isinstance(f.value, ast.Name)
                and f.value.id in owners
            ):
                continue
            target = getattr(owners[f.value.id], f.attr)  # AttributeError: the README names nothing
            params = inspect.signature(target).parameters
            if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
                assert {k.arg for k in call.keywords} <= set(params), (f.attr, block)
