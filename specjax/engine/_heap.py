"""Python's garbage collector in a serving process: what warm-up left moved out of its reach, its pauses counted.

Compiling the engine's programs leaves hundreds of thousands of Python objects that live as long as the process
(traced jaxprs, lowering and dispatch caches): 0.42 M after the bundled model's EAGLE engine warmed up, 1.6 M in
the 8B-shaped server's engine process. A full collection walks every one of them (~0.1 s and ~0.7 s) while holding
the interpreter lock, so it stops the engine's host work and the HTTP side alike, at whatever moment the allocation
count trips it. vLLM freezes its heap after warm-up for the same reason (`freeze_gc_heap`). docs/performance.md
has the measurements.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("specjax.engine")


def freeze_heap() -> tuple[int, float]:
    """Collects once, then moves every object still alive into the permanent generation, which later
    collections skip. Returns (objects frozen, the seconds that collection took: what each full collection
    would have cost from here on). For a process that has warmed up and now serves: an object frozen that
    later becomes cyclic garbage is never collected."""
    start = time.perf_counter()
    gc.collect()
    seconds = time.perf_counter() - start
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d objects out of the garbage collector's reach (a full collection of them took %.0f ms)",
             frozen, 1e3 * seconds)
    return frozen, seconds


class GcPauses:
    """The time this process spends in garbage collections from construction to close (a gc.callbacks hook):
    seconds in all, and the longest single collection since take_longest last asked."""

    def __init__(self):
        self.seconds = 0.0
        self.longest = 0.0
        self._began: float | None = None
        gc.callbacks.append(self._on_phase)

    def _on_phase(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            pause = time.perf_counter() - self._began
            self.seconds += pause
            self.longest = max(self.longest, pause)
            self._began = None

    def take_longest(self) -> float:
        """The longest collection since the last call (seconds), and starts over."""
        longest, self.longest = self.longest, 0.0
        return longest

    def close(self) -> None:
        if self._on_phase in gc.callbacks:
            gc.callbacks.remove(self._on_phase)
