"""When `pagedserve up` restarts a dead child, and when it gives up on one.

Each death within the last `window_s` seconds doubles the delay before the restart (first_s,
2*first_s, ... up to cap_s); a child that dies more than `max_restarts` times within
`window_s` keeps crashing, and up stops. A child that stays up for `window_s` starts over at
first_s. Pure: times are passed in (time.monotonic() in use), so tests need no clock.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

RESTART_FIRST_S = 0.5
RESTART_CAP_S = 30.0
MAX_RESTARTS = 5
WINDOW_S = 120.0


@dataclass
class RestartPolicy:
    first_s: float = RESTART_FIRST_S
    cap_s: float = RESTART_CAP_S
    max_restarts: int = MAX_RESTARTS
    window_s: float = WINDOW_S
    _deaths: collections.deque[float] = field(default_factory=collections.deque)

    def on_death(self, now: float) -> float | None:
        """Seconds to wait before restarting the child that died at `now`; None: give up."""
        while self._deaths and now - self._deaths[0] > self.window_s:
            self._deaths.popleft()
        self._deaths.append(now)
        recent = len(self._deaths)
        if recent > self.max_restarts:
            return None
        return min(self.first_s * 2 ** (recent - 1), self.cap_s)

    @property
    def recent_deaths(self) -> int:
        return len(self._deaths)
