"""Interactive requests on their way into a decoding batch: the server puts, the engine takes.

An interactive request (``/v1/chat/completions``) joins whichever decoding loop holds the engine
at its next cycle: a batch job's chunk takes it ahead of the chunk's own waiting rows, and with no
job running the server's own loop decodes it (dflash_batch/server/interactive.py). The engine
calls the ticket back from its thread with each piece a row commits and once with each sample's
outcome; whoever waits on it cancels by ``cancel()`` (its client went away), and the engine drops
the row at its next cycle.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional

from .completion import Piece
from .errors import Cancelled, InboxFull
from .request import Outcome, Request


@dataclass(eq=False)
class Ticket:
    """One interactive request: ``on_piece(sample, piece)`` as each sample's row commits tokens,
    ``outcomes[sample]`` (a ``Completion`` or the error that ended it) once it is done."""

    request: Request
    on_piece: Callable[[int, Piece], None] = lambda sample, piece: None
    outcomes: Dict[int, Outcome] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)
    on_done: Optional[Callable[[], None]] = None

    @property
    def samples(self) -> int:
        return getattr(self.request.options, "n", 1)

    def finish(self, sample: int, outcome: Outcome) -> None:
        """Called by the engine once per sample."""
        self.outcomes[sample] = outcome
        if len(self.outcomes) >= self.samples and not self.done.is_set():
            self.done.set()
            if self.on_done is not None:
                self.on_done()

    def fail(self, error: Exception) -> None:
        """Every sample not yet done ends with ``error`` (a refused prompt, an engine failure)."""
        for k in range(self.samples):
            if k not in self.outcomes:
                self.finish(k, error)

    def cancel(self) -> None:
        self.cancelled.set()


class Inbox:
    """Tickets waiting for a decoding loop, first come first served; thread-safe. ``limit``:
    most tickets waiting at once (``put`` raises ``InboxFull`` beyond it)."""

    def __init__(self, limit: int = 256):
        self.limit = limit
        self._waiting: Deque[Ticket] = deque()
        self._arrived = threading.Condition()

    def __len__(self) -> int:
        return len(self._waiting)

    def put(self, ticket: Ticket) -> None:
        with self._arrived:
            if len(self._waiting) >= self.limit:
                raise InboxFull(f"{self.limit} interactive requests are already waiting")
            self._waiting.append(ticket)
            self._arrived.notify_all()

    def take(self) -> List[Ticket]:
        """Every ticket waiting now (none: at once, an empty list); cancelled ones are dropped."""
        if not self._waiting:  # the engine asks every cycle: no lock for the common answer
            return []
        with self._arrived:
            taken = list(self._waiting)
            self._waiting.clear()
        return [t for t in taken if not _dropped(t)]

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until a ticket waits (True) or ``timeout`` seconds pass (False)."""
        with self._arrived:
            return self._arrived.wait_for(lambda: bool(self._waiting), timeout)


def _dropped(ticket: Ticket) -> bool:
    if ticket.cancelled.is_set():
        ticket.fail(Cancelled("cancelled before it started"))
        return True
    return False
