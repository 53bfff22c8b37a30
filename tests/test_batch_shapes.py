"""A job's tail runs a handful of batch shapes (engine/batch.py: ``shrink``, ``batch_rung``):
as rows finish, the batch shrinks to sizes of a short ladder, keeping idle rows up to the rung,
not to one batch size per row that finished. Shapes are counted, nothing is timed."""

from __future__ import annotations

from dflash_batch.engine import load_engine
from dflash_batch.engine.batch import BatchDecoder, batch_rung

LADDER = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64}


def test_the_rungs_are_a_short_ladder_that_holds_the_rows():
    for rows in range(1, 65):
        assert batch_rung(rows) >= rows and batch_rung(rows) in LADDER
        assert batch_rung(rows) < 1.5 * rows or rows < 3  # an idle share under a third


def test_a_tail_of_rows_finishing_one_by_one_runs_few_batch_sizes(qwen3_target, monkeypatch):
    engine = load_engine(str(qwen3_target), None)
    sizes = []
    run = BatchDecoder.run

    def counted(self, width):
        sizes.append(self.slots)
        return run(self, width)

    monkeypatch.setattr(BatchDecoder, "run", counted)
    prompts = [engine.encode(f"Row {i}: count slowly") for i in range(20)]
    done = engine.generate_batch(prompts, max_tokens=[2 + i for i in range(20)], batch_size=20)
    assert [len(c.token_ids) for c in done] == [2 + i for i in range(20)]
    shapes = sorted(set(sizes))
    assert set(shapes) <= LADDER | {20}, shapes  # a row finishing every cycle shrinks 20, 15, 11, 8, 6, ... unbucketed
