"""A target with no registered drafter says so under draft="auto" (one warning, naming the target
and how to give a drafter), and `dflash-batch drafters` lists the registered pairs without
loading or fetching a model."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from dflash_batch import cli
from dflash_batch.engine.models import default_model, loading, registry
from tests.runner_fixtures import REPO


@pytest.fixture
def unwarned(monkeypatch):
    monkeypatch.setattr(registry, "_warned", set())


def warnings_about(caplog, target):
    return [r for r in caplog.records if r.levelno == logging.WARNING and target in r.getMessage()]


def test_auto_with_no_registered_drafter_warns_once(unwarned, caplog):
    caplog.set_level(logging.WARNING)
    for _ in range(3):  # a worker loads its engine again for each model change
        assert registry.auto_drafter("some-org/Mistral-7B-Instruct") is None
    [warning] = warnings_about(caplog, "some-org/Mistral-7B-Instruct")
    text = warning.getMessage()
    assert "no DFlash drafter is registered" in text
    assert "--draft" in text and "dflash-batch drafters" in text
    found = registry.auto_drafter("mlx-community/Qwen3-4B-bf16")
    assert found == ("z-lab/Qwen3-4B-DFlash-b16", None)
    assert warnings_about(caplog, "Qwen3-4B") == []


def test_load_engine_warns_when_auto_finds_no_drafter(qwen3_target, unwarned, caplog):
    from dflash_batch.engine import load_engine

    caplog.set_level(logging.WARNING)
    plain = load_engine(str(qwen3_target), draft=None)  # plain decoding asked for: no warning
    assert plain.drafter is None and warnings_about(caplog, str(qwen3_target)) == []
    engine = load_engine(str(qwen3_target), draft="auto")
    assert engine.drafter is None
    assert len(warnings_about(caplog, str(qwen3_target))) == 1


def test_drafters_lists_the_registered_pairs_without_loading_a_model(monkeypatch, capsys):
    def no_model(*args, **kwargs):
        raise AssertionError("listing the pairs loaded or fetched a model")

    loaders = [(loading, "load_target"), (loading, "load_drafter"), (registry, "load_any_target"),
               (default_model, "ensure_drafter"), (default_model, "ensure_default_pair")]
    for module, name in loaders:
        monkeypatch.setattr(module, name, no_model)
    assert cli.main(["drafters"]) == 0
    text = capsys.readouterr().out
    for target, drafter in registry.DRAFTERS.items():
        assert target in text and (drafter[0] == "embedded" or drafter[0] in text)
    assert "qwen3-4b               16     z-lab/Qwen3-4B-DFlash-b16" in text
    assert str(default_model.DRAFTER_ASSET) in text  # the embedded drafter, by its folder
    assert cli.main(["drafters", "--json"]) == 0
    listed = {p["target"]: p for p in json.loads(capsys.readouterr().out)}
    assert listed.keys() == registry.DRAFTERS.keys()
    assert listed["qwen3-8b"]["block_size"] == 16 and listed["qwen3.5-4b"]["block_size"] is None
    embedded = listed["smollm2-135m-instruct"]
    assert embedded["block_size"] == 16 and embedded["default"]


def test_the_cli_still_imports_no_engine_at_import():
    code = ("import sys, dflash_batch.cli; "
            "sys.exit('dflash_batch.engine' in sys.modules or 'mlx' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
