"""Stop strings over streamed text, holding back only what could still become a stop string."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple


class StopText:
    """Accumulates decoded text; ``feed`` returns the text safe to emit and the stop string hit."""

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # everything decoded so far, cut at a stop string once one is hit
        self.emitted = 0

    def feed(self, segment: str) -> Tuple[str, Optional[str]]:
        start = max(len(self.text) - self.hold, 0)
        self.text += segment
        hit, cut = None, len(self.text)
        for s in self.stops:
            i = self.text.find(s, start)
            if i != -1 and i < cut:
                hit, cut = s, i
        if hit is not None:
            self.text = self.text[:cut]
            return self._emit(len(self.text)), hit
        return self._emit(len(self.text) - self.hold), None

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out
