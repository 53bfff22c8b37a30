"""``Engine.generate_requests`` takes a true stream: requests are pulled (and encoded) as slots free
up, a small look-ahead ahead, so the batch stays full until the input ends; results equal each
request generated alone; a long request that arrives late narrows the batch to what memory holds
for it, and one that fits no row is refused alone (fp32, CPU)."""

from __future__ import annotations

from dflash_batch.engine import load_engine, memory
from dflash_batch.engine.batch import BatchDecoder

import mlx.core as mx
import pytest

from dflash_batch.completion import GenerationError
from dflash_batch.request import Options, Request, sample_seed

BUDGETS = [12, 3, 20, 5, 9, 16, 4, 11, 7, 14]


def _requests(budgets, **options):
    return [Request(f"r{i}", f"Request {i}: say something about the number {i}.",
                    Options(max_tokens=m, chat_template=False, **options)) for i, m in enumerate(budgets)]  # fmt: skip


class Watch:
    """Counts, across every decoder of a call, the requests pulled from the input, the requests
    admitted into the batch, and at each cycle the rows in flight, the batch's slots and what
    waits encoded."""

    def __init__(self, monkeypatch):
        self.pulled = self.admitted = 0
        self.cycles = []  # (live rows, slots, admitted so far, waiting encoded, pulled so far)
        run, new_row = BatchDecoder.run, BatchDecoder._new_row

        def spy_run(decoder, width):
            live = sum(r is not None for r in decoder.rows)
            self.cycles.append(
                (live, decoder.slots, self.admitted, len(decoder.waiting), self.pulled)
            )
            return run(decoder, width)

        def spy_new_row(decoder, request):
            self.admitted += 1
            return new_row(decoder, request)

        monkeypatch.setattr(BatchDecoder, "run", spy_run)
        monkeypatch.setattr(BatchDecoder, "_new_row", spy_new_row)

    def feed(self, requests):
        for r in requests:
            self.pulled += 1
            yield r


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return load_engine(str(tiny_pair[0]), str(tiny_pair[1]))


def _alone(engine, request, k=0):
    o = request.options
    return engine.generate(request.prompt, max_tokens=o.max_tokens, temperature=o.temperature, chat_template=False,
                           seed=sample_seed(o.seed, k, request.id)).token_ids  # fmt: skip


@pytest.mark.parametrize("lookahead", [1, 3])
def test_the_batch_stays_full_while_requests_remain(engine, monkeypatch, lookahead):
    """Batch 2, ten requests (and a blank one, refused alone), a look-ahead of 1 or 3: every cycle
    before the last request is admitted runs both rows (the refused one leaves no slot free; the
    old windows of ``lookahead`` requests let the batch drain at each window's end), at most
    ``lookahead`` encoded requests wait, and every result equals the request generated alone.
    Joins are not gathered here: whether a free slot waits for a later join is decided from the
    passes' measured seconds (engine/batch.py ``_gather``, tested on scripted clocks in
    tests/test_prefill.py), and this test is about the look-ahead."""
    monkeypatch.setattr(BatchDecoder, "_gather", lambda self: False)
    requests = _requests(BUDGETS)
    blank = Request(
        "blank", "   ", Options(chat_template=False)
    )  # refused: reported as the stream goes on
    watch = Watch(monkeypatch)
    order = list(
        engine.generate_requests(
            watch.feed(requests[:5] + [blank] + requests[5:]), 2, lookahead=lookahead
        )
    )
    out = {r.id: c for r, c in order}
    assert sorted(out) == sorted(r.id for r in requests + [blank])
    assert (
        isinstance(out["blank"], GenerationError)
        and [r.id for r, _ in order].index("blank") < len(order) - 4
    )
    for r in requests:
        assert out[r.id].token_ids == _alone(engine, r), r.id
    assert watch.cycles
    for live, slots, admitted, waiting, pulled in watch.cycles:
        if admitted < len(requests):
            assert live == slots == 2, watch.cycles
        assert waiting <= lookahead and pulled - admitted <= lookahead + 1, (
            watch.cycles
        )  # + the blank one
    assert any(
        pulled < len(requests) for *_, pulled in watch.cycles
    )  # pulled as it went, not up front


def test_samples_of_a_streamed_request_share_its_prefill_and_keep_their_seeds(engine):
    """A request of n = 3 samples in a stream with a look-ahead of 1: its samples are pulled
    together (the first prefills, the others copy its state) and each equals the sample
    generated alone with its seed."""
    requests = _requests([6, 8, 5, 7], temperature=1.0, seed=3)
    requests[1].options.n = 3
    engine.prefixes.clear()
    got = {
        (r.id, c.sample_index): c.token_ids
        for r, c in engine.generate_requests(iter(requests), 2, lookahead=1)
    }
    assert sorted(got) == sorted([(r.id, 0) for r in requests] + [("r1", 1), ("r1", 2)])
    for (item, k), ids in got.items():
        assert ids == _alone(engine, requests[int(item[1:])], k), (item, k)
    assert engine.prefill_counts["tokens"] == sum(
        len(engine.encode(r.prompt, chat_template=False)) for r in requests
    )


def test_a_late_long_request_narrows_the_batch_and_one_that_fits_no_row_is_refused(
    engine, monkeypatch
):
    """Memory for three rows of the short requests (256 cache columns each): a 300-token request
    later in the stream (512 columns) makes the batch narrow to one row before it joins, and a
    1000-token one (1280 columns) is refused alone, naming the memory; the others go on, each
    equal to the request generated alone."""
    requests = _requests([6, 9, 4, 8, 5, 7, 6])
    requests.insert(
        4,
        Request(
            "long",
            "Tell me everything about seven. " * 12,
            Options(max_tokens=5, chat_template=False),
        ),
    )
    requests.insert(6, Request("huge", "seven " * 1000, Options(max_tokens=5, chat_template=False)))
    assert 260 < len(engine.encode(requests[4].prompt, chat_template=False)) < 500
    per_row = memory.row_bytes(engine, 256)
    monkeypatch.setenv(
        "DFLASH_BATCH_MEMORY_GB",
        str((mx.get_active_memory() + 3.5 * per_row / memory.USABLE) / 1e9),
    )
    watch = Watch(monkeypatch)
    by_id = {r.id: c for r, c in engine.generate_requests(watch.feed(requests), 3, lookahead=2)}
    assert sorted(by_id) == sorted(r.id for r in requests)
    assert isinstance(
        by_id["huge"], GenerationError
    ) and "not enough memory for one sequence" in str(by_id["huge"])
    for r in requests:
        if r.id != "huge":
            assert by_id[r.id].token_ids == _alone(engine, r), r.id
    slots = [s for _, s, *_ in watch.cycles]
    assert slots[0] == 3 and 1 in slots and max(slots[slots.index(1) :]) == 1, (
        slots
    )  # narrowed, never widened


def test_a_runners_request_is_trusted_as_checked_and_a_callers_is_checked(engine, monkeypatch):
    """The runner's requests were checked as their rows and job were read (``request.Options``):
    the engine encodes them without checking their options again; ``Engine.request``, the
    caller's entry, checks them."""
    from dflash_batch.request import SamplingControls

    def refuse(name, value):
        raise AssertionError(f"{name} checked again")

    monkeypatch.setattr(SamplingControls, "check", staticmethod(refuse))
    requests = _requests([4, 6], top_k=3)
    done = {r.id: c for r, c in engine.generate_requests(iter(requests), 2)}
    assert all(len(done[r.id].token_ids) == r.options.max_tokens for r in requests)
    with pytest.raises(AssertionError, match="top_k checked again"):
        engine.request("Say seven.", max_tokens=4, top_k=3)
