"""A job's progress on one tqdm bar: items done of the whole job, tokens/s, ETA.

``run`` feeds it each committed row; ``status --watch`` feeds it the job's counts as it polls.
The rate is the mean since the bar started (tqdm smoothing off): a batched engine finishes
items in bursts, and a mean gives an ETA that does not jump with each burst.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional, TextIO

# One name per rate, the same wherever it is shown (bar, `status`, run summary, examples): the
# bar's is all output tokens over the elapsed time; the records' is each row's own decode rate.
OUTPUT_RATE = "output tok/s (whole job)"
DECODE_RATE = "decode tok/s (mean per row)"
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} items [{elapsed}, ETA {remaining}{postfix}]"


class Progress:
    def __init__(
        self, total: int, done: int, desc: str, tokens: int = 0, file: Optional[TextIO] = None
    ):
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        # While the bar is up, log lines to the console go through tqdm.write: each clears the
        # bar and starts on its own line, instead of after the bar's text.
        self.logs = logging_redirect_tqdm()
        self.logs.__enter__()
        self.bar = tqdm(total=total, initial=done, desc=desc, unit="item", smoothing=0, dynamic_ncols=True,
                        bar_format=BAR_FORMAT, file=file)  # fmt: skip
        self.start = time.monotonic()
        self.tokens0 = tokens  # tokens already there when the bar started: not this run's rate
        self.tokens = tokens
        self.seen: set = set()  # item ids with a row from this run

    def rate(self) -> float:
        """Completion tokens per second since the bar started."""
        elapsed = time.monotonic() - self.start
        return (self.tokens - self.tokens0) / elapsed if elapsed > 0 else 0.0

    def row(self, row: Dict[str, Any]) -> None:
        """One committed result row: an item counts as done at its first row (as ``status`` counts)."""
        self.tokens += row.get("completion_tokens") or 0
        if row["id"] not in self.seen:
            self.seen.add(row["id"])
            self.bar.update(1)
        self.show_rate()

    def counts(self, done: int, tokens: int) -> None:
        """The job's counts as a poll found them."""
        self.tokens = tokens
        self.bar.update(done - self.bar.n)
        self.show_rate()

    def show_rate(self) -> None:
        self.bar.set_postfix_str(f"{self.rate():.1f} {OUTPUT_RATE}", refresh=False)

    def close(self) -> None:
        self.show_rate()
        self.bar.refresh()
        self.bar.close()
        self.logs.__exit__(None, None, None)
