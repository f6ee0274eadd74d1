"""The engine in a process of its own (`--engine-process`), as vLLM splits its API server from its engine core.

In one process the HTTP event loop and the engine's thread take turns on Python's interpreter lock, and the
engine's host work between device calls waits for the HTTP side's (measured on the H200 at the 8B shape: a
request's TPOT 27-33% longer in the server than in process at 256 requests, docs/performance.md). Here a child
process builds the models and an EngineRunner and warms it up; one pipe carries requests, aborts and profiler
commands in and every request's events out. The parent keeps the HTTP side, the tokenizer and the Prometheus
counters, and touches no device.

Messages, parent to child: ("add", Request), ("abort", id), ("start_profile", dir), ("stop_profile", dir),
("stop", None). Child to parent: ("ready", vocab_size) or ("error", message) once, then ("events", [(id, event)])
per hand-over of the engine's thread (a visit's tokens, or its ends: runner.deliver), ("profile", summary) per
stop_profile, and ("stopped", failure) last.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import queue as queues
import signal
import threading
from pathlib import Path
from typing import Callable

from specjax.config import ConfigError
from specjax.engine import EngineConfig, GcPauses, Request, check_request, freeze_heap
from specjax.serve._config import ServeConfig
from specjax.serve._runner import DONE, FAILED, EngineRunner, QueueSender, deliver

log = logging.getLogger("specjax.serve")

STOP_WAIT_S = 60.0  # how long stop() waits for the child to end its requests and exit before killing it
LONG_GC_S = 0.05  # a garbage collection of this process this long or longer is logged (the engine's own: its stats)


class EngineProcess:
    """EngineRunner's interface to the event loop (warm_up, start, check, submit, abort, abort_all, in_flight,
    failure, start_profile, stop_profile, stop) over an EngineRunner in a child process."""

    def __init__(self, config: ServeConfig, engine_config: EngineConfig, metrics=None):
        self.config, self.engine_config, self.metrics = config, engine_config, metrics
        self.failure: str | None = None
        context = multiprocessing.get_context("spawn")  # a fork would copy the parent's JAX and threads
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_child, args=(config, engine_config, child), name="specjax-engine",
                                        daemon=True)
        self._child_conn = child
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._streams: dict[str, tuple[Callable[[tuple], None], int]] = {}  # id -> (send, prompt tokens)
        self._profiles: queues.Queue = queues.Queue()
        self._reader = threading.Thread(target=self._read, name="specjax-engine-pipe", daemon=True)
        self._vocab_size: int | None = None
        self._gc: GcPauses | None = None  # this (the HTTP side's) process's collections, from start on

    def warm_up(self, prompt: list[int], prompt_len: int | None = None, sampled: bool = True) -> None:
        """Starts the child, which loads the models and warms its runner up (its log lines say how far); returns
        when it serves, or raises its error (a ConfigError for a bad setting)."""
        self._process.start()
        self._child_conn.close()  # the child's end lives in the child now: EOF here when it exits
        self._send(("warm_up", (prompt, prompt_len, sampled)))
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self._process.join(5)  # reaped, so that its exit code is known
            raise RuntimeError(f"the engine process exited during its start (exit code {self._process.exitcode})")
        if kind == "error":
            is_config, message = value
            if is_config:
                raise ConfigError(message.removeprefix("ConfigError: "))
            raise RuntimeError(f"the engine process failed to start: {message}")
        self._vocab_size = value
        log.info("the engine runs in process %d", self._process.pid)

    def start(self) -> None:
        self._gc = GcPauses()
        self._reader.start()

    def check(self, request: Request) -> None:
        check_request(request, vocab_size=self._vocab_size, max_model_len=self.engine_config.max_model_len,
                      lookahead=self.engine_config.lookahead)

    def submit(self, request: Request) -> asyncio.Queue:
        """Queues the request; its events arrive in the returned queue, on the calling event loop."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self.failure is not None:
                raise RuntimeError(self.failure)
            self._streams[request.request_id] = (QueueSender(queue), len(request.prompt))
        if self.metrics is not None:
            self.metrics.running.labels(self.metrics.model_name).inc()
        self._send(("add", request))
        return queue

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def abort_all(self) -> list[str]:
        with self._lock:
            ids = list(self._streams)
        for request_id in ids:
            self.abort(request_id)
        return ids

    def in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def start_profile(self, trace_dir: Path) -> None:
        self._send(("start_profile", trace_dir))

    def stop_profile(self, trace_dir: Path) -> dict:
        self._send(("stop_profile", trace_dir))
        return self._profiles.get()

    def stop(self) -> None:
        """Ends what is left (aborted), stops the child and waits for it (killing it after STOP_WAIT_S)."""
        if self._process.is_alive():
            self.abort_all()
            self._send(("stop", None))
        if self._reader.is_alive():
            self._reader.join(STOP_WAIT_S)
        self._process.join(STOP_WAIT_S if self._process.is_alive() else 0)
        if self._process.is_alive():
            log.warning("the engine process did not stop in %.0f s: killing it", STOP_WAIT_S)
            self._process.kill()
        if self._gc is not None:
            self._gc.close()

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (BrokenPipeError, OSError):  # the child is gone: _read has failed the requests
                pass

    def _read(self) -> None:
        """The pipe's reader: each event to its request's queue; the Prometheus counters at each end."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._fail(f"the engine process exited (exit code {self._process.exitcode})")
                return
            kind = message[0]
            if kind == "stopped":
                return
            if kind == "profile":
                self._profiles.put(message[1])
                continue
            events = []  # ("events", [(request id, event)]): what one hand-over of the child carried
            for request_id, event in message[1]:
                last = event[0] in (DONE, FAILED)
                with self._lock:
                    stream = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
                    if event[0] == FAILED:
                        self.failure = event[1]
                if stream is None:
                    continue
                send, prompt_tokens = stream
                if event[0] == DONE and self.metrics is not None:
                    self.metrics.running.labels(self.metrics.model_name).dec()
                    self.metrics.observe(event[1], prompt_tokens)
                events.append((send, event))
            deliver(events)
            if (pause := self._gc.take_longest()) >= LONG_GC_S:  # it held the events back, and every stream
                log.info("a garbage collection paused the HTTP process for %.0f ms", 1e3 * pause)

    def _fail(self, message: str) -> None:
        with self._lock:
            self.failure = self.failure or message
            streams, self._streams = self._streams, {}
        deliver([(send, (FAILED, message)) for send, _ in streams.values()])
        self._profiles.put({"error": message})


class _PipeSender:
    """The child's send of one request's events: those of a hand-over (runner.deliver) go as one message."""

    def __init__(self, request_id: str, post: Callable[[tuple], None]):
        self.request_id, self.batch = request_id, post

    def __call__(self, event: tuple) -> None:
        self.send_many([(self, event)])

    @staticmethod
    def send_many(events: list[tuple[_PipeSender, tuple]]) -> None:
        events[0][0].batch(("events", [(send.request_id, event) for send, event in events]))


def _child(config: ServeConfig, engine_config: EngineConfig, conn) -> None:
    """The engine process: loads the models, warms an EngineRunner up, then serves the pipe until 'stop'."""
    from specjax.experiments import load_models  # here: the parent never loads weights

    # The parent drains and stops this process through the pipe; a Ctrl-C reaches the whole process group and would
    # end it mid-drain. It still ends if the parent dies: the pipe closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("specjax").setLevel(logging.INFO)
    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        with send_lock:
            conn.send(message)

    _, (prompt, prompt_len, sampled) = conn.recv()
    try:
        model, _, drafter = load_models(config.model, None if config.spec is None else config.spec.method,
                                        config.drafter, config.dtype)
        config.check_model(model.config)
        runner = EngineRunner.for_server(model, engine_config, drafter, config)
        runner.warm_up(prompt, prompt_len, sampled)
        freeze_heap()
    except Exception as error:  # noqa: BLE001 - every start failure goes to the parent, which raises it
        send(("error", (isinstance(error, ConfigError), f"{type(error).__name__}: {error}")))
        return
    runner.start()
    send(("ready", model.config.vocab_size))
    while True:
        try:
            kind, item = conn.recv()
        except EOFError:  # the server went away without a stop
            break
        if kind == "add":
            try:
                runner.submit_to(item, _PipeSender(item.request_id, send))
            except RuntimeError as error:  # the engine failed: this request ends with the reason
                send(("events", [(item.request_id, (FAILED, str(error)))]))
        elif kind == "abort":
            runner.abort(item)
        elif kind == "start_profile":
            runner.start_profile(item)
        elif kind == "stop_profile":
            send(("profile", runner.stop_profile(item)))
        elif kind == "stop":
            break
    runner.stop()
    send(("stopped", runner.failure))
