"""A target with no registered drafter says so under draft="auto" (one warning, naming the target
and how to give a drafter), and `dflash-batch drafters` lists the registered pairs without
loading or fetching a model."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from dflash_batch.engine.models import default_model, loading, registry

import pytest

from dflash_batch import cli
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

    loaders = [
        (loading, "load_target"),
        (loading, "load_drafter"),
        (registry, "load_any_target"),
        (default_model, "ensure_drafter"),
        (default_model, "ensure_default_pair"),
    ]
    for module, name in loaders:
        monkeypatch.setattr(module, name, no_model)
    assert cli.main(["drafters"]) == 0
    text = capsys.readouterr().out
    for target, drafter in registry.DRAFTERS.items():
        assert target in text and (drafter[0] == "embedded" or drafter[0] in text)
    assert "qwen3-4b               16     DFlash v1   z-lab/Qwen3-4B-DFlash-b16" in text
    assert str(default_model.DRAFTER_ASSET) in text  # the embedded drafter, by its folder
    assert cli.main(["drafters", "--json"]) == 0
    everything = json.loads(capsys.readouterr().out)
    listed = {p["target"]: p for p in everything if p["auto"]}
    assert listed.keys() == registry.DRAFTERS.keys()
    assert listed["qwen3-8b"]["block_size"] == 16 and listed["qwen3.5-9b"]["block_size"] is None
    embedded = listed["smollm2-135m-instruct"]
    assert embedded["block_size"] == 16 and embedded["default"]


def test_the_cli_still_imports_no_engine_at_import():
    code = (
        "import sys, dflash_batch.cli; "
        "sys.exit('dflash_batch.engine' in sys.modules or 'mlx' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def test_every_published_pairing_is_listed_with_its_generation(capsys):
    """Each documented pairing (z-lab v1 and DFlash 2, the third-party DFlash 2 checkpoints) is
    listed once, with its generation and recommended block; DFlash 2 ones for a registered
    target are not what draft="auto" takes unless DRAFTERS names them."""
    assert cli.main(["drafters", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    by_drafter = {p["drafter"]: p for p in listed}
    by_pair = {
        (p["target"], p["drafter"]): p for p in listed
    }  # a drafter may serve two target names
    for target, drafter, generation, block, _ in registry.PUBLISHED:
        entry = by_pair[target, drafter]
        assert (entry["generation"], entry["block_size"]) == (generation, block)
        assert sum((p["target"], p["drafter"]) == (target, drafter) for p in listed) == 1
    assert sum(p["drafter"] == "z-lab/Qwen3-4B-DFlash-b16" for p in listed) == 1
    assert (
        by_drafter["z-lab/Qwen3.8-27B-DFlash2"]["auto"]
        and not by_drafter["incoai/Qwen3.8-27B-DFlash2"]["auto"]
    )
    assert {p["generation"] for p in listed} == {registry.V1, registry.V2}
    assert registry.auto_drafter("mlx-community/Qwen3.8-27B-4bit") == (
        "z-lab/Qwen3.8-27B-DFlash2",
        None,
    )
    assert cli.main(["drafters"]) == 0
    text = capsys.readouterr().out
    assert "qwen3.8-27b            5      DFlash 2    z-lab/Qwen3.8-27B-DFlash2" in text
    assert text.index("Also published") < text.index("incoai/Qwen3.8-27B-DFlash2")


def test_the_warning_names_a_published_drafter_that_auto_does_not_take(unwarned, caplog):
    caplog.set_level(logging.WARNING)
    assert registry.auto_drafter("someone/Ornith-1.5-9B-4bit") is None
    [warning] = warnings_about(caplog, "someone/Ornith-1.5-9B-4bit")
    text = warning.getMessage()
    assert "no DFlash drafter is registered" in text
    assert "resolvo-cloud/Ornith-1.5-9B-DFlash2 (DFlash 2)" in text and "--draft" in text
    assert registry.auto_drafter("someone/Ornith-1.5-90B") is None  # 90B is not 9B: nothing to name
    [other] = warnings_about(caplog, "someone/Ornith-1.5-90B")
    assert "Published for this target" not in other.getMessage()
