"""The engine's thread: it owns the Engine and steps it while there is work, sleeping when there is none.

The event loop never touches the engine: it puts requests and aborts into an inbox the thread drains
before each step, and each request's tokens and end come back into its own asyncio.Queue through the
loop's call_soon_threadsafe. So HTTP handling never waits on a device call, and the engine is never
used from two threads."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Callable

import jax

from specjax import profiling
from specjax.config import SamplingConfig
from specjax.engine import Engine, EngineConfig, GcPauses, Request

log = logging.getLogger("specjax.serve")

# Events a request's queue receives: ("tokens", [ids]) at each visit, then ("done", RequestOutput) or
# ("failed", message) when the engine itself broke.
TOKENS, DONE, FAILED = "tokens", "done", "failed"


@dataclasses.dataclass
class _Stream:
    send: Callable[[tuple], None]  # hands one event to the request's reader (thread-safe)
    prompt_tokens: int


class QueueSender:
    """A send that puts a request's events into its asyncio.Queue on the event loop that made it, from any thread;
    after that loop closed (nobody is waiting any more) it drops them. `deliver` hands the events of many such
    sends on one loop over in one call_soon_threadsafe (their `batch`, the loop): each call from the engine's
    thread waits for the GIL while the loop is busy serving HTTP (a probe, docs/performance.md: 256 calls one
    by one, seconds; one call of 256, 0.1 ms)."""

    def __init__(self, queue: asyncio.Queue):
        self.queue, self.batch = queue, asyncio.get_running_loop()

    def __call__(self, event: tuple) -> None:
        self.send_many([(self, event)])

    @staticmethod
    def send_many(events: list[tuple[QueueSender, tuple]]) -> None:
        """Events of sends that share one batch (loop), in one hand-over."""
        try:
            events[0][0].batch.call_soon_threadsafe(_put_all, [(send.queue, event) for send, event in events])
        except RuntimeError:
            pass


def _put_all(events: list[tuple[asyncio.Queue, tuple]]) -> None:
    for queue, event in events:
        queue.put_nowait(event)


class EventReader:
    """A request's events as its reader takes them from its queue: the next one, and when that is tokens, the
    tokens events queued right behind it merged into it. A reader that fell behind the engine (an event loop
    busy with many streams) then sends one chunk for what piled up, not one each."""

    def __init__(self, queue: asyncio.Queue):
        self.queue = queue
        self._backlog: collections.deque[tuple] = collections.deque()  # taken from the queue, not yet read

    def ready(self) -> bool:
        """Whether next() has an event without waiting."""
        return bool(self._backlog) or not self.queue.empty()

    async def next(self) -> tuple:
        if not self._backlog:
            self._backlog.append(await self.queue.get())
        while not self.queue.empty():
            self._backlog.append(self.queue.get_nowait())
        kind, value = self._backlog.popleft()
        if kind != TOKENS:
            return kind, value
        ids = list(value)
        while self._backlog and self._backlog[0][0] == TOKENS:
            ids += self._backlog.popleft()[1]
        return TOKENS, ids


def deliver(events: list[tuple[Callable[[tuple], None], tuple]]) -> None:
    """Hands each (send, event) over, each send's in order: those of sends that share a `batch` in one call of
    their send_many, any other send called with each of its events."""
    batches: dict = {}
    for send, event in events:
        batches.setdefault(getattr(send, "batch", send), []).append((send, event))
    for batch in batches.values():
        send = batch[0][0]
        if hasattr(send, "send_many"):
            send.send_many(batch)
        else:
            for _, event in batch:
                send(event)


class EngineRunner:
    """Engine(model, config, drafter) run by one background thread; `submit` and `abort` from the event loop.

    A visit runs up to steps_per_visit steps and admits nothing during them, and over HTTP the requests that
    replace those a visit ended arrive over the next milliseconds, one client round trip each: a visit started
    at the first arrival runs with the others' slots empty, and the rest wait a whole visit. So the thread
    first gathers arrivals:
    - after n requests ended, until n more have arrived than had during the visit (a closed loop's replacements)
      or the free slots are spoken for, for at most `admit_share` of the last visit's time (what waiting may
      cost, against the visit that a late arrival would wait) and never more than `admit_wait_s`;
    - when work arrives at an idle engine, until none came for `admit_gap_s` (a burst), at most `admit_wait_s`.
    admit_wait_s 0 turns it off.

    end_on_finish: end a visit when a request ends (Engine.step's end_on_finish), as it does in process when
    requests wait, since its replacement is coming: with whole visits a request's end reaches its client, and its
    slot a new request, only at the visit's last step. Off by default: no measured workload gained from it
    (docs/performance.md, serving at the 8B shape)."""

    def __init__(self, model, config: EngineConfig, drafter=None, metrics=None, admit_wait_s: float = 0.05,
                 admit_gap_s: float = 0.002, admit_share: float = 0.05, log_stats_interval_s: float = 10.0,
                 end_on_finish: bool = False):
        self.admit_wait_s, self.admit_gap_s, self.admit_share = admit_wait_s, admit_gap_s, admit_share
        self.end_on_finish = end_on_finish
        self._last_step_s = 0.0  # the last engine.step()'s wall time
        self.log_stats_interval_s = log_stats_interval_s
        self.gather_s = 0.0  # seconds spent gathering arrivals before visits
        # Seconds spent handing visits' ends over (their tokens go inside engine.step): with --engine-process a pipe
        # send, which waits while the HTTP side's process does not read.
        self.ends_s = 0.0
        self.gc: GcPauses | None = None  # this process's garbage collections while the thread runs (the stats line)
        self.tokens_sent = 0  # tokens streamed to requests (the warm-up's not counted)
        # The ended requests' speculative counts, summed (their steps, drafts verified, drafts accepted, steps that
        # verified none: adaptive verification's width 0, which skips drafting): the stats line's acceptance.
        self.spec_counts = dict.fromkeys(("spec_steps", "spec_drafted", "spec_accepted", "spec_width0_steps"), 0)
        self._last_stats: tuple[float, dict] | None = None  # (when, the counters then) of the last stats line
        self.engine = Engine(model, config, drafter, on_tokens=self._on_tokens)
        self.metrics = metrics  # a ServerMetrics that counts every ended request, or None
        self.failure: str | None = None  # why the engine thread stopped, if it broke
        self._wake = threading.Condition()
        self._inbox: list[tuple[str, object]] = []  # ("add", Request) / ("abort", id), in arrival order
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="specjax-engine", daemon=True)

    @classmethod
    def for_server(cls, model, config: EngineConfig, drafter, serve_config, metrics=None) -> EngineRunner:
        """The runner a ServeConfig asks for (admit_wait_ms, log_stats_interval_s, end_visits_on_finish)."""
        return cls(model, config, drafter, metrics, admit_wait_s=serve_config.admit_wait_ms / 1e3,
                   log_stats_interval_s=serve_config.log_stats_interval_s,
                   end_on_finish=serve_config.end_visits_on_finish)

    def warm_up(self, prompt: list[int], prompt_len: int | None = None, sampled: bool = True) -> None:
        """Compiles (before start) the greedy and (unless not sampled) the sampled programs, and the prefill of
        each admission batch size (powers of two), on short requests; with prompt_len, also every program that
        prompts of up to that length run (Engine.warmup): the first clients wait for none of it. Logs each stage
        as it ends (at a large shape the whole takes minutes)."""
        start = time.monotonic()
        temperatures = (0.0, 1.0) if sampled else (0.0,)
        stages = ([] if prompt_len is None else [(temperature, None) for temperature in temperatures])
        most = min(self.engine.config.max_num_seqs, self.engine.config.max_prefill_batch)
        stages += [(temperature, batch) for batch in sorted({min(1 << i, most) for i in range(most.bit_length() + 1)})
                   for temperature in temperatures]  # batches 1, 2, 4, ..., most
        for done, (temperature, batch) in enumerate(stages, 1):
            kind = "greedy" if temperature == 0 else "sampled"
            if batch is None:
                self.engine.warmup(prompt_len, SamplingConfig(temperature=temperature))
                what = f"{kind} programs for prompts of up to {prompt_len} tokens"
            else:
                self.engine.run([Request.make(f"warmup-{batch}-{temperature}-{i}", prompt, 4, temperature=temperature)
                                 for i in range(batch)])
                what = f"{kind} admission of {batch}"
            log.info("warm-up %d/%d: %s (%.0f s so far)", done, len(stages), what, time.monotonic() - start)

    def start(self) -> None:
        self.gc = GcPauses()
        self._thread.start()

    @staticmethod
    def start_profile(trace_dir: Path) -> None:
        """Starts a JAX profiler trace of this process into trace_dir (a perfetto trace too)."""
        jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True)

    @staticmethod
    def stop_profile(trace_dir: Path) -> dict:
        """Ends the trace; what it says about the device's time (specjax.profiling), or where there were no
        device kernels (the CPU), the trace's file and why."""
        jax.profiler.stop_trace()
        try:
            return profiling.summarize_trace(trace_dir)
        except ValueError as error:
            return {"trace": str(profiling.trace_file(trace_dir)), "device": str(error)}

    def stop(self) -> None:
        """Ends what is left (aborted) and joins the thread."""
        self.abort_all()
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()
        if self.gc is not None:
            self.gc.close()

    def check(self, request: Request) -> None:
        """The engine's RequestError for a request it cannot serve (reads only its config)."""
        self.engine.check(request)

    def submit(self, request: Request) -> asyncio.Queue:
        """Queues the request; its events arrive in the returned queue, on the calling event loop."""
        queue: asyncio.Queue = asyncio.Queue()
        self.submit_to(request, QueueSender(queue))
        return queue

    def submit_to(self, request: Request, send: Callable[[tuple], None]) -> None:
        """Queues the request; the engine's thread calls send with each of its events (or, where send has a
        `batch`, its send_many with those of the sends that share it: `deliver`)."""
        with self._wake:
            if self.failure is not None:
                raise RuntimeError(self.failure)
            self._streams[request.request_id] = _Stream(send, len(request.prompt))
            if self.metrics is not None:
                self.metrics.running.labels(self.metrics.model_name).inc()
            self._inbox.append(("add", request))
            self._wake.notify()

    def abort(self, request_id: str) -> None:
        """Ends the request at the engine's next step, freeing its slot (its queue gets its 'abort' output)."""
        with self._wake:
            self._inbox.append(("abort", request_id))
            self._wake.notify()

    def abort_all(self) -> list[str]:
        """Aborts every request not yet ended; their ids."""
        with self._wake:
            ids = list(self._streams)
        for request_id in ids:
            self.abort(request_id)
        return ids

    def in_flight(self) -> int:
        with self._wake:
            return len(self._streams)

    # ------------------------------------------------------------------ the engine's thread

    def _loop(self) -> None:
        engine = self.engine
        ended, idle = 0, False  # requests the last visit ended; whether the engine was idle
        while True:
            with self._wake:
                while not self._inbox and not engine.has_work() and not self._stopping:
                    self._log_stats(idle=True)
                    self._wake.wait()
                    idle = True
                if self._stopping and not self._inbox and not engine.has_work():
                    return
                if ended or idle:
                    self._gather_arrivals(ended, idle)
                inbox, self._inbox = self._inbox, []
            for kind, item in inbox:
                if kind == "add":
                    engine.add_request(item)
                else:
                    engine.abort_request(item)
            try:
                start = time.monotonic()
                outputs = engine.step(end_on_finish=self.end_on_finish)
                self._last_step_s = time.monotonic() - start
            except Exception as error:  # the engine's state is unknown now: every request ends with the reason
                log.exception("the engine failed")
                self._fail(f"the engine failed: {type(error).__name__}: {error}")
                return
            ended, idle = len(outputs), False
            self._count_speculation(outputs)
            self._log_stats()
            with self._wake:
                streams = [(self._streams.pop(output.request_id, None), output) for output in outputs]
            handing = time.monotonic()
            deliver([(stream.send, (DONE, output)) for stream, output in streams if stream is not None])
            self.ends_s += time.monotonic() - handing
            for stream, output in streams:
                if stream is not None and self.metrics is not None:
                    self.metrics.running.labels(self.metrics.model_name).dec()
                    self.metrics.observe(output, stream.prompt_tokens)

    def _counters(self) -> dict:
        return {**{k: v for k, v in self.engine.stats().items() if isinstance(v, (int, float))},
                "gather_s": self.gather_s, "ends_s": self.ends_s, "gc_s": 0.0 if self.gc is None else self.gc.seconds,
                "tokens": self.tokens_sent, **self.spec_counts}

    def _count_speculation(self, outputs) -> None:
        for output in outputs:
            if output.metrics:
                counts, widths = output.metrics, output.metrics.get("per_step_drafted", ())
                for key, value in (("spec_steps", counts["steps"]), ("spec_drafted", counts["drafted"]),
                                   ("spec_accepted", counts["accepted"]),
                                   ("spec_width0_steps", sum(1 for width in widths if width == 0))):
                    self.spec_counts[key] += value

    def _log_stats(self, idle: bool = False) -> None:
        """Every log_stats_interval_s while working, one line of what the engine did since the last (as vLLM's
        periodic stats): requests running and waiting (in the engine's queue, or arrived since the visit began),
        visits, steps a visit, slots stepped a step and how many held a request, admission prefills (and the rows
        each padded to a power of two), tokens/s, and the shares of time: waiting on the visits' device loops, the
        rest of engine.step (admission and its prefills, the host's bookkeeping, handing tokens over), gathering
        arrivals, handing the visits' ends over, and the rest (metrics; on a busy server, waiting for the GIL);
        where requests waited, a line of how many ends those visits were to stop after (EngineConfig.visit_ends,
        paced by default); where garbage collections took 1% of the interval or more, a line of their time
        (engine/_heap.py: they pause the whole process, inside any of the shares above). Going idle logs what is
        left of the interval and stops the clock: no line averages over idle time."""
        if not self.log_stats_interval_s:
            return
        now = time.monotonic()
        if self._last_stats is None:
            if not idle:
                self._last_stats = (now, self._counters())
            return
        then, before = self._last_stats
        if now - then < self.log_stats_interval_s and not idle:
            return
        after = self._counters()
        if idle:
            self._last_stats = None
            if after["visits"] == before["visits"]:
                return
        d = {k: after[k] - before[k] for k in after}
        seconds, steps, visits = now - then, max(d["steps"], 1), max(d["visits"], 1)
        with self._wake:  # arrived since the visit began: the engine takes them at the next
            waiting = after["waiting"] + self._arrivals()
        calls = max(d["prefill_calls"], 1)
        log.info("engine: %d running, %d waiting; %.1f visits/s, %.1f steps/visit, %.1f slots stepped/step "
                 "(%.1f busy), %d prefills of %.1f requests (%.1f rows padded), %.0f tokens/s; device %.0f%% "
                 "(prefills %.0f%%), engine host %.0f%%, gathering %.0f%%, handing ends over %.0f%%, the rest %.0f%% "
                 "of the time",
                 after["running"], waiting,
                 d["visits"] / seconds, d["steps"] / visits, d["slot_steps"] / steps, d["busy_slot_steps"] / steps,
                 d["prefill_calls"], d["prefilled_requests"] / calls, d["prefill_padded_rows"] / calls,
                 d["tokens"] / seconds, 100 * d["device_wait_s"] / seconds, 100 * d["prefill_wait_s"] / seconds,
                 100 * (d["step_s"] - d["device_wait_s"]) / seconds, 100 * d["gather_s"] / seconds,
                 100 * d["ends_s"] / seconds, 100 * (seconds - d["step_s"] - d["gather_s"] - d["ends_s"]) / seconds)
        if d["paced_visits"]:  # the visits that ran while requests waited stop after this many ends (visit_ends)
            log.info("engine pacing: %d visits while requests waited, each to stop after %.1f ends", d["paced_visits"],
                     d["paced_ends"] / d["paced_visits"])
        longest_gc = 0.0 if self.gc is None else self.gc.take_longest()
        if d["gc_s"] >= 0.01 * seconds:
            log.info("garbage collection: %.0f ms of the interval's %.1f s, the longest %.0f ms", 1e3 * d["gc_s"],
                     seconds, 1e3 * longest_gc)
        if d["spec_steps"]:  # vLLM's SpecDecoding line, counted as requests end
            log.info("speculative, requests ended in the interval: mean acceptance length %.2f, acceptance rate "
                     "%.2f, %.1f drafts verified a step, %.0f%% of steps verifying none",
                     1 + d["spec_accepted"] / d["spec_steps"], d["spec_accepted"] / max(d["spec_drafted"], 1),
                     d["spec_drafted"] / d["spec_steps"], 100 * d["spec_width0_steps"] / d["spec_steps"])
        if not idle:
            self._last_stats = (now, after)

    def _gather_arrivals(self, ended: int, idle: bool) -> None:
        """Waits (holding self._wake, which wait releases) for arrivals into free slots: see the class docstring."""
        start = time.monotonic()
        free = self.engine.config.max_num_seqs - len(self.engine.running) - len(self.engine.waiting)
        try:
            if idle:
                self._gather_burst(start + self.admit_wait_s, free)
            else:
                wait = min(self.admit_wait_s, self.admit_share * self._last_step_s)
                # Replacements come on top of what arrived during the visit: counted as replacements, those would
                # start the visit at once and leave the replacements a visit behind, beside empty slots.
                arrived = self._arrivals()
                self._gather_replacements(start + wait, min(arrived + ended, free))
        finally:
            self.gather_s += time.monotonic() - start

    def _gather_burst(self, deadline: float, free: int) -> None:
        seen = len(self._inbox)
        while not self._stopping and seen < free and (now := time.monotonic()) < deadline:
            self._wake.wait(min(self.admit_gap_s, deadline - now))
            if len(self._inbox) == seen:  # quiet for a gap: no more are coming now
                return
            seen = len(self._inbox)

    def _gather_replacements(self, deadline: float, expected: int) -> None:
        while (not self._stopping and self._arrivals() < expected
               and (now := time.monotonic()) < deadline):
            self._wake.wait(deadline - now)

    def _arrivals(self) -> int:
        """Requests in the inbox (the caller holds self._wake)."""
        return sum(kind == "add" for kind, _ in self._inbox)

    def _on_tokens(self, new: dict[str, list[int]]) -> None:
        with self._wake:  # the warm-up's requests have no stream
            events = [(stream.send, (TOKENS, ids)) for request_id, ids in new.items()
                      if (stream := self._streams.get(request_id)) is not None]
        deliver(events)
        self.tokens_sent += sum(len(event[1]) for _, event in events)

    def _fail(self, message: str) -> None:
        with self._wake:
            self.failure = message
            streams, self._streams = self._streams, {}
        deliver([(stream.send, (FAILED, message)) for stream in streams.values()])
