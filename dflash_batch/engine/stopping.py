"""Stop strings over streamed text, holding back only what could still become a stop string."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple


class StopText:
    """Takes decoded text a segment at a time; ``feed`` returns the text safe to emit and the stop
    string hit. Only the text not yet emitted is kept (at most the last ``hold`` characters, where
    a stop string could still begin), so a feed costs its segment, not the text so far."""

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.tail = ""  # decoded, not yet emitted

    def feed(self, segment: str) -> Tuple[str, Optional[str]]:
        text = self.tail + segment  # a stop string found here starts after everything emitted
        hit, cut = None, len(text)
        for s in self.stops:
            i = text.find(s)
            if i != -1 and i < cut:
                hit, cut = s, i
        if hit is not None:
            self.tail = ""  # the text ends at the stop string
            return text[:cut], hit
        keep = len(text) - min(self.hold, len(text))
        self.tail = text[keep:]
        return text[:keep], None

    def flush(self) -> str:
        out, self.tail = self.tail, ""
        return out
