"""How many rows a visit lets end before it stops for the requests that wait.

Stopping at every end pays the host's work between visits (admission, reading tokens, bookkeeping) once an end;
with ragged lengths ends come a step or two apart, and the device waits for the host most of the time. Letting k
rows end first leaves their slots empty meanwhile. With e ends a step among `busy` rows, a step of s seconds and h
seconds of host work a visit, a visit lasts about k / e steps and its freed slots wait k / 2 on average:

    lost share ~ (k / 2) / busy  +  h / ((k / e) s),  least at  k = sqrt(2 busy h e / s)

(docs/performance.md, "ragged lengths, and pacing a visit's ends": the measurement that asked for it). Where
every request has one length the rows end in waves and a wave's first step ends the visit either way.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class VisitPacing:
    """Running means over the last visits (each visit weighs `decay` of the one after it) of what choosing k needs.

    host_s: seconds of host work between device calls, a visit; step_s: the device's seconds a step; ends_per_step:
    rows that ended a step. Each is None until a visit with steps has been recorded."""

    decay: float = 0.8
    host_s: float | None = None
    step_s: float | None = None
    ends_per_step: float | None = None
    _steps: float = dataclasses.field(default=0.0, init=False, repr=False)  # the decayed steps and ends behind
    _ends: float = dataclasses.field(default=0.0, init=False, repr=False)  # ends_per_step

    def record(self, host_s: float, device_s: float, steps: int, ends: int) -> None:
        """One visit: its host time, the device time of its steps, how many steps it ran and rows it ended."""
        if steps <= 0:
            return
        mean = lambda old, new: new if old is None else self.decay * old + (1 - self.decay) * new  # noqa: E731
        self.host_s = mean(self.host_s, host_s)
        self.step_s = mean(self.step_s, device_s / steps)
        self._steps = self.decay * self._steps + steps
        self._ends = self.decay * self._ends + ends
        self.ends_per_step = self._ends / self._steps

    def ends_to_stop(self, busy: int) -> int:
        """k = sqrt(2 busy h e / s) rounded, from 1 to busy (1 until a visit has been recorded)."""
        if not self.step_s or self.host_s is None or not self.ends_per_step:
            return 1
        return max(1, min(busy, round(math.sqrt(2 * busy * self.host_s * self.ends_per_step / self.step_s))))
