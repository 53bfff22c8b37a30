"""The requests a batch has not admitted yet: all of a list, or a look-ahead over a stream.

A stream is pulled (and so encoded) only as the batch takes its requests: at most ``ahead``
wait, and when half of them have been taken the rest are pulled, so the batch never waits for
input while input remains and a long job is never held in memory. The share marks
(engine/prefill.py: ``share_marks``) are those among the requests waiting together, worked out
again at each refill; a prefix a new request shares with one already admitted is found in the
prefix cache, where that one kept it if it shared it with another.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Iterable, List, Optional, Tuple

from .prefill import share_marks

REFUSED_AT_ONCE = 64  # refused requests held before the caller reports them


class Waiting:
    """Requests (engine/batch.py: ``EncodedRequest``) in input order, each with its share marks.

    ``source`` yields lists of requests that are pulled together (the n samples of one prompt,
    so that they share its prefill), or None for a request the caller refused itself, counted in
    ``refused`` for the caller to report after the refill (a refill stops once ``REFUSED_AT_ONCE``
    are, so that a long run of refused requests is reported as it goes). ``ahead`` None: pull
    everything at once."""

    def __init__(
        self, source: Iterable, ahead: Optional[int] = None, granularity: Optional[int] = None
    ):
        if ahead is not None and ahead < 1:
            raise ValueError(f"the look-ahead must be at least 1 request, got {ahead}")
        self.source = iter(source)
        self.ahead, self.granularity = ahead, granularity
        self.queue: Deque[Tuple[object, List[int]]] = deque()
        self.done = False  # the source is exhausted
        self.refused = 0  # Nones taken since the caller last looked
        self.urgent = 0  # the first requests of the queue came through ``push_front``

    def __bool__(self) -> bool:
        """Whether any request may still come: one waits, or the source may have more."""
        return bool(self.queue) or not self.done

    def __len__(self) -> int:
        return len(self.queue)

    def refill(self) -> None:
        """Pull until ``ahead`` requests wait, the source ends or ``REFUSED_AT_ONCE`` were refused."""
        new = []
        while self.ahead is None or len(self.queue) + len(new) < self.ahead:
            try:
                group = next(self.source)
            except StopIteration:
                self.done = True
                break
            if group is None:
                self.refused += 1
                if self.refused >= REFUSED_AT_ONCE:
                    break
                continue
            new += group
        if new:
            self._arrange([r for r, _ in self.queue] + new)

    def push_front(self, groups: Iterable[List[object]], urgent: bool = True) -> None:
        """Requests that go ahead of those waiting (interactive ones: dflash_batch/inbox.py), after
        earlier ones pushed so; first come first served among them. ``urgent=False``: behind the
        urgent ones, ahead of the rest (a row that gave its slot up to one)."""
        new = [r for group in groups for r in group]
        if not new:
            return
        queued = [r for r, _ in self.queue]
        self._arrange(queued[: self.urgent] + new + queued[self.urgent :])
        if urgent:
            self.urgent += len(new)

    def drop(self, unwanted) -> List[object]:
        """Remove and return the waiting requests for which ``unwanted(request)`` holds."""
        gone = [r for r, _ in self.queue if unwanted(r)]
        if gone:
            queued = [r for r, _ in self.queue]
            self.urgent -= sum(unwanted(r) for r in queued[: self.urgent])
            self._arrange([r for r in queued if not unwanted(r)])
        return gone

    def _arrange(self, requests: List[object]) -> None:
        """The queue as ``requests``, each with its share marks among them."""
        marks = (
            share_marks([r.ids for r in requests], self.granularity) if self.granularity else None
        )
        self.queue = deque((r, marks[i] if marks else []) for i, r in enumerate(requests))

    def peek(self) -> Optional[Tuple[object, List[int]]]:
        """The next request and its marks (None: none yet); pulls more once half are taken."""
        if not self.done and len(self.queue) <= (self.ahead or 0) // 2:
            self.refill()
        return self.queue[0] if self.queue else None

    def peeked(self) -> List[object]:
        """The requests waiting now, in order (nothing is pulled)."""
        return [r for r, _ in self.queue]

    def pop(self) -> Tuple[object, List[int]]:
        self.urgent = max(self.urgent - 1, 0)
        return self.queue.popleft()
