"""Shared fixtures: tiny seeded random models saved in the real on-disk formats."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import StepClock, make_drafter

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub


def pytest_collect_file(file_path, parent):
    """Before a test module that may import mlx.core is collected, import dflash_batch.engine
    (it preloads the BLAS before mlx.core). The runner's modules import MLX only through the
    fixtures that load a real model, so a run of fake-engine tests never loads it. (Without
    MLX, a module that needs it fails when it is collected itself.)"""
    if (
        file_path.suffix == ".py"
        and file_path.name.startswith("test_")
        and not file_path.name.startswith("test_runner_")
    ):
        try:
            import dflash_batch.engine  # noqa: F401
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] not in ("mlx", "mlx_lm"):
                raise
    return None


@pytest.fixture(autouse=True)
def _own_cost_tables(tmp_path, monkeypatch):
    """Every test keeps measured pass costs in a folder of its own (engine/cost_tables.py): a
    table an earlier run measured must not stand in for the warm-up a test counts."""
    from dflash_batch import paths

    monkeypatch.setattr(paths, "costs_dir", lambda: tmp_path / "pass-costs")


@pytest.fixture(autouse=True)
def _own_kernel_checks(tmp_path, monkeypatch):
    """Every test keeps the kernels' passed self-checks in a folder of its own
    (engine/ops/kernels/selfcheck.py): a pass an earlier test kept must not stand in for a check
    a test counts."""
    from dflash_batch import paths

    monkeypatch.setattr(paths, "kernel_checks_dir", lambda: tmp_path / "kernel-checks")


REAL_ENGINE_FIXTURES = {"tiny_models", "real_engine"}  # tests/runner_fixtures.py: they load MLX


def pytest_collection_modifyitems(config, items):
    """A runner test that uses a real engine fixture is marked ``mlx``; every other runner test
    must pass with MLX not installed (tests/test_layering.py runs them so)."""
    for item in items:
        if item.path.name.startswith("test_runner_") and REAL_ENGINE_FIXTURES & set(
            getattr(item, "fixturenames", ())
        ):
            item.add_marker(pytest.mark.mlx)


class _Synthetic:
    """``tests.synthetic``, imported on first use."""

    def __getattr__(self, name):
        from tests import synthetic as module

        return getattr(module, name)


synthetic = _Synthetic()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def qwen3_target(model_dir) -> Path:
    return synthetic.save_target(model_dir / "qwen3", synthetic.tiny_qwen3_config(), seed=0)


@pytest.fixture(scope="session")
def llama_target(model_dir) -> Path:
    return synthetic.save_target(model_dir / "llama", synthetic.tiny_llama_config(), seed=2)


@pytest.fixture(scope="session")
def zero_head_target(model_dir) -> Path:
    """Every logit equal: the greedy choice is always token 0, known in advance."""
    return synthetic.save_target(
        model_dir / "zero", synthetic.tiny_qwen3_config(), seed=0, zero_head=True
    )


@pytest.fixture(scope="session")
def qwen3_drafter(model_dir) -> Path:
    return make_drafter(model_dir, "draft-qwen3-b16", synthetic.tiny_qwen3_config(), block_size=16)


@pytest.fixture(scope="session")
def tiny_pair(qwen3_target, qwen3_drafter):
    """(target folder, drafter folder): a tiny qwen3 target and a random drafter for it."""
    return qwen3_target, qwen3_drafter


@pytest.fixture
def chain_drafts(monkeypatch):
    """Engines made in the test verify chains, not draft trees (engine/tree.py; trees are the
    CPU's default), as the variable sets their default: for tests that count what a chain's
    cycles commit, or whose drafts come from a zeroed head or norm (every token equally likely
    to the drafter: a tree over that branches at its first position)."""
    monkeypatch.setenv("DFLASH_BATCH_DRAFTS", "chain")


@pytest.fixture
def tree_drafts(monkeypatch):
    """Engines made in the test verify draft trees whatever the backend's default (tests/test_tree.py)."""
    monkeypatch.setenv("DFLASH_BATCH_DRAFTS", "tree")


@pytest.fixture
def joins_at_once(monkeypatch):
    """Scripted clocks for engine/prefill.py and engine/batch.py (``StepClock``): a prefill pass
    costs a hundredth of a decoding cycle, so a free slot never waits for a later join
    (engine/batch.py: ``_gather``), however loaded the machine. On measured seconds whether one
    waits varies with the load, and with it which rows share each cycle."""
    from dflash_batch.engine import batch, prefill

    monkeypatch.setattr(prefill, "time", StepClock(0.01))
    monkeypatch.setattr(batch, "time", StepClock(1.0))


@pytest.fixture
def fresh_verdicts(monkeypatch):
    """Kernel self-checks (engine/ops/kernels/selfcheck.py) on, and no verdict kept from before or after."""
    from dflash_batch.engine.ops.kernels import selfcheck

    monkeypatch.delenv(selfcheck.ENV, raising=False)
    selfcheck.reset()
    yield
    selfcheck.reset()


@pytest.fixture(scope="session")
def qwen3_b8(model_dir):
    return make_drafter(model_dir, "d-qwen3-8", synthetic.tiny_qwen3_config(), block_size=8)


@pytest.fixture
def redis_url(tmp_path):
    """A throwaway redis-server on a free local port (skipped where none is installed)."""
    import shutil
    import socket
    import subprocess

    from tests.runner_fixtures import wait_for

    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed")
    redis = pytest.importorskip("redis")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            server,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)

    def up():
        try:
            return client.ping()
        except redis.exceptions.ConnectionError:
            return False

    try:
        wait_for(up, timeout=30, what="redis-server")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
