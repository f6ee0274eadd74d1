"""What does the server's HTTP side cost a request, and what does the server lose against the engine in process,
with the device taken away?

    PYTHONPATH=. python -m benchmarks.probes.http_cost_probe [--http h11,httptools] [--loop asyncio,uvloop]
    # the 8B shape's times (docs/performance.md): 256 slots, 320 streams, 50 ms steps, 14 ms of host a visit
    PYTHONPATH=. python -m benchmarks.probes.http_cost_probe --in-process --max-num-seqs 256 --concurrency 320 \
        --step-ms 50 --host-ms 14 --prefill-ms 3.2 --num-requests 2560 --client-processes 4 --http httptools \
        --loop asyncio --repeats 1 [--steps-per-visit 8] [--random-range-ratio 0.5] [--visit-ends 1] \
        [--async-scheduling] [--rate 120]

The real `specjax serve` app and engine thread (serve/_app.py, serve/_runner.py) on the bundled tokenizer, in
front of a stand-in engine: a visit sleeps its device time (`--steps-per-visit` x `--step-ms`, and `--prefill-ms` a
request it admits: the interpreter lock released, as a device call releases it), spins its host time (holding the
lock, as the engine's bookkeeping does), and gives every running request `--tokens-per-step` tokens of real text a
step. Client processes (bench_serve.http_point: streamed /v1/completions with the usage chunk, as the 8B runs) keep
`--concurrency` requests in flight. Per uvicorn HTTP parser and event loop:
- the event loop thread's CPU time a request (parsing, validation, streaming its chunks, detokenizing, the
  access line, the metrics), in microseconds;
- the engine thread's CPU time a request outside the stand-in's spin (gathering, handing events over);
- how much the stand-in's host spin stretched (its wall time over its own CPU time): what sharing the lock with
  the event loop costs the engine's host work;
- tokens/s (over the wall, and steady: between the n/4-th and 3n/4-th request ends, bench_serve.steady_throughput)
  and TTFT; with --in-process first the same load on the stand-in without HTTP (bench_serve's closed loop: a request
  that ends is replaced at once), the peer of the server's tokens/s.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path

from specjax import bench_serve
from specjax.engine import RequestOutput, VisitPacing
from specjax.serve import _runner
from specjax.serve._app import Served, build_app
from specjax.serve._config import ServeConfig
from specjax.serve._metrics import ServerMetrics


class StandInEngine:
    """What EngineRunner uses of Engine, with a visit of fixed device and host time and no model."""

    def __init__(self, model, config, drafter=None, on_tokens=None, *, steps_per_visit: int, step_s: float,
                 tokens_per_step: int, host_s: float, prefill_s: float, max_num_seqs: int, text_ids: list[int],
                 visit_ends: int | None):
        self.config = argparse.Namespace(max_num_seqs=max_num_seqs, max_prefill_batch=max_num_seqs,
                                         steps_per_visit=steps_per_visit)
        self.step_s, self.host_s, self.tokens_per_step = step_s, host_s, tokens_per_step
        self.prefill_s = prefill_s  # device time a request admitted at a visit adds to it (its prompt's prefill)
        self.on_tokens, self.text_ids = on_tokens, text_ids  # what requests "generate": real text, as detokenized
        self.running: dict[str, list] = {}  # id -> [request, tokens so far, arrival, first token time]
        self.waiting: list = []
        self.visits = self.steps = self.busy_slot_steps = 0
        self.thread: int | None = None  # the thread that steps it
        self.spin_wall_s = self.spin_cpu_s = 0.0
        self.visit_ends, self.pacing = visit_ends, VisitPacing()  # as the engine's EngineConfig.visit_ends

    def check(self, request) -> None:
        pass

    def add_request(self, request) -> None:
        self.waiting.append([request, [], time.perf_counter(), None])

    def abort_request(self, request_id: str) -> None:
        self.waiting = [row for row in self.waiting if row[0].request_id != request_id]
        self.running.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def stats(self) -> dict:
        return {"visits": self.visits}

    def spin(self, seconds: float) -> None:
        """The engine's host work: seconds of this thread's CPU, holding the interpreter lock."""
        wall, cpu = time.perf_counter(), time.thread_time()
        while time.thread_time() - cpu < seconds:
            pass
        self.spin_wall_s += time.perf_counter() - wall
        self.spin_cpu_s += time.thread_time() - cpu

    def step(self, end_on_finish: bool = False) -> list[RequestOutput]:
        self.thread = threading.get_ident()  # the engine's thread: its CPU time is read from the probe's
        start = time.perf_counter()
        admitted = 0
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            row = self.waiting.pop(0)
            self.running[row[0].request_id] = row
            admitted += 1
        self.spin(self.host_s)
        steps = self.config.steps_per_visit
        if (self.waiting or end_on_finish) and self.running:  # as the engine: the visit ends after k ends
            k = self.pacing.ends_to_stop(len(self.running)) if self.visit_ends is None else self.visit_ends
            lives = sorted(-(-(row[0].max_tokens - len(row[1])) // self.tokens_per_step)
                           for row in self.running.values())
            steps = min(steps, lives[min(k, len(self.waiting) or 1, len(lives)) - 1])
        device_s = steps * self.step_s + admitted * self.prefill_s
        time.sleep(device_s)  # the device's, which releases the lock
        self.visits += 1
        self.steps += steps
        self.busy_slot_steps += len(self.running) * steps
        new, outputs, now = {}, [], time.perf_counter()
        for request_id, row in list(self.running.items()):
            request, tokens = row[0], row[1]
            count = min(steps * self.tokens_per_step, request.max_tokens - len(tokens))
            ids = [self.text_ids[(request.seed + len(tokens) + i) % len(self.text_ids)] for i in range(count)]
            tokens += ids
            row[3] = row[3] or now
            new[request_id] = ids
        self.on_tokens(new)
        for request_id, row in list(self.running.items()):
            request, tokens = row[0], row[1]
            if len(tokens) >= request.max_tokens:
                del self.running[request_id]
                outputs.append(RequestOutput(request_id, tuple(tokens), "length", metrics=None, arrival_time=row[2],
                                             first_token_time=row[3], finish_time=now))
        self.pacing.record(time.perf_counter() - start - device_s, steps * self.step_s, steps, len(outputs))
        return outputs


class AsyncStandInEngine(StandInEngine):
    """The stand-in under the engine's async scheduling (EngineConfig.async_scheduling): a step lands the visit in
    flight, releases the slots of the requests read as ended at the step before, admits (`admit_share` of the host
    work, before the dispatch), dispatches the next visit (its device time slept in a thread, the lock released), and
    only then reads the landed visit (the rest of the host work, overlapping the next visit). A request's end is
    known, and its slot refilled, one visit later; a visit ends at its first end while requests wait (k = 1)."""

    def __init__(self, *args, admit_share: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.admit_share = admit_share
        self.inflight: tuple[threading.Thread, tuple] | None = None  # the visit dispatched: (its thread, its result)
        self.unreleased: list[str] = []  # requests read as ended, their slots freed at the next step

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.inflight or self.unreleased)

    def step(self, end_on_finish: bool = False) -> list[RequestOutput]:
        self.thread = threading.get_ident()
        landed = None
        if self.inflight is not None:
            thread, landed = self.inflight
            thread.join()
            self.inflight = None
        for request_id in self.unreleased:
            self.running.pop(request_id, None)
        self.unreleased, admitted = [], 0
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            row = self.waiting.pop(0) + [0]  # + the tokens the device has been given to emit
            self.running[row[0].request_id] = row
            admitted += 1
        self.spin(self.host_s * self.admit_share)
        stepping = {rid: row for rid, row in self.running.items() if row[4] < row[0].max_tokens}
        if stepping:
            steps = self.config.steps_per_visit
            if self.waiting or end_on_finish:
                steps = min(steps, min(-(-(row[0].max_tokens - row[4]) // self.tokens_per_step)
                                       for row in stepping.values()))
            result = ({}, [])  # new token counts by request, requests that end in it
            for request_id, row in stepping.items():
                count = min(steps * self.tokens_per_step, row[0].max_tokens - row[4])
                result[0][request_id] = count
                row[4] += count
                if row[4] >= row[0].max_tokens:
                    result[1].append(request_id)
            thread = threading.Thread(target=time.sleep, args=(steps * self.step_s + admitted * self.prefill_s,))
            thread.start()
            self.inflight = (thread, result)
            self.visits += 1
            self.steps += steps
            self.busy_slot_steps += len(stepping) * steps
        self.spin(self.host_s * (1 - self.admit_share))
        if landed is None:
            return []
        new, outputs, now = {}, [], time.perf_counter()
        for request_id, count in landed[0].items():
            row = self.running.get(request_id)
            if row is None:  # aborted
                continue
            request, tokens = row[0], row[1]
            ids = [self.text_ids[(request.seed + len(tokens) + i) % len(self.text_ids)] for i in range(count)]
            tokens += ids
            row[3] = row[3] or now
            new[request_id] = ids
        self.on_tokens(new)
        for request_id in landed[1]:
            row = self.running.get(request_id)
            if row is not None:
                self.unreleased.append(request_id)
                outputs.append(RequestOutput(request_id, tuple(row[1]), "length", metrics=None, arrival_time=row[2],
                                             first_token_time=row[3], finish_time=now))
        return outputs


def stand_in(args, *engine_args, **kwargs) -> StandInEngine:
    """The stand-in engine the arguments ask for (--async-scheduling: AsyncStandInEngine)."""
    if args.async_scheduling:
        return AsyncStandInEngine(*engine_args, admit_share=args.async_admit_share, **kwargs)
    return StandInEngine(*engine_args, **kwargs)


def stand_in_settings(args, text_ids: list[int]) -> dict:
    return dict(steps_per_visit=args.steps_per_visit, step_s=args.step_ms / 1e3, tokens_per_step=args.tokens_per_step,
                host_s=args.host_ms / 1e3, prefill_s=args.prefill_ms / 1e3, max_num_seqs=args.max_num_seqs,
                text_ids=text_ids, visit_ends=None if args.visit_ends == "auto" else int(args.visit_ends))


def in_process(args) -> dict:
    """The stand-in engine driven as bench_serve drives the engine in process, no HTTP: `concurrency` requests in
    it, each replaced as it ends (a queue that never empties when concurrency > slots), or with --rate, requests
    arriving at that Poisson rate."""
    import numpy as np

    delivered: dict[str, list[float]] = {}  # each request's token times, as the engine's on_tokens hands them over

    def on_tokens(new: dict) -> None:
        now = time.perf_counter()
        for request_id, ids in new.items():
            delivered.setdefault(request_id, []).extend([now] * len(ids))

    engine = stand_in(args, None, None, on_tokens=on_tokens, **stand_in_settings(args, [1]))
    if args.rate is None:
        arrivals = [0.0] * min(args.concurrency, args.num_requests)  # the rest as requests end
    else:
        gaps = np.random.default_rng(0).exponential(1.0 / args.rate, args.num_requests)
        arrivals = list(np.cumsum(gaps) - gaps[0])
    sent = tokens = 0
    ends = []  # a Record of each request that ended (its end and token times: bench_serve.steady_throughput's)
    start = time.perf_counter()

    def ended(outputs):
        ends.extend(bench_serve.Record(output.arrival_time, output.first_token_time, output.finish_time,
                                       len(output.tokens), tuple(delivered.pop(output.request_id, ())), None)
                    for output in outputs)
        return sum(len(output.tokens) for output in outputs)

    while sent < args.num_requests:
        now = time.perf_counter() - start
        while sent < len(arrivals) and arrivals[sent] <= now:
            engine.add_request(bench_serve.request_for(sent, [[1]], args.new_tokens, args.random_range_ratio))
            sent += 1
        if not engine.has_work():
            time.sleep(max(arrivals[sent] - now, 0.0))
            continue
        outputs = engine.step()
        tokens += ended(outputs)
        if args.rate is None:
            arrivals += [time.perf_counter() - start] * min(len(outputs), args.num_requests - len(arrivals))
    while engine.has_work():
        tokens += ended(engine.step())
    return {"in_process_tok_s": round(tokens / (time.perf_counter() - start)),
            "in_process_steady_tok_s": round(bench_serve.steady_throughput(ends) or 0)}


def thread_cpu_s(ident: int) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def measure(http: str, loop: str, args) -> dict:
    import uvicorn

    from specjax.experiments import load_tokenizer

    tokenizer = load_tokenizer(ServeConfig.model)
    text_ids = tokenizer.encode(Path(__file__).parents[2].joinpath("specjax/decoding.py").read_text(),
                                add_special_tokens=False)
    kwargs = stand_in_settings(args, text_ids)
    _runner.Engine = lambda model, config, drafter, on_tokens: stand_in(args, model, config, drafter, on_tokens,
                                                                        **kwargs)
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = ServeConfig(max_num_seqs=args.max_num_seqs, max_model_len=4096, port=port, log_stats_interval_s=0,
                         admit_wait_ms=args.admit_wait_ms, end_visits_on_finish=args.end_visits_on_finish)
    metrics = ServerMetrics(config.model_name)
    runner = _runner.EngineRunner.for_server(None, None, None, config, metrics)
    if args.admit_share is not None:
        runner.admit_share = args.admit_share
    served = Served(config, runner, tokenizer, metrics, lookahead=1)
    runner.start()
    server = uvicorn.Server(uvicorn.Config(build_app(served), host="127.0.0.1", port=port, access_log=False,
                                           log_level="warning", http=http, loop=loop))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    prompts = [list(range(1000 + i, 1000 + i + args.prompt_len)) for i in range(64)]
    point = dict(new_tokens=args.new_tokens, concurrency=None if args.rate else args.concurrency, rate=args.rate,
                 burstiness=1.0, seed=0, processes=args.client_processes, range_ratio=args.random_range_ratio)
    warm = dict(point, concurrency=args.concurrency, rate=None)
    bench_serve.http_point(url, prompts, num_requests=args.concurrency, **warm)  # warm: first imports, paths
    engine = runner.engine
    before = (thread_cpu_s(thread.ident), thread_cpu_s(engine.thread), engine.spin_wall_s, engine.spin_cpu_s)
    result = bench_serve.http_point(url, prompts, num_requests=args.num_requests, **point)
    after = (thread_cpu_s(thread.ident), thread_cpu_s(engine.thread), engine.spin_wall_s, engine.spin_cpu_s)
    server.should_exit = True
    thread.join()
    runner.stop()
    loop_cpu, engine_cpu, spin_wall, spin_cpu = (b - a for a, b in zip(before, after))
    requests = result["requests"]
    return {"http": http, "loop": loop, "requests": requests, "output_tok_s": round(result["output_tok_s"]),
            "steady_tok_s": round(result["steady_tok_s"] or 0),
            "ttft_mean_ms": round(result["ttft_mean_ms"]), "visits": engine.visits, "steps": engine.steps,
            "busy_slots": round(engine.busy_slot_steps / max(engine.steps, 1), 1),
            "loop_cpu_us_per_request": round(loop_cpu / requests * 1e6),
            "engine_thread_cpu_us_per_request": round((engine_cpu - spin_cpu) / requests * 1e6),
            "engine_host_stretch": round(spin_wall / spin_cpu, 3), "loop_cpu_share": round(loop_cpu / result["wall_s"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", default="h11,httptools")
    parser.add_argument("--loop", default="asyncio,uvloop")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rate", type=float, default=None, help="requests/s arriving (Poisson) instead")
    parser.add_argument("--num-requests", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0, help="bench_serve's: ragged new tokens")
    parser.add_argument("--steps-per-visit", type=int, default=16)
    parser.add_argument("--visit-ends", default="auto", help="EngineConfig.visit_ends: auto (None) or a count")
    parser.add_argument("--async-scheduling", action="store_true", help="the stand-in under async scheduling")
    parser.add_argument("--async-admit-share", type=float, default=0.3,
                        help="--async-scheduling: the share of a visit's host work before its dispatch (admission)")
    parser.add_argument("--tokens-per-step", type=int, default=4, help="a request's (EAGLE at τ 4)")
    parser.add_argument("--step-ms", type=float, default=1.25, help="a step's device time")
    parser.add_argument("--host-ms", type=float, default=2.0, help="a visit's engine host time (holding the lock)")
    parser.add_argument("--prefill-ms", type=float, default=0.0, help="device time a request admitted adds")
    parser.add_argument("--admit-wait-ms", type=float, default=ServeConfig.admit_wait_ms)
    parser.add_argument("--end-visits-on-finish", action="store_true")
    parser.add_argument("--admit-share", type=float, default=None, help="EngineRunner.admit_share (default its own)")
    parser.add_argument("--in-process", action="store_true", help="first the same load without HTTP (the peer)")
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--switch-interval-ms", type=float, default=ServeConfig.switch_interval_ms)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    sink = logging.StreamHandler(open(os.devnull, "w"))  # the access lines are formatted and written, as served
    logging.getLogger("specjax").addHandler(sink)
    logging.getLogger("specjax").setLevel(logging.INFO)
    logging.getLogger("specjax").propagate = False
    print(json.dumps({"python": sys.version.split()[0], "cpus": os.cpu_count(), **vars(args)}))
    if args.in_process:
        print(json.dumps(in_process(args)), flush=True)
    for _ in range(args.repeats):
        for http in args.http.split(","):
            for loop in args.loop.split(","):
                print(json.dumps(measure(http, loop, args)), flush=True)


if __name__ == "__main__":
    main()
