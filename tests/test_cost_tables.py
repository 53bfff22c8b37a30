"""Pass costs measured once per machine (engine/cost_tables.py): a warm-up keeps its table in the
model cache, a new engine of the same model reads it instead of timing passes, and a table that
is unreadable, stale or another model's is not used. No wall clock: the timed passes are fakes
that count how often they run."""

from __future__ import annotations

import json

from dflash_batch.engine import cost_tables, load_engine, warmup

import pytest

from dflash_batch import paths


@pytest.fixture
def timed(monkeypatch):
    """Fake timed passes: a verify pass of T rows at batch B 'takes' 0.01 (1 + B T) s, a drafter
    pass 0.005 B s, each times ``load`` (1 unless a test sets it: other work on the machine);
    returns the list of passes timed so far."""

    class Runs(list):
        load = 1.0

    runs = Runs()

    class Passes:
        def __init__(self, engine, B, n):
            self.B = B

        def prime(self):
            pass

        def target(self, T):
            runs.append(("target", self.B, T))
            return 0.01 * (1 + self.B * T) * runs.load

        def draft(self):
            runs.append(("draft", self.B))
            return 0.005 * self.B * runs.load

    monkeypatch.setattr(warmup, "_Passes", Passes)
    return runs


def _engine(tiny_pair):
    return load_engine(*map(str, tiny_pair))


def _tables():
    return sorted(paths.costs_dir().glob("*.json")) if paths.costs_dir().exists() else []


def test_a_second_engine_reads_the_costs_the_first_measured(tiny_pair, timed):
    first = _engine(tiny_pair)
    cost = first.warm_up(4, context=300)
    assert timed and len(_tables()) == 1
    passes = len(timed)
    second = _engine(tiny_pair)  # a new process's engine, as far as the costs go
    prompts = [second.encode("Count: one two three " * 20)] * 4
    # the job's typical context falls in the warm-up's bucket: its table is read, nothing timed
    assert warmup.context_bucket(len(prompts[0]) + 4) == warmup.context_bucket(300)
    second.generate_batch(prompts, max_tokens=8, batch_size=4)
    assert len(timed) == passes
    read = second.cost[4]
    for name in cost_tables.FIELDS + ("timed",):
        assert getattr(read, name) == pytest.approx(getattr(cost, name)), name


def test_measure_times_again_and_replaces_the_table(tiny_pair, timed):
    engine = _engine(tiny_pair)
    engine.warm_up(2)
    passes = len(timed)
    engine.warm_up(2)
    assert len(timed) == passes  # read back
    engine.warm_up(2, measure=True)
    assert len(timed) == 2 * passes and len(_tables()) == 1


def test_the_routes_chosen_with_the_costs_are_read_back(tiny_pair, timed, monkeypatch):
    """The ragged route and the few-row matmul a GPU's warm-up chose (faked here) come back with
    the table: a later process runs its jobs under what its passes were timed under."""
    measure = warmup.measure_costs

    def chosen(engine, batch_size, context=None):
        cost = measure(engine, batch_size, context)
        cost.route, cost.matmul = "sdpa", "stock"
        return cost

    monkeypatch.setattr(warmup, "measure_costs", chosen)
    _engine(tiny_pair).warm_up(2)
    read = _engine(tiny_pair).warm_up(2)
    assert (read.route, read.matmul) == ("sdpa", "stock")


@pytest.mark.parametrize("damage", ["not json", "key", "field"])
def test_an_unreadable_or_stale_table_is_ignored_with_a_warning(tiny_pair, timed, damage):
    engine = _engine(tiny_pair)
    engine.warm_up(2)
    passes = len(timed)
    (path,) = _tables()
    stored = json.loads(path.read_text())
    if damage == "not json":
        path.write_text("{ torn")
    elif damage == "key":
        stored["key"]["mlx"] = "0.0.1"  # measured under another MLX
        path.write_text(json.dumps(stored))
    else:
        stored["cost"]["t1"] = "fast"
        path.write_text(json.dumps(stored))
    again = _engine(tiny_pair)
    with pytest.warns(UserWarning, match="ignoring the pass costs"):
        again.warm_up(2)
    assert len(timed) == 2 * passes  # timed again
    assert json.loads(path.read_text())["key"] == cost_tables.key(
        again, 2, warmup.context_bucket(0)
    )  # and replaced


def test_another_model_or_batch_size_is_not_served_an_earlier_table(tiny_pair, llama_target, timed):
    _engine(tiny_pair).warm_up(2)
    passes = len(timed)
    _engine(tiny_pair).warm_up(4)  # another batch size
    assert len(timed) > passes
    passes = len(timed)
    plain_other = load_engine(str(llama_target), None)  # another model's shape
    plain_other.warm_up(2)
    assert len(timed) > passes
    assert len(_tables()) == 3


def test_keep_costs_off_neither_reads_nor_writes(tiny_pair, timed):
    engine = _engine(tiny_pair)
    engine.keep_costs = False
    engine.warm_up(2)
    engine.warm_up(2)
    assert not _tables()
    assert len({run for run in timed}) < len(timed)  # every pass timed twice


def test_mlx_keeps_its_compiled_kernels_in_the_model_cache(monkeypatch, tmp_path):
    from dflash_batch.engine.ops import blas

    monkeypatch.setattr("dflash_batch.paths.cache_dir", lambda: tmp_path / "cache")
    monkeypatch.delenv(blas.PTX_ENV, raising=False)
    blas.keep_compiled_kernels()
    kept = blas.os.environ[blas.PTX_ENV]
    assert kept.startswith(str(tmp_path / "cache" / "mlx-kernels"))
    monkeypatch.setenv(blas.PTX_ENV, "/somewhere/else")  # the user's choice stands
    blas.keep_compiled_kernels()
    assert blas.os.environ[blas.PTX_ENV] == "/somewhere/else"


def test_prepare_warms_up_once_and_says_where_the_costs_came_from(tiny_pair, qwen3_target, timed):
    first = _engine(tiny_pair).prepare(4, max_tokens=64)
    assert first["batch_size"] == 4 and not first["read"] and timed
    engine = _engine(tiny_pair)
    again = engine.prepare(4, max_tokens=64)
    assert again["read"] and engine.cost[4].context == again["context"]
    assert engine.prepare(4, max_tokens=64) is None  # warm already
    assert (
        load_engine(str(qwen3_target), None).prepare(4) is None
    )  # nothing to warm up without a drafter


def test_the_key_names_the_hardware_not_the_moment(monkeypatch):
    """CUDA's device_info carries the device's free memory, which every other process changes,
    and the card's UUID and bus: a machine's second process must find the first one's table, and
    another card of the same model serves as well; another model of card does not."""
    card = {
        "device_name": "NVIDIA H100 80GB HBM3",
        "architecture": "sm_90",
        "memory_size": 85 << 30,
    }

    def on(**extra):
        monkeypatch.setattr(cost_tables.mx, "device_info", lambda: {**card, **extra})
        return cost_tables.machine()

    first = on(free_memory=80 << 30, uuid="GPU-1", pci_bus_id="0000:18:00.0")
    assert on(free_memory=61 << 30, uuid="GPU-2", pci_bus_id="0000:2a:00.0") == first
    card["device_name"] = "NVIDIA H200"
    assert on(free_memory=80 << 30) != first


@pytest.mark.parametrize("below,timed_again", [(0.5, True), (0.1, False)])
def test_a_table_dearer_than_the_plain_cycles_show_is_timed_again(
    tiny_pair, timed, below, timed_again
):
    """Timings only err high (a load spike adds time): a table read from the model cache whose
    passes cost more than this process's cycles at timed widths by over STALE of them is timed
    again at the next job, and kept in its place; a table the cycles roughly agree with is not."""
    from dflash_batch.engine.widths import STALE, TRUSTED

    _engine(tiny_pair).warm_up(4, context=300)
    passes = len(timed)
    engine = _engine(tiny_pair)
    cost = engine.warm_up(4, context=300)
    assert cost.read and len(timed) == passes and engine.measured_passes == 0
    # this process's cycles at timed widths, below their modelled passes by ``below`` of them
    cost.relative[:] = [-below] * TRUSTED
    assert cost.stale() == (below > STALE)
    prompts = [engine.encode("Count: one two three " * 20)] * 4
    engine.generate_batch(prompts, max_tokens=8, batch_size=4)
    assert (len(timed) > passes) == timed_again
    assert engine.measured_passes == int(timed_again)
    assert engine.cost[4].read == (not timed_again) and len(_tables()) == 1


@pytest.mark.parametrize("load", [2.0, 0.5])
def test_a_table_timed_again_keeps_the_faster_timings(tiny_pair, timed, load):
    """Timings only err high. Timed again while other work doubles every pass, a quiet table is
    kept as it was (the process too uses it); timed again quietly where the table had been timed
    under load (``load`` 0.5: the stored passes were twice their cost), the new timings replace
    it."""
    quiet = _engine(tiny_pair).warm_up(4, context=300)
    (path,) = _tables()
    timed.load = load
    engine = _engine(tiny_pair)
    again = engine.warm_up(4, context=300, measure=True)
    cheaper = min(load, 1.0)
    assert again.timed == pytest.approx({T: cheaper * s for T, s in quiet.timed.items()})
    for name in ("t0", "t1", "t2", "d0", "d1"):
        assert getattr(again, name) == pytest.approx(cheaper * getattr(quiet, name)), name
    stored = cost_tables.load(json.loads(path.read_text())["key"])
    for name in cost_tables.FIELDS + ("timed",):
        assert getattr(stored, name) == pytest.approx(getattr(again, name)), name


def test_each_pass_keeps_its_own_faster_timing():
    """A load spike hits single passes: the stored table's width-1 pass and the drafter, the new
    timing's width-4 pass and its batch-1 line. Each entry keeps its faster timing."""
    from dflash_batch.engine.widths import CostModel

    stored = CostModel(t0=0.1, t1=0.02, d0=0.2, d1=0.02, rows=8, timed={1: 0.9, 4: 0.8})
    new = CostModel(t0=0.3, t1=0.05, d0=0.05, d1=0.01, rows=8, timed={1: 0.3, 4: 1.6})
    kept = cost_tables.kept(stored, new)
    assert kept.timed == {1: 0.3, 4: 0.8}
    assert (kept.t0, kept.t1, kept.d0, kept.d1) == (0.1, 0.02, 0.05, 0.01)
    # under another attention route the passes are others: the cheaper table whole
    new.route, new.timed = "sdpa", {1: 0.3, 4: 0.7}
    assert cost_tables.kept(stored, new) is new
    new.timed = {1: 0.3, 4: 1.6}
    assert cost_tables.kept(stored, new) is stored
    # likewise under another few-row matmul (engine/warmup.py)
    new.route, new.matmul, new.timed = None, "stock", {1: 0.3, 4: 0.7}
    assert cost_tables.kept(stored, new) is new


def test_a_stale_table_is_timed_again_once_a_process(tiny_pair, timed):
    """A table this process timed again and still finds stale (say its second timing came under
    load too, or its cycles misjudge it) is not timed again at every job: once per table and
    process, whatever jobs at other contexts come between."""
    from dflash_batch.engine.widths import TRUSTED

    _engine(tiny_pair).warm_up(4, context=300)
    passes = len(timed)
    engine = _engine(tiny_pair)
    prompts = [engine.encode("Count: one two three " * 20)] * 4

    def job_after_stale_cycles():
        cost = engine.warm_up(4, context=300)
        assert cost.read  # read from the model cache, as a later job's warm-up would
        cost.relative[:] = [-0.5] * TRUSTED
        engine.generate_batch(prompts, max_tokens=8, batch_size=4)

    job_after_stale_cycles()
    assert len(timed) == 2 * passes and engine.measured_passes == 1  # timed again
    engine.warm_up(4, context=5000)  # a job in another context bucket
    assert engine.measured_passes == 2
    job_after_stale_cycles()
    assert engine.measured_passes == 2  # not again
