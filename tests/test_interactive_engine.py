"""Interactive requests on the engine (dflash_batch/inbox.py): a ticket joins a running batch at the
next step, ahead of the requests waiting; its pieces stream to the ticket and join to the engine's
own output for the same request, token for token (greedy, fp32, CPU); a cancelled ticket frees its
row and the batch goes on; the batch's own rows each come back once, unchanged."""

from __future__ import annotations

import threading

from dflash_batch.engine import load_engine

import pytest

from dflash_batch.errors import Cancelled
from dflash_batch.inbox import Inbox, InboxFull, Ticket
from dflash_batch.request import Options, Request
from tests.helpers import fixed_costs, greedy_reference

BUDGETS = [24, 9, 30, 14, 20, 12, 26, 18]


def _batch(budgets=BUDGETS):
    return [Request(f"row{i}", f"Row {i}: tell me about the number {i}.", Options(max_tokens=m, chat_template=False))
            for i, m in enumerate(budgets)]  # fmt: skip


def _ticket(text="An interactive question about ducks.", max_tokens=20, **options) -> Ticket:
    pieces = []
    ticket = Ticket(Request("chat-1", text, Options(max_tokens=max_tokens, chat_template=False, **options)),
                    on_piece=lambda k, piece: pieces.append((k, piece)))  # fmt: skip
    ticket.pieces = pieces
    return ticket


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return load_engine(str(tiny_pair[0]), str(tiny_pair[1]), cost_model=fixed_costs())


def _alone(engine, request):
    o = request.options
    return engine.generate(request.prompt, max_tokens=o.max_tokens, chat_template=False).token_ids


def test_ticket_joins_a_running_batch_and_streams_the_engines_own_output(engine, tiny_pair):
    inbox, ticket = Inbox(), _ticket()
    order = []  # what finished, in order: batch rows by id, the ticket as "ticket"
    ticket.on_done = lambda: order.append("ticket")
    seen = 0
    results = {}
    for request, outcome in engine.generate_requests(_batch(), batch_size=3, inbox=inbox):
        assert not isinstance(outcome, Exception), outcome
        results[request.id] = outcome.token_ids
        order.append(request.id)
        seen += 1
        if seen == 1:  # the batch is running, five rows still wait: the ticket arrives
            inbox.put(ticket)
    # every batch row once, each as it decodes alone
    assert sorted(results) == sorted(r.id for r in _batch())
    for request in _batch():
        assert results[request.id] == _alone(engine, request), request.id
    # the ticket went ahead of the rows that were waiting when it came
    assert ticket.done.is_set()
    assert order.index("ticket") < len(order) - 3
    done = ticket.outcomes[0]
    assert not isinstance(done, Exception), done
    streamed = [t for _, piece in ticket.pieces for t in piece.token_ids]
    assert streamed == done.token_ids == _alone(engine, ticket.request)
    ids = engine.tokenizer.encode(ticket.request.prompt)
    assert (
        done.token_ids
        == greedy_reference(tiny_pair[0], ids, 20, engine.tokenizer.eos_token_ids)[
            : len(done.token_ids)
        ]
    )
    assert ticket.pieces[-1][1].finish_reason == done.finish_reason
    assert done.stats.drafted_tokens > 0  # it was decoded speculatively, in the batch


def test_tickets_alone_and_n_samples(engine):
    inbox = Inbox()
    one, two = (
        _ticket("First question?", 16),
        _ticket("Second question, sampled twice?", 12, n=2, temperature=0.8),
    )
    two.request.options.seed = 5
    inbox.put(one)
    inbox.put(two)
    assert list(engine.generate_requests([], batch_size=4, inbox=inbox)) == []  # nothing is yielded
    assert one.done.is_set() and two.done.is_set()
    assert one.outcomes[0].token_ids == _alone(engine, one.request)
    assert sorted(two.outcomes) == [0, 1]
    for k in (0, 1):
        streamed = [t for s, p in two.pieces if s == k for t in p.token_ids]
        assert streamed == two.outcomes[k].token_ids


def test_a_cancelled_ticket_frees_its_row_and_the_batch_goes_on(engine):
    inbox, ticket = Inbox(), _ticket(max_tokens=200)
    # cancelled once it has streamed something: as a client that goes away mid-stream
    stream = ticket.on_piece

    def on_piece(k, piece):
        stream(k, piece)
        ticket.cancel()

    ticket.on_piece = on_piece
    inbox.put(ticket)
    results = {
        r.id: o for r, o in engine.generate_requests(_batch(BUDGETS[:4]), batch_size=2, inbox=inbox)
    }
    assert isinstance(ticket.outcomes[0], Cancelled)
    assert sum(len(p.token_ids) for _, p in ticket.pieces) < 200
    for request in _batch(BUDGETS[:4]):
        assert results[request.id].token_ids == _alone(engine, request)


def test_a_ticket_cancelled_before_it_starts_is_never_decoded(engine):
    inbox, ticket = Inbox(), _ticket()
    ticket.cancel()
    inbox.put(ticket)
    assert list(engine.generate_requests([], batch_size=2, inbox=inbox)) == []
    assert isinstance(ticket.outcomes[0], Cancelled) and ticket.pieces == []


def test_a_refused_prompt_fails_its_ticket_alone(engine):
    inbox, bad, good = Inbox(), _ticket(""), _ticket("A fine question.", 6)
    inbox.put(bad)
    inbox.put(good)
    list(engine.generate_requests([], batch_size=2, inbox=inbox))
    assert isinstance(bad.outcomes[0], Exception) and "empty" in str(bad.outcomes[0]).lower()
    assert good.outcomes[0].token_ids == _alone(engine, good.request)


def test_the_inbox_refuses_beyond_its_limit_and_wakes_a_waiter():
    inbox = Inbox(limit=1)
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(inbox.wait(30)))
    waiter.start()
    inbox.put(_ticket())
    waiter.join(30)
    assert woke == [True]
    with pytest.raises(InboxFull):
        inbox.put(_ticket())
    assert len(inbox.take()) == 1 and inbox.take() == []


@pytest.mark.parametrize("drafted", [False, True], ids=["plain", "dflash"])
def test_a_full_batch_gives_a_slot_up_and_the_row_restarts_exactly(
    tiny_pair, engine, monkeypatch, drafted
):
    """Both slots busy with long rows when the ticket comes: the least advanced row gives its slot
    up (once), the ticket finishes before any batch row, and the row that started again still
    equals its output alone."""
    from dflash_batch.engine.batch import BatchDecoder

    plain = engine if drafted else load_engine(str(tiny_pair[0]), None)
    inbox, ticket = Inbox(), _ticket(max_tokens=6)
    order, cycles, requeued = [], [0], []
    ticket.on_done = lambda: order.append("ticket")
    run, preempt = BatchDecoder.run, BatchDecoder._preempt

    def spy_run(decoder, width):
        cycles[0] += 1
        if cycles[0] == 3:  # mid-decode, every slot busy
            assert all(r is not None for r in decoder.rows)
            inbox.put(ticket)
        return run(decoder, width)

    def spy_preempt(decoder):
        for index, marker in preempt(decoder):
            requeued.append(index)
            yield index, marker

    monkeypatch.setattr(BatchDecoder, "run", spy_run)
    monkeypatch.setattr(BatchDecoder, "_preempt", spy_preempt)
    batch = _batch([60, 60, 60])
    results = {}
    for request, outcome in plain.generate_requests(batch, batch_size=2, inbox=inbox):
        results[request.id] = outcome.token_ids
        order.append(request.id)
    monkeypatch.undo()
    assert order[0] == "ticket", order
    assert len(requeued) == 1  # one slot was needed, one row gave it up, once
    for request in batch:
        assert results[request.id] == _alone(plain, request), request.id
    assert ticket.outcomes[0].token_ids == _alone(plain, ticket.request)


def test_a_ticket_joins_a_loop_of_tickets_alone_before_the_first_finishes(engine, monkeypatch):
    """The server's own loop (no job: an empty stream and the inbox) starts with one ticket and
    keeps its other slots: a ticket arriving two cycles later joins at once, not after the first."""
    from dflash_batch.engine.batch import BatchDecoder

    inbox, first, second = (
        Inbox(),
        _ticket("A long first question.", 40),
        _ticket("A short second one.", 4),
    )
    order, cycles = [], [0]
    first.on_done, second.on_done = (
        (lambda: order.append("first")),
        (lambda: order.append("second")),
    )
    run = BatchDecoder.run

    def spy_run(decoder, width):
        cycles[0] += 1
        if cycles[0] == 2:
            inbox.put(second)
        return run(decoder, width)

    monkeypatch.setattr(BatchDecoder, "run", spy_run)
    inbox.put(first)
    assert list(engine.generate_requests([], batch_size=4, inbox=inbox)) == []
    assert order == ["second", "first"]
    assert second.outcomes[0].token_ids == _alone(engine, second.request)
    assert first.outcomes[0].token_ids == _alone(engine, first.request)
