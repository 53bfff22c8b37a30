"""The serve process's resident engine: one model, shared by its queue worker and its interactive
requests, decoding one loop at a time.

A batch job's chunk (the in-process worker, ``serve --worker``) decodes through ``Shared``, which
hands the engine the inbox: interactive requests join that chunk's running batch at its next
cycle, ahead of its waiting rows. With no chunk running, ``Resident``'s own thread decodes them
(a loop over the inbox alone, ending when none is left). A chunk that wants the engine while
that loop runs closes the inbox to it (``_Gate``), so the loop ends with the requests it holds and
the newer ones join the chunk instead: neither starves the other.
"""

from __future__ import annotations

import inspect
import logging
import threading
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

import orjson

from ..inbox import Inbox, Ticket

log = logging.getLogger("dflash_batch.serve")
POLL_S = 0.5  # how often an idle loop looks whether the server is stopping


def model_key(model: Dict[str, Any]) -> bytes:
    return orjson.dumps(model, option=orjson.OPT_SORT_KEYS)


class Resident:
    """``factory(**model)`` loads an engine (``api.load_model``); ``model``: the keywords of the
    served model; ``slots``: rows the interactive loop decodes together (None: the engine's
    batch size)."""

    def __init__(
        self,
        factory: Callable[..., Any],
        model: Dict[str, Any],
        *,
        slots: Optional[int] = None,
        inbox: Optional[Inbox] = None,
    ):
        self.factory, self.model, self.slots = factory, model, slots
        self.inbox = inbox if inbox is not None else Inbox()
        # one decoding loop (or other use: a drafter switch, a warm-up) on the engine at a time;
        # re-entrant, as a worker's chunk may call the engine while it holds it
        self.decoding = threading.RLock()
        self._loading = threading.Lock()
        self._engine: Any = None
        self._gate = _Gate(self.inbox)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.counts = {"interactive_done": 0, "interactive_failed": 0, "joined_jobs": 0}

    # -- the engine -----------------------------------------------------------------------
    def engine(self) -> Any:
        """The served model's engine, loaded on first use."""
        with self._loading:
            if self._engine is None:
                log.info("loading the served model for interactive requests")
                self._engine = self.factory(**self.model)
            return self._engine

    def worker_factory(self, **model) -> Any:
        """What the in-process queue worker loads: for a job of the served model, the resident
        engine, shared (interactive requests join its batches); another model, its own."""
        if model_key(model) != model_key(self.model):
            return self.factory(**model)
        return Shared(self.engine(), self)

    # -- interactive requests -------------------------------------------------------------
    def submit(self, ticket: Ticket) -> None:
        """Queue ``ticket`` (``InboxFull`` when too many wait) for the next decoding loop."""
        self.start()
        self.inbox.put(ticket)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="interactive", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.inbox.wait(POLL_S):
                continue
            try:
                engine = self.engine()
            except Exception as e:  # the model does not load: every waiting request hears why
                log.error("the served model failed to load: %s", e)
                for ticket in self.inbox.take():
                    ticket.fail(e)
                continue
            with self.decoding:
                try:
                    for _ in engine.generate_requests([], self.slots, inbox=self._gate):
                        pass  # interactive outcomes go to their tickets, none is yielded
                except Exception as e:  # tickets in flight were failed by the engine
                    log.error("interactive decoding failed: %s", e)

    def joined(self, requests: Iterable, batch_size: Optional[int], **kw):
        """A chunk's decoding on the shared engine, interactive requests joining it."""
        with self.exclusive():
            self.counts["joined_jobs"] += 1
            yield from self.engine().generate_requests(requests, batch_size, inbox=self.inbox, **kw)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The engine for the worker's thread: the interactive loop, if running, takes no more
        requests and ends with those it holds; newer ones wait for the worker's decoding."""
        self._gate.closed.set()
        try:
            with self.decoding:
                self._gate.closed.clear()
                yield
        finally:
            self._gate.closed.clear()


class _Gate:
    """The inbox as the interactive loop sees it: closed while a chunk waits for the engine."""

    def __init__(self, inbox: Inbox):
        self.inbox = inbox
        self.closed = threading.Event()

    def take(self) -> List[Ticket]:
        return [] if self.closed.is_set() else self.inbox.take()


class Shared:
    """The resident engine as the queue worker uses it: its batches take interactive requests."""

    def __init__(self, engine: Any, resident: Resident):
        self._engine, self._resident = engine, resident

    def generate_requests(self, requests: Iterable, batch_size: Optional[int] = None, **kw):
        return self._resident.joined(requests, batch_size, **kw)

    def __getattr__(self, name: str) -> Any:
        """The engine's attributes; its methods (a drafter switch, a warm-up) run while no
        interactive loop decodes."""
        value = getattr(self._engine, name)
        if not inspect.ismethod(value):  # data, or a callable object (a tokenizer)
            return value

        def exclusive(*args, **kw):
            with self._resident.exclusive():
                return value(*args, **kw)

        return exclusive
