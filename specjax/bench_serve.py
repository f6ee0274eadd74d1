"""Load on the serving engine, in process: TTFT, TPOT, ITL, end-to-end latency and throughput against load
(`specjax bench-serve`, and scripts/bench_serve.py with the same arguments).

    python scripts/bench_serve.py --models bundled --methods none,eagle,dflash --concurrency 1,4,16 \\
        --num-requests 64 --new-tokens 64 --output benchmarks/results/bench_serve_cpu
    python scripts/bench_serve.py --models 8b --methods none,eagle:5:4,dflash:15:6 --concurrency 1,16,64,256 \\
        --prompt-len 128 --new-tokens 128 --output $OUT

--models bundled: the bundled target and drafters, prompts from the bundled held-out set (windows of
the standard library's sources), real acceptance. --models 8b: Llama-3.1-8B-shaped random bfloat16
weights (specjax.speed's), random prompts, synthetic acceptance: each method is NAME:K:TAU, the
verifier accepting a mean of TAU tokens a step (rejection_sample_method 'synthetic'; said in the
results). A method ending in :adaptive runs with adaptive verification (specjax.adaptive; its cost curve
profiled at warm-up for each count of slots and kept on disk), e.g. dflash:7:4.0:adaptive. Load is a fixed number of requests in flight (--concurrency, a closed loop: a new request
arrives when one ends) or Poisson arrivals at --rate requests/s (--burstiness: gamma-distributed
gaps of that shape, 1 = Poisson, as vLLM's bench serve); --random-range-ratio R draws request i's new tokens
from [N (1 - R), N (1 + R)] (vLLM's option, on output lengths only: with one length a closed loop's requests
start and end in waves; the static peer, --static-batches, decodes N for every row). Each point is measured
after the engine has compiled everything it will run (Engine.warmup). Metrics as vLLM's bench serve computes them: TTFT
(arrival to first token), TPOT ((last - first token) / (tokens - 1)), ITL (gaps between a request's
successive token deliveries; the engine delivers each visit's tokens together), E2E latency, output
tokens/s over the point's wall time, and between its n/4-th and 3n/4-th request ends (steady tok/s: the rate at
saturation, without the ramp and the drain; not vLLM's); host overhead = the share of step time not spent waiting
for the device. Writes NAME.json, NAME.md and NAME.png (throughput and TPOT against load, one line per method).

--workload shared-prefix: --num-prefixes system prompts of --prefix-len tokens, request i the system prompt
i mod N followed by a suffix of --suffix-len tokens of its own (bundled: windows of the held-out set; 8b:
random ids), as vLLM's prefix_repetition dataset. --prefix-caching off,drop,keep runs each point with prefix
caching off, on (EAGLE drafters drop the last matched block), and on keeping it (disable_eagle_block_drop);
the table adds the prefix cache's hit rate (prompt tokens read from it over prompt tokens).

--draft-kv-offload off,on runs each point with the drafter's KV cache on the device and in pinned host memory
between visits (EngineConfig.draft_kv_offload; 'none' runs 'off' only, a drafter without a KV cache is refused). The
table adds the draft KV bytes of a slot, the draft KV moved between host and device per visit, the device
memory in use after a visit (the most over the point) and the process's peak so far (JAX's memory_stats;
None where the backend reports none). The peak never goes down within a process: for a peak per setting, run
one setting (and one engine size, --max-num-seqs) per process.

--async-scheduling off,on runs each point with the engine's visits read as they end and with each visit dispatched
before the host reads the one before it (EngineConfig.async_scheduling; not with --draft-kv-offload on).

--held-visits whole,on,off runs each adaptive point with the engine's held visits (steps with no switch at the width
the last visit's last step chose, EngineConfig.adaptive_held_visits) run whole, a moved choice ending none (the
default, adaptive_held_whole_visits); with held visits that a moved choice ends; and with none. The table adds their
share of steps.

--visit-ends auto,1 runs each point with the engine's visits stopping, while requests wait, after the rows its pacing
chooses (EngineConfig.visit_ends None) and at the first end; the table adds each point's visits.

--prefill-call-rows 2,inf runs each point with an admission split into prefill calls of power-of-two rows where that
pads fewer rows by more than 2 rows a call, and with one padded call per admission (EngineConfig.prefill_call_rows);
the table adds each point's prefill calls and the rows they padded.

--profile DIR traces each in-process point with JAX's profiler (DIR/<label>_<load>/, a perfetto trace that
Perfetto's UI opens) and adds what the trace says (specjax.profiling): the device's busy share over the point and
its idle time per step, the host's overhead the device did not hide (admission, scheduling, reading tokens between
visits). The profiler slows the host: take throughput from runs without it.

--plot A.json B.json ... only draws those results files' points in one plot (--output/--name.png), a line a label
across them: loads run apart (one engine size each), the widths an adaptive engine chose against load.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from specjax import benchmarking, profiling, speed
from specjax.config import SpecConfig
from specjax.decoding import loop_arrays, pad_request
from specjax.engine import Engine, EngineConfig, Request, freeze_heap

COLUMNS = [("method", "method"), ("K", "K"), ("load", "load"), ("requests", "requests"),
           ("output_tok_s", "output tok/s"), ("steady_tok_s", "steady tok/s"),
           ("with_prefill_tok_s", "static: with prefill tok/s"), ("request_s", "req/s"),
           ("ttft_mean_ms", "TTFT mean ms"), ("ttft_p99_ms", "TTFT p99 ms"),
           ("tpot_mean_ms", "TPOT mean ms"), ("tpot_p50_ms", "TPOT p50 ms"), ("tpot_p99_ms", "TPOT p99 ms"),
           ("itl_p50_ms", "ITL p50 ms"), ("e2e_mean_ms", "E2E mean ms"), ("e2e_p99_ms", "E2E p99 ms"),
           ("mean_acceptance_length", "tau"), ("mean_verified_width", "verified width"), ("host_share", "host share"),
           ("device_ms_per_step", "device ms/step"), ("decode_ms_per_step", "device ms/step, prefill out"),
           ("predicted_ms_per_step", "adaptive: predicted ms/step"),
           ("held_visits", "held visits"), ("held_share", "adaptive: steps in held visits"),
           ("steps", "device steps"), ("visits", "visits"), ("visit_ends", "visit ends"),
           ("prefill_call_rows", "prefill call rows"),
           ("prefill_calls", "prefill calls"), ("prefill_padded_rows", "prefill rows padded"),
           ("prefix_caching", "prefix cache"), ("hit_rate", "hit rate"), ("draft_kv_offload", "draft KV offload"),
           ("async_scheduling", "async scheduling"), ("mixed_prefill", "mixed prefill"),
           ("draft_kv_mib_per_slot", "draft KV MiB/slot"), ("moved_mib_per_visit", "moved MiB/visit"),
           ("device_in_use_gib", "device GiB in use"), ("device_peak_gib", "device GiB peak"),
           ("client_start_spread_ms", "client start spread ms"),
           ("profiled_busy_share", "profiled device busy"), ("profiled_idle_ms_per_step", "profiled idle ms/step"),
           ("profiled_long_gaps", "profiled gaps >= 1 ms")]
PREFIX_MODES = {"off": {}, "drop": dict(enable_prefix_caching=True),
                "keep": dict(enable_prefix_caching=True, disable_eagle_block_drop=True)}
# The values of the switches run as an axis (--draft-kv-offload, --async-scheduling).
ON_OFF = {"off": False, "on": True}
# --held-visits: the engine's fields for each value (EngineConfig.adaptive_held_visits, adaptive_held_whole_visits).
HELD_VISITS = {"whole": {"adaptive_held_visits": True, "adaptive_held_whole_visits": True},
               "on": {"adaptive_held_visits": True, "adaptive_held_whole_visits": False},
               "off": {"adaptive_held_visits": False}}


def mixed_fields(mix: str) -> dict:
    """EngineConfig's mixed prefill fields of a --mixed-prefill value ('off' or TOKENS[xCHUNKS])."""
    if mix == "off":
        return {}
    tokens, _, chunks = mix.partition("x")
    return {"mixed_prefill_tokens": int(tokens), "mixed_prefill_chunks": int(chunks or 1)}
CLIENT_STREAMS = 64  # requests in flight one HTTP client process keeps by default (--client-processes)
CLIENT_START_TIMEOUT_S = 300.0  # how long client processes wait for each other (each imports JAX first)


@dataclasses.dataclass(frozen=True)
class Method:
    name: str  # none (autoregressive) or a SpecConfig method
    num_speculative_tokens: int = 0
    tau: float | None = None  # synthetic acceptance (8b models)
    adaptive: bool = False  # enable_adaptive_verification
    # Synthetic acceptance by position instead of tau: draft i accepted with unconditional rate rates[i - 1] (the
    # first K; --acceptance-rates, e.g. a drafter's measured profile).
    rates: tuple[float, ...] | None = None

    @classmethod
    def parse(cls, text: str) -> Method:
        """NAME[:K[:TAU]][:adaptive], e.g. dflash:7:4.0:adaptive, eagle:5::adaptive; none for autoregressive."""
        name, *rest = text.split(":")
        if name == "none":
            return cls("none")
        adaptive = bool(rest) and rest[-1] == "adaptive"
        rest = rest[:-1] if adaptive else rest
        return cls(name, int(rest[0]) if rest else 4, float(rest[1]) if len(rest) > 1 and rest[1] else None,
                   adaptive)

    @property
    def synthetic_tau(self) -> float | None:
        """The mean acceptance length synthetic acceptance gives: tau, or 1 + the first K rates."""
        return self.tau if self.rates is None else 1 + sum(self.rates[:self.num_speculative_tokens])

    def spec(self) -> SpecConfig | None:
        if self.name == "none":
            return None
        if self.rates is not None or self.tau is not None:
            return speed.synthetic_spec(self.name, self.tau, self.num_speculative_tokens, rates=self.rates,
                                        adaptive=self.adaptive)
        return SpecConfig(method=self.name, num_speculative_tokens=self.num_speculative_tokens,
                          enable_adaptive_verification=self.adaptive)


def bundled_models(methods: list[Method]):
    """(target, {method: drafter}, prompts) of the bundled models, in float32 as runs are, and the held-out
    prompts runs use (64 tokens each)."""
    from specjax import experiments

    target, tokenizer, _ = experiments.load_models("default:target", dtype="float32")
    drafters = {m.name: None if m.name in ("none", "ngram") else
                experiments.load_models("default:target", m.name, dtype="float32")[2] for m in methods}
    prompts = experiments.load_prompts(experiments.RunConfig(target="default:target", num_prompts=256, prompt_len=64), tokenizer)
    return target, drafters, prompts


def shaped_models(methods: list[Method], prompt_len: int, shape: str):
    """Random target and drafters of benchmarking.SHAPES[shape] (speed's), random prompts."""
    target_config, draft_config = benchmarking.SHAPES[shape]
    target = speed.build_target(target_config)
    drafters = {m.name: (None if m.name == "none" else speed.build_drafter(m.name, target_config, draft_config))
                for m in methods}
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, target_config.vocab_size, (1024, prompt_len)).tolist()
    return target, drafters, prompts


def shared_prefix_prompts(base: list, count: int, *, num_prefixes: int, prefix_len: int, suffix_len: int) -> list:
    """count prompts: system prompt i mod num_prefixes (prefix_len tokens, base prompts joined) and a suffix of
    suffix_len tokens of its own (a base prompt's start, those after the system prompts' in turn)."""
    tokens = [t for prompt in base for t in prompt]
    if len(tokens) < num_prefixes * prefix_len or len(base) < 2:
        raise ValueError(f"--num-prefixes {num_prefixes} x --prefix-len {prefix_len} needs more prompt tokens than "
                         f"the {len(tokens)} at hand: allowed at most {len(tokens) // max(prefix_len, 1)} prefixes")
    systems = [tokens[i * prefix_len:(i + 1) * prefix_len] for i in range(num_prefixes)]
    used = -(-num_prefixes * prefix_len // len(base[0]))  # base prompts the system prompts took
    if used + count > len(base):
        raise ValueError(f"{count} requests with suffixes of their own need {used + count} prompts: allowed at most "
                         f"{len(base) - used} requests with these system prompts")
    suffixes = [base[used + i][:suffix_len] for i in range(count)]
    return [systems[i % num_prefixes] + suffixes[i] for i in range(count)]


def percentile(values, q) -> float | None:
    return float(np.percentile(values, q)) * 1e3 if len(values) else None


def new_tokens_of(index: int, new_tokens: int, range_ratio: float = 0.0) -> int:
    """Request `index`'s budget: new_tokens, or with range_ratio r one drawn uniformly from [new_tokens (1 - r),
    new_tokens (1 + r)] (vLLM's bench --random-range-ratio, here on output lengths only) by the index alone, so
    that in process and over HTTP, from any client process, request i asks for the same."""
    if not range_ratio:
        return new_tokens
    low, high = max(1, round(new_tokens * (1 - range_ratio))), round(new_tokens * (1 + range_ratio))
    return int(np.random.default_rng([index, 0x1E4]).integers(low, high + 1))


def request_for(index: int, prompts, new_tokens: int, range_ratio: float = 0.0) -> Request:
    """Request `index` of a run, the same in process, through the runner and over HTTP (whose client sends
    the seed): its own seed, so that synthetic acceptance draws differ between rows as real text's does
    (with one seed, rows admitted together accept alike and finish together, an easier load to batch), and its
    own budget (new_tokens_of)."""
    return Request.make(f"q{index}", prompts[index % len(prompts)], new_tokens_of(index, new_tokens, range_ratio),
                        seed=index)


def point_requests(args, load: float) -> int:
    """How many requests the load point serves (--num-requests, --requests-per-stream)."""
    return max(args.num_requests, args.requests_per_stream * int(load))


def run_point(engine: Engine, prompts, *, num_requests: int, new_tokens: int, concurrency: int | None,
              rate: float | None, burstiness: float, seed: int, range_ratio: float = 0.0) -> dict:
    """Serves num_requests requests under the load; the point's metrics."""
    rng = np.random.default_rng(seed)
    requests = [request_for(i, prompts, new_tokens, range_ratio) for i in range(num_requests)]
    if rate is not None:  # open loop: arrival times drawn up front
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), num_requests)
        arrivals = np.cumsum(gaps) - gaps[0]
    steps0, visits0, wait0, step0 = engine.steps_run, engine.visits, engine.device_wait_s, engine.step_s
    prefill0 = engine.prefill_wait_s
    before = engine.stats()  # the counters this point's figures are differences from
    in_use = []  # device bytes in use after each visit (its run has ended: _collect read its tokens)
    outputs, sent, start = [], 0, time.perf_counter()
    while len(outputs) < num_requests:
        now = time.perf_counter() - start
        if rate is None:
            while sent < num_requests and sent - len(outputs) < concurrency:
                engine.add_request(requests[sent])
                sent += 1
        else:
            while sent < num_requests and arrivals[sent] <= now:
                engine.add_request(requests[sent])
                sent += 1
            if not engine.has_work():  # idle until the next arrival
                time.sleep(max(0.0, arrivals[sent] - now))
                continue
        outputs += engine.step()
        in_use.append(device_memory("bytes_in_use"))
    wall = time.perf_counter() - start
    bad = [o for o in outputs if o.finish_reason == "error"]
    if bad:
        raise RuntimeError(f"{len(bad)} requests were refused: {bad[0].error}")
    # Open loop: a request arrives when its time comes, not when the visit running then ends and the driver adds it
    # (as a client's does over HTTP): its TTFT counts that wait.
    arrived = {} if rate is None else {r.request_id: start + arrivals[i] for i, r in enumerate(requests)}
    records = [Record(arrived.get(o.request_id, o.arrival_time), o.first_token_time, o.finish_time, len(o.tokens),
                      o.token_times, o.metrics) for o in outputs]
    step_s, wait_s = engine.step_s - step0, engine.device_wait_s - wait0
    steps = engine.steps_run - steps0
    after = engine.stats()
    hit_rate = None
    if before["prefix_cache"] is not None:
        cache0, cache = before["prefix_cache"], after["prefix_cache"]
        queried = cache["queried_tokens"] - cache0["queried_tokens"]
        hit_rate = (cache["hit_tokens"] - cache0["hit_tokens"]) / queried if queried else 0.0
    visits = engine.visits - visits0
    offload, offload0 = after["draft_kv_offload"], before["draft_kv_offload"]
    moved = None if offload is None else sum(offload[k] - offload0[k] for k in ("bytes_to_device", "bytes_to_host"))
    return {**summarize(records, wall), "steps": steps, "visits": visits, "hit_rate": hit_rate,
            **{key: after[key] - before[key] for key in ("prefill_calls", "prefill_padded_rows")},
            **host_time(step_s, wait_s, engine.prefill_wait_s - prefill0, steps),
            "predicted_ms_per_step": predicted_step_ms(after.get("adaptive_costs"),
                                                       [r.metrics for r in records if r.metrics], concurrency),
            "held_share": (after["held_steps"] - before["held_steps"]) / steps
            if after.get("adaptive_costs") and steps else None,
            "draft_kv_mib_per_slot": None if offload is None else offload["bytes_per_slot"] / 2**20,
            "moved_mib_per_visit": None if moved is None else moved / max(visits, 1) / 2**20,
            "device_in_use_gib": None if None in in_use else max(in_use, default=0) / 2**30,
            "device_peak_gib": None if device_memory("peak_bytes_in_use") is None
            else device_memory("peak_bytes_in_use") / 2**30}


def profiled_point(trace_dir: Path, steps: int) -> dict:
    """A point's figures from its profiler trace: the device's busy share, its idle ms a step, long gaps."""
    try:
        timeline = profiling.summarize_trace(trace_dir)
    except (FileNotFoundError, ValueError) as error:  # a CPU run has no device kernels: say so, keep the point
        print(f"--profile: {error}", flush=True)
        return {}
    print(f"profile: device busy {timeline['busy_share']:.1%} of {timeline['wall_ms']:.0f} ms, idle "
          f"{timeline['idle_ms'] / max(steps, 1):.2f} ms a step, {timeline['long_gaps']} gaps >= "
          f"{profiling.GAP_MS} ms ({timeline['long_gap_ms']:.0f} ms), threads {timeline['threads']}, "
          f"{timeline['trace']}", flush=True)
    return {"profiled_busy_share": timeline["busy_share"],
            "profiled_idle_ms_per_step": timeline["idle_ms"] / max(steps, 1),
            "profiled_long_gaps": timeline["long_gaps"]}


def host_time(step_s: float, wait_s: float, prefill_s: float, steps: int) -> dict:
    """The share of the engine's step() time not spent waiting on the device, that host time a step, the wait a step
    (the device's time, the visit's call and its summary's read included), and that wait without the prefills' part
    (a decode step's, what adaptive's cost curve predicts)."""
    return {"host_share": (step_s - wait_s) / step_s if step_s else None,
            "host_ms_per_step": (step_s - wait_s) / max(steps, 1) * 1e3,
            "device_ms_per_step": wait_s / steps * 1e3 if steps else None,
            "decode_ms_per_step": (wait_s - prefill_s) / steps * 1e3 if steps else None}


def predicted_step_ms(costs: dict, metrics: list[dict], load: int | None) -> float | None:
    """Adaptive verification's predicted step (ms): its cost curve's seconds at the width of each request-step of
    the point (their per_step_drafted), averaged, on the curve of the count of slots a full closed loop of `load`
    steps (the smallest that holds it). None without a profiled curve (an analytic one is in units of a step),
    under an open loop (no one count), or without steps."""
    if not costs or load is None:
        return None
    curve = costs[min((count for count in costs if count >= load), default=max(costs))]
    if curve["source"] == "analytic":
        return None
    seconds = dict(zip(curve["widths"], curve["seconds"]))
    widths = [width for m in metrics for width in m.get("per_step_drafted", ())]
    return 1e3 * float(np.mean([seconds[width] for width in widths])) if widths else None


def runner_point(runner, prompts, *, num_requests: int, new_tokens: int, concurrency: int,
                 client_delay_s: float = 0.0, range_ratio: float = 0.0) -> dict:
    """The closed loop through the server's engine thread (serve.EngineRunner) with no HTTP between: clients
    submit and read their queues on an event loop, as the server's handlers do. Against run_point (the host
    admits each replacement before the next visit), it shows what the thread's scheduling costs; against
    --url, what HTTP does. client_delay_s: each client waits that long after a request ends before sending the
    next (an HTTP round trip's stand-in)."""
    import asyncio

    queue = list(range(num_requests))[::-1]
    records = []

    async def client():
        first = True
        while queue:
            if not first and client_delay_s:
                await asyncio.sleep(client_delay_s)
            first = False
            index = queue.pop()
            arrival, times = time.perf_counter(), []
            events = runner.submit(request_for(index, prompts, new_tokens, range_ratio))
            while True:  # ("tokens", ids) per visit, then ("done", RequestOutput) or ("failed", why)
                kind, item = await events.get()
                if kind == "tokens":
                    times += [time.perf_counter()] * len(item)
                    continue
                if kind != "done":
                    raise RuntimeError(f"request {index}: {item}")
                output = item
                break
            records.append(Record(arrival, times[0] if times else time.perf_counter(), time.perf_counter(),
                                  len(output.tokens), tuple(times), output.metrics))

    async def run():
        await asyncio.gather(*(client() for _ in range(concurrency)))

    engine = runner.engine
    steps0, visits0, wait0, step0 = engine.steps_run, engine.visits, engine.device_wait_s, engine.step_s
    prefill0 = engine.prefill_wait_s
    start = time.perf_counter()
    asyncio.run(run())
    wall = time.perf_counter() - start
    step_s, wait_s, steps = engine.step_s - step0, engine.device_wait_s - wait0, engine.steps_run - steps0
    return {**summarize(records, wall), "steps": steps, "visits": engine.visits - visits0, "hit_rate": None,
            **host_time(step_s, wait_s, engine.prefill_wait_s - prefill0, steps), "draft_kv_mib_per_slot": None,
            "moved_mib_per_visit": None, "device_in_use_gib": None, "device_peak_gib": None}


def device_memory(key: str) -> int | None:
    """A figure of the default device's memory_stats (bytes), None where the backend reports none."""
    stats = jax.devices()[0].memory_stats()
    return None if not stats or key not in stats else int(stats[key])


@dataclasses.dataclass(frozen=True)
class Record:
    """One request as a client saw it: times (perf_counter seconds), tokens, its acceptance counts."""

    arrival: float
    first_token: float
    finish: float
    num_tokens: int
    token_times: tuple  # when each token (or each streamed chunk) arrived
    metrics: dict | None  # steps and accepted drafts (the engine's names) or vLLM's object (the server's)


def steady_throughput(records: list[Record]) -> float | None:
    """Output tokens a second between the n/4-th and the 3n/4-th request ends: the rate at saturation, without the
    ramp and the drain that a run's whole wall includes (more of it the shorter the run). Tokens are counted when
    they were delivered (a request's tokens shared equally among its token_times: per token in process, per
    streamed chunk over HTTP), not when their requests ended: a visit ends many requests at one instant, and
    counting whole requests would be off by up to a visit's ends. None below 4 requests."""
    ends = sorted(record.finish for record in records)
    if len(ends) < 4:
        return None
    start, stop = ends[len(ends) // 4], ends[len(ends) - 1 - len(ends) // 4]
    if stop <= start:
        return None
    tokens = 0.0
    for record in records:
        times = np.asarray(record.token_times or (record.finish,))
        tokens += record.num_tokens / len(times) * np.count_nonzero((times > start) & (times <= stop))
    return tokens / (stop - start)


def summarize(records: list[Record], wall: float) -> dict:
    """vLLM bench serve's metrics over the requests of one load point."""
    ttft = [r.first_token - r.arrival for r in records]
    tpot = [(r.finish - r.first_token) / (r.num_tokens - 1) for r in records if r.num_tokens > 1]
    itl = [gap for r in records for gap in np.diff(sorted(set(r.token_times)))]
    e2e = [r.finish - r.arrival for r in records]
    metrics = [r.metrics for r in records if r.metrics]
    steps = sum(m.get("steps", m.get("num_spec_steps", 0)) for m in metrics)
    accepted = sum(m.get("accepted", m.get("num_accepted_draft_tokens", 0)) for m in metrics)
    drafted = sum(m.get("drafted", m.get("num_draft_tokens", 0)) for m in metrics)
    return {
        "requests": len(records), "output_tokens": sum(r.num_tokens for r in records),
        "output_tok_s": sum(r.num_tokens for r in records) / wall, "steady_tok_s": steady_throughput(records),
        "request_s": len(records) / wall, "wall_s": wall,
        "ttft_mean_ms": float(np.mean(ttft)) * 1e3, "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
        "tpot_mean_ms": float(np.mean(tpot)) * 1e3 if tpot else None, "tpot_p50_ms": percentile(tpot, 50),
        "tpot_p99_ms": percentile(tpot, 99), "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99),
        "e2e_mean_ms": float(np.mean(e2e)) * 1e3, "e2e_p50_ms": percentile(e2e, 50), "e2e_p99_ms": percentile(e2e, 99),
        "mean_acceptance_length": 1 + accepted / steps if steps else None,
        # Drafts verified a request's step: K for fixed K, what adaptive verification chose for it otherwise.
        "mean_verified_width": drafted / steps if steps else None,
    }


def http_point(url: str, prompts, *, num_requests: int, new_tokens: int, concurrency: int | None, rate: float | None,
               burstiness: float, seed: int, processes: int = 1, range_ratio: float = 0.0) -> dict:
    """The same load against a `specjax serve` at url: streamed /v1/completions of token-id prompts, greedy,
    with the usage chunk (and the speculative metrics, where the server reports them). With processes > 1 the
    load is split between that many client processes (each its share of the requests in flight, or of the rate),
    so that one Python event loop parsing every stream does not bound what the server is seen to do."""
    kwargs = dict(new_tokens=new_tokens, burstiness=burstiness, range_ratio=range_ratio)
    if processes == 1:
        records = http_records(url, prompts, list(range(num_requests)), concurrency=concurrency, rate=rate,
                               seed=seed, **kwargs)
        spread = 0.0
    else:
        import concurrent.futures
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        # Spawned processes take seconds each to import and do not finish together: without the barrier the first
        # sent while the others were importing, and the server saw a fraction of the load (docs/performance.md).
        with context.Manager() as manager, \
                concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
            barrier = manager.Barrier(processes, timeout=CLIENT_START_TIMEOUT_S)
            parts = [pool.submit(http_records, url, prompts, list(range(num_requests))[p::processes],
                                 concurrency=None if concurrency is None else  # the remainder to the first
                                 concurrency // processes + (p < concurrency % processes),
                                 rate=None if rate is None else rate / processes, seed=seed + p, barrier=barrier,
                                 **kwargs)
                     for p in range(processes)]
            by_process = [part.result() for part in parts]
        records = [record for part in by_process for record in part]
        firsts = [min(record.arrival for record in part) for part in by_process if part]
        spread = max(firsts) - min(firsts)
    # The wall runs from the first arrival (perf_counter is the system's monotonic clock, one for every process):
    # a client's start-up is not the server's time.
    start = min(record.arrival for record in records)
    return {**summarize(records, max(record.finish for record in records) - start),
            "client_start_spread_ms": spread * 1e3}


def http_records(url: str, prompts, indices: list[int], *, new_tokens: int, concurrency: int | None,
                 rate: float | None, burstiness: float, seed: int, barrier=None,
                 range_ratio: float = 0.0) -> list[Record]:
    """One client process's requests (prompts[i] for i in indices): a closed loop of `concurrency`, or arrivals
    at `rate`; each request as the client saw it. barrier: passed by every client process before its first
    request, so that they start together."""
    import asyncio

    import httpx

    rng = np.random.default_rng(seed)
    gaps = None if rate is None else rng.gamma(burstiness, 1.0 / (rate * burstiness), len(indices))

    async def one(client, index: int) -> Record:
        body = {"prompt": list(prompts[index % len(prompts)]),
                "max_tokens": new_tokens_of(index, new_tokens, range_ratio), "temperature": 0,
                "seed": index, "stream": True, "stream_options": {"include_usage": True}}
        arrival, times, usage, metrics = time.perf_counter(), [], None, None
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"request {index}: HTTP {response.status_code}: {(await response.aread())[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter())
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    metrics = (chunk.get("metrics") or {}).get("speculative_decoding")
        finish = time.perf_counter()
        return Record(arrival, times[0] if times else finish, finish, usage["completion_tokens"], tuple(times), metrics)

    async def run() -> list[Record]:
        async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
            if barrier is not None:
                await asyncio.to_thread(barrier.wait)
            if rate is None:  # closed loop: `concurrency` clients, each sending its next request when one ends
                queue = list(indices)[::-1]
                records = []

                async def client_loop():
                    while queue:
                        records.append(await one(client, queue.pop()))

                await asyncio.gather(*(client_loop() for _ in range(concurrency)))
                return records
            tasks = []
            for i, (index, gap) in enumerate(zip(indices, gaps)):
                await asyncio.sleep(gap if i else 0.0)
                tasks.append(asyncio.create_task(one(client, index)))
            return list(await asyncio.gather(*tasks))

    return asyncio.run(run())


def plot(rows: list[dict], path: Path, load_label: str) -> dict[str, list[tuple]]:
    """Tokens/s and TPOT against load, a line a label; with adaptive points a third panel, the drafts verified a step.
    Returns that panel's lines: label -> [(load, mean verified width)]."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # With adaptive verification a third panel: the drafts it chose to verify a step, against the load.
    adaptive = any(row.get("adaptive") for row in rows)
    fig, axes = plt.subplots(1, 3 if adaptive else 2, figsize=(16 if adaptive else 11, 4))
    left, right = axes[:2]
    widths = {}
    for index, label in enumerate(dict.fromkeys(row["label"] for row in rows)):
        points = [row for row in rows if row["label"] == label]
        loads, color = [row["load"] for row in points], f"C{index % 10}"  # one colour a label in every panel
        left.plot(loads, [row["output_tok_s"] for row in points], marker="o", label=label, color=color)
        if all(row.get("tpot_mean_ms") for row in points):  # the static peer has no per-request latency
            right.plot(loads, [row["tpot_mean_ms"] for row in points], marker="o", label=label, color=color)
        if adaptive and all(row.get("mean_verified_width") is not None for row in points):
            widths[label] = [(row["load"], row["mean_verified_width"]) for row in points]
            axes[2].plot(loads, [row["mean_verified_width"] for row in points], marker="o", label=label, color=color)
    titles = ["output tokens/s", "TPOT mean (ms)"] + (["drafts verified a step (mean)"] if adaptive else [])
    for axis, title in zip(axes, titles):
        axis.set_xscale("log", base=2)
        axis.set_xlabel(load_label)
        axis.set_title(title)
        axis.grid(alpha=0.3)
    left.legend()
    fig.tight_layout()
    benchmarking.save_figure(fig, path)
    return widths


def comma_list(parser: argparse.ArgumentParser, flag: str, text: str, valid: Callable[[str], object],
               allowed: str) -> list[str]:
    """text's comma-separated items, or the parser's error naming the flag, the first item `valid` refuses and what
    is allowed."""
    items = text.split(",")
    bad = [item for item in items if not valid(item)]
    if bad:
        parser.error(f"{flag} {bad[0]!r} is invalid: allowed a comma-separated list of {allowed}")
    return items


def main(argv=None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("specjax.adaptive").setLevel(logging.INFO)  # each batch's cost profile and its seconds
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", choices=("bundled", *benchmarking.SHAPES), default="bundled")
    parser.add_argument("--methods", default="none,eagle", help="comma-separated: none or NAME[:K[:TAU]]")
    parser.add_argument("--concurrency", default="1,4,16", help="requests in flight (a closed loop)")
    parser.add_argument("--rate", default=None, help="Poisson arrival rates (requests/s) instead of --concurrency")
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument("--num-requests", type=int, default=64, help="requests a load point serves at least")
    parser.add_argument("--requests-per-stream", type=int, default=2,
                        help="and at least this many per request in flight: the first wave's ramp and the last's "
                             "tail are a smaller part of the wall the more there are")
    parser.add_argument("--prompt-len", type=int, default=128, help="8b models' random prompts")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="each request's new tokens drawn uniformly from [N (1 - R), N (1 + R)] for --new-tokens "
                             "N, by its index (vLLM's bench option, on output lengths only); 0: all N")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="slots of one engine serving every load (default: an engine of c slots for each load c)")
    parser.add_argument("--step-slot-counts", default=None,
                        help="comma-separated: the counts of slots an engine's visit may step "
                             "(EngineConfig.step_slot_counts; those past an engine's slots are dropped and its slots "
                             "end the list); default: powers of two")
    parser.add_argument("--steps-per-visit", type=int, default=16)
    parser.add_argument("--max-prefill-batch", type=int, default=16, help="requests prefilled in one call at most")
    parser.add_argument("--static-batches", default="", help="static generate AR at these batches, the peer")
    parser.add_argument("--url", default=None, help="load a running `specjax serve` instead (HTTP, streaming); "
                                                   "--methods then only labels the rows")
    parser.add_argument("--workload", choices=("prompts", "shared-prefix"), default="prompts",
                        help="prompts: the models' prompts as they are; shared-prefix: system prompts shared by the "
                             "requests, each with a suffix of its own")
    parser.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct system prompts")
    parser.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens of a system prompt")
    parser.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: tokens of a request's own suffix")
    parser.add_argument("--prefix-caching", default="off", help="comma-separated: off, drop (prefix caching on, "
                        "EAGLE's last matched block dropped), keep (on, disable_eagle_block_drop)")
    parser.add_argument("--draft-kv-offload", default="off", help="comma-separated: off, on (the drafter's KV cache "
                        "in pinned host memory between visits, EngineConfig.draft_kv_offload)")
    parser.add_argument("--async-scheduling", default="off", help="comma-separated: off, on (each visit dispatched "
                        "before the host reads the one before it, EngineConfig.async_scheduling)")
    parser.add_argument("--mixed-prefill", default="off", help="comma-separated: off, or TOKENS[xCHUNKS]: prompts "
                        "prefilled by the decode steps, CHUNKS (default 1) chunks of TOKENS a step "
                        "(EngineConfig.mixed_prefill_tokens, mixed_prefill_chunks)")
    parser.add_argument("--held-visits", default="whole", help="comma-separated: whole, on, off (adaptive methods: "
                        "visits held at the width the last one chose, with no switch, "
                        "EngineConfig.adaptive_held_visits; whole: a moved choice ends none, "
                        "adaptive_held_whole_visits; on: a moved choice ends the visit)")
    parser.add_argument("--visit-ends", default="auto", help="comma-separated: auto, or N: with requests waiting, "
                        "rows a visit lets end before it stops to admit them (EngineConfig.visit_ends; auto: None)")
    parser.add_argument("--prefill-call-rows", default="inf", help="comma-separated: numbers >= 0 or inf: a prefill "
                        "call's fixed cost in rows, against which an admission splits (EngineConfig.prefill_call_rows)")
    parser.add_argument("--block-size", type=int, default=16, help="prefix cache block size")
    parser.add_argument("--num-prefix-blocks", type=int, default=1024, help="prefix cache pool size in blocks")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="prompt tokens prefilled per visit (chunked prefill; default: whole prompts)")
    parser.add_argument("--client-processes", type=int, default=None,
                        help="--url: client processes sharing the load, each its event loop and connections (default: "
                             "one per 64 requests in flight, at most the CPUs: one Python client parsing 256 streams "
                             "measured itself, docs/performance.md)")
    parser.add_argument("--through", choices=("engine", "runner"), default="engine",
                        help="engine: the host steps the engine and admits each replacement before the next visit; "
                             "runner: the server's engine thread (serve.EngineRunner) with clients on an event loop, "
                             "no HTTP (closed loop only)")
    parser.add_argument("--client-delay-ms", type=float, default=0.0,
                        help="--through runner: ms a client waits after a request ends before sending its next "
                             "(a stand-in for an HTTP round trip)")
    parser.add_argument("--admit-wait-ms", type=float, default=None,
                        help="--through runner: the engine thread's gathering cap (serve's --admit-wait-ms)")
    parser.add_argument("--acceptance-rates", default=None,
                        help="shaped models: synthetic acceptance with these unconditional per-position rates (a "
                             "drafter's measured profile; each method takes its first K) instead of each method's tau")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="in process: trace each point with JAX's profiler into DIR and add the device's busy "
                             "share and idle ms a step from the trace (slows the host: not for throughput)")
    parser.add_argument("--name", default="bench_serve")
    parser.add_argument("--plot", nargs="+", metavar="JSON", default=None,
                        help="only draw these results files' points in one plot, a line a label across files "
                             "(--output/--name.png): loads run apart, an adaptive engine's widths against load")
    parser.add_argument("--output", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.plot:
        results = [json.loads(Path(path).read_text()) for path in args.plot]
        rows = sorted((row for result in results for row in result["rows"]), key=lambda row: float(row["load"]))
        plot(rows, Path(args.output) / f"{args.name}.png", results[0]["meta"]["load"])
        return
    methods = [Method.parse(text) for text in args.methods.split(",")]
    if args.acceptance_rates:
        if args.models == "bundled":
            parser.error("--acceptance-rates: synthetic acceptance is for the shaped models (--models 8b, ...)")
        try:  # SpecConfig checks the profile (each method's first K: probabilities, non-increasing, K of them)
            profile = tuple(float(r) for r in args.acceptance_rates.split(","))
            methods = [method if method.name == "none" else dataclasses.replace(method, rates=profile)
                       for method in methods]
            for method in methods:
                method.spec()
        except ValueError as error:
            parser.error(f"--acceptance-rates {args.acceptance_rates!r}: {error}")
    rates = None if args.rate is None else [float(r) for r in args.rate.split(",")]
    loads = rates or [int(c) for c in args.concurrency.split(",")]
    modes = comma_list(parser, "--prefix-caching", args.prefix_caching, PREFIX_MODES.__contains__,
                       str(list(PREFIX_MODES)))
    offloads = comma_list(parser, "--draft-kv-offload", args.draft_kv_offload, ON_OFF.__contains__, str(list(ON_OFF)))
    mixes = comma_list(parser, "--mixed-prefill", args.mixed_prefill,
                       lambda mix: mix == "off" or re.fullmatch(r"[1-9][0-9]*(x[1-9][0-9]*)?", mix),
                       "off and TOKENS[xCHUNKS] (positive integers)")
    scheds = comma_list(parser, "--async-scheduling", args.async_scheduling, ON_OFF.__contains__, str(list(ON_OFF)))
    helds = comma_list(parser, "--held-visits", args.held_visits, HELD_VISITS.__contains__, str(list(HELD_VISITS)))
    visit_ends = comma_list(parser, "--visit-ends", args.visit_ends,
                            lambda ends: ends == "auto" or re.fullmatch(r"[1-9][0-9]*", ends),
                            "auto and positive integers")
    call_rows = comma_list(parser, "--prefill-call-rows", args.prefill_call_rows,
                           lambda rows: re.fullmatch(r"inf|[0-9]+(\.[0-9]*)?", rows), "numbers >= 0 and inf")
    step_counts = None
    if args.step_slot_counts is not None:
        if not re.fullmatch(r"[1-9][0-9]*(,[1-9][0-9]*)*", args.step_slot_counts):
            parser.error(f"--step-slot-counts {args.step_slot_counts!r} is invalid: allowed a comma-separated list of "
                         "positive integers")
        step_counts = sorted({int(c) for c in args.step_slot_counts.split(",")})
    if not 0 <= args.random_range_ratio < 1:
        parser.error(f"--random-range-ratio {args.random_range_ratio} is invalid: allowed 0 <= R < 1")
    if args.requests_per_stream < 1:
        parser.error(f"--requests-per-stream {args.requests_per_stream} is invalid: allowed 1 or more")
    if args.url is not None:
        if args.profile:
            parser.error("--profile traces the engine in this process: not with --url")
        return http_main(args, methods[0], loads, rates)
    if args.through == "runner" and rates:
        parser.error("--through runner: a closed loop only (--concurrency, not --rate)")
    if args.through == "runner" and args.profile:
        parser.error("--profile traces the engine stepped by this thread: --through engine only")
    if args.models == "bundled":
        target, drafters, prompts = bundled_models(methods)
    else:
        target, drafters, prompts = shaped_models(methods, args.prompt_len, args.models)
    if args.workload == "shared-prefix":
        count = point_requests(args, max(loads))  # run_point's requests: every suffix its own
        prompts = shared_prefix_prompts(prompts, count, num_prefixes=args.num_prefixes,
                                        prefix_len=args.prefix_len, suffix_len=args.suffix_len)
    prompt_len = max(len(p) for p in prompts)
    load_label = "request rate (req/s)" if rates else "requests in flight"
    meta = {**benchmarking.environment(), "models": args.models, "load": load_label, "through": args.through,
            "prompt_len": prompt_len, "new_tokens": args.new_tokens, "random_range_ratio": args.random_range_ratio,
            "steps_per_visit": args.steps_per_visit, "step_slot_counts": args.step_slot_counts or "powers of two",
            "max_prefill_batch": args.max_prefill_batch, "workload": args.workload,
            **({"num_prefixes": args.num_prefixes, "prefix_len": args.prefix_len, "suffix_len": args.suffix_len}
               if args.workload == "shared-prefix" else {}),
            "block_size": args.block_size, "max_num_batched_tokens": args.max_num_batched_tokens,
            "dtype": "bfloat16" if args.models != "bundled" else "float32",
            "acceptance": ("measured" if args.models == "bundled" else "synthetic (tau per method)"
                           if not args.acceptance_rates else f"synthetic, per-position rates {args.acceptance_rates}")}
    rows = []

    def write():  # after every point: a run stopped by a time limit keeps what it measured
        json_path, _ = benchmarking.write_results(args.name, rows, COLUMNS, meta, args.output, notes=NOTES)
        plot(rows, json_path.with_suffix(".png"), load_label)
        return json_path

    for load in ([] if rates else [int(c) for c in args.static_batches.split(",") if c]):
        rows.append({"method": "static AR", "load": load, "label": "static generate AR",
                     **static_autoregressive(target, prompts, load, args.new_tokens)})
        print(f"static generate AR batch {load}: {rows[-1]['output_tok_s']:.1f} tok/s decoding, "
              f"{rows[-1]['with_prefill_tok_s']:.1f} with prefill", flush=True)
        write()
    most_new = round(args.new_tokens * (1 + args.random_range_ratio))
    for method in methods:
        spec = method.spec()
        lookahead = 0 if spec is None else spec.num_draft_nodes + 1
        # Without speculation there is no drafter to offload: 'off' only (a drafter without a KV cache, Medusa's or
        # n-gram's, is refused by the engine, naming the field).
        # The engine refuses async scheduling with offload (its buffers move at each visit): not run together.
        # The engine refuses mixed prefill with offload, and with prefix caching and speculation: not run together.
        # Held visits matter to adaptive methods only: the others run the first value.
        for mode, offload, sched, mix, ends, rows_a_call, held in [
                (m, o, a, x, e, r, w) for m in modes for o in offloads for a in scheds for x in mixes for e in visit_ends
                for r in call_rows for w in helds
                if (o == "off" or spec is not None) and "off" in (o, a) and (method.adaptive or w == helds[0])
                and (x == "off" or (o == "off" and (spec is None or mode == "off")))]:
            engine = runner = None
            for load in loads:
                # Without --max-num-seqs a closed loop of c requests gets an engine of c slots; with it, one engine
                # serves every load (a visit steps the smallest count of slots holding the busy ones: powers of two,
                # or --step-slot-counts).
                slots = args.max_num_seqs or (int(load) if rates is None else 64)
                # A prefix cache would carry one load's blocks into the next: a fresh engine for each.
                if engine is None or engine.config.max_num_seqs != slots or engine.config.enable_prefix_caching:
                    config = EngineConfig(max_num_seqs=slots,
                                          max_model_len=-(-(prompt_len + most_new + lookahead) // 64) * 64,
                                          spec=spec, steps_per_visit=args.steps_per_visit,
                                          max_prefill_batch=min(slots, args.max_prefill_batch),
                                          block_size=args.block_size, num_prefix_blocks=args.num_prefix_blocks,
                                          max_num_batched_tokens=args.max_num_batched_tokens,
                                          draft_kv_offload=ON_OFF[offload],
                                          async_scheduling=ON_OFF[sched], **PREFIX_MODES[mode], **mixed_fields(mix),
                                          visit_ends=None if ends == "auto" else int(ends),
                                          prefill_call_rows=float(rows_a_call),
                                          **HELD_VISITS[held],
                                          step_slot_counts=None if step_counts is None else tuple(
                                              [c for c in step_counts if c < slots] + [slots]))
                    if runner is not None:
                        runner.stop()
                    engine = runner = None  # the last one's caches go before the next one's are made
                    gc.unfreeze()  # with its cycles, which freeze_heap below had put out of the collector's reach
                    gc.collect()
                    if args.through == "runner":
                        from specjax.serve import EngineRunner

                        runner = EngineRunner(target, config, drafters[method.name], **(
                            {} if args.admit_wait_ms is None else {"admit_wait_s": args.admit_wait_ms / 1e3}))
                        engine = runner.engine
                    else:
                        engine = Engine(target, config, drafter=drafters[method.name])
                    warm = time.perf_counter()
                    engine.warmup(prompt_len)
                    print(f"{method.name}: the engine of {slots} slots compiled"
                          f"{' and profiled its adaptive costs' if method.adaptive else ''} in "
                          f"{time.perf_counter() - warm:.0f} s", flush=True)
                    freeze_heap()  # as the server does after its warm-up: no full collection mid-run
                    if runner is not None:
                        runner.start()
                if runner is not None:
                    point = runner_point(runner, prompts, num_requests=point_requests(args, load),
                                         new_tokens=args.new_tokens, concurrency=int(load),
                                         client_delay_s=args.client_delay_ms / 1e3,
                                         range_ratio=args.random_range_ratio)
                label = method.name if spec is None else f"{method.name} K={method.num_speculative_tokens}"
                label += " adaptive" if method.adaptive else ""
                label += "" if len(modes) == 1 else f" prefix {mode}"
                label += "" if len(offloads) == 1 else f" offload {offload}"
                label += "" if len(scheds) == 1 else f" async {sched}"
                label += "" if len(mixes) == 1 else f" mixed {mix}"
                label += "" if len(visit_ends) == 1 else f" ends {ends}"
                label += "" if len(call_rows) == 1 else f" prefill calls {rows_a_call}"
                label += "" if len(helds) == 1 or not method.adaptive else f" held {held}"
                if runner is None:
                    trace_dir = None if args.profile is None else \
                        Path(args.profile) / f"{label.replace(' ', '_').replace('=', '')}_{load}"
                    with contextlib.ExitStack() as stack:
                        if trace_dir is not None:
                            stack.enter_context(jax.profiler.trace(str(trace_dir), create_perfetto_trace=True))
                        point = run_point(engine, prompts, num_requests=point_requests(args, load),
                                          new_tokens=args.new_tokens, concurrency=None if rates else int(load),
                                          rate=load if rates else None, burstiness=args.burstiness, seed=int(load),
                                          range_ratio=args.random_range_ratio)
                    if trace_dir is not None:
                        point.update(profiled_point(trace_dir, point["steps"]))
                rows.append({"method": method.name, "K": method.num_speculative_tokens or None, "load": load,
                             "label": label, "synthetic_tau": method.synthetic_tau, "slots": slots, "prefix_caching": mode,
                             "adaptive": method.adaptive, "draft_kv_offload": offload, "async_scheduling": sched,
                             "mixed_prefill": mix, "visit_ends": ends, "prefill_call_rows": rows_a_call,
                             "held_visits": held if method.adaptive else None, **point})
                print(f"{label:>16} load {load:>6}: {point['output_tok_s']:8.1f} tok/s, "
                      f"TPOT {point['tpot_mean_ms']:.2f} ms, TTFT {point['ttft_mean_ms']:.1f} ms, "
                      f"tau {point['mean_acceptance_length'] or 1:.2f}, hit rate {point['hit_rate'] or 0:.3f}, "
                      f"host {point['host_ms_per_step']:.2f} ms/step"
                      + ("" if point["device_peak_gib"] is None else
                         f", device {point['device_in_use_gib']:.2f} GiB in use, {point['device_peak_gib']:.2f} peak")
                      + ("" if point["moved_mib_per_visit"] is None else
                         f", draft KV {point['moved_mib_per_visit']:.1f} MiB moved a visit"), flush=True)
                json_path = write()
            if runner is not None:
                runner.stop()
            del engine, runner
    gc.unfreeze()  # what freeze_heap froze goes back to the collector: a caller's process (a test's) goes on
    print(f"wrote {json_path} and its .md, .png")


def http_main(args, method: Method, loads, rates) -> None:
    """The load points against the server at args.url; prompts as in process (the bundled held-out set's ids,
    or random ids for --models 8b)."""
    if args.models == "bundled":
        from specjax import experiments

        _, tokenizer, _ = experiments.load_models("default:target")
        prompts = experiments.load_prompts(experiments.RunConfig(target="default:target", num_prompts=256,
                                                                 prompt_len=64), tokenizer)
    else:
        prompts = np.random.default_rng(0).integers(0, benchmarking.SHAPES[args.models][0].vocab_size,
                                                    (1024, args.prompt_len)).tolist()
    load_label = "request rate (req/s)" if rates else "requests in flight"
    meta = {**benchmarking.environment(), "models": args.models, "url": args.url, "load": load_label,
            "new_tokens": args.new_tokens, "random_range_ratio": args.random_range_ratio,
            "through": "HTTP, streamed /v1/completions (token-id prompts, greedy)",
            "client_processes": args.client_processes or f"one per {CLIENT_STREAMS} requests in flight"}
    rows = []
    for load in loads:
        processes = args.client_processes or max(1, min(os.cpu_count() or 1, -(-int(load) // CLIENT_STREAMS)))
        # Untimed first: a wave of short requests at this load, so that what the server compiles on first use
        # (admission batches, slot moves) is not in the figures (in process, Engine.warmup compiled it).
        http_point(args.url, prompts, num_requests=int(max(load, 1)), new_tokens=min(args.new_tokens, 16),
                   concurrency=int(max(load, 1)), rate=None, burstiness=args.burstiness, seed=0,
                   processes=min(processes, max(1, int(load))))
        point = http_point(args.url, prompts, num_requests=point_requests(args, load),
                           new_tokens=args.new_tokens, concurrency=None if rates else int(load),
                           rate=load if rates else None, burstiness=args.burstiness, seed=int(load),
                           processes=min(processes, max(1, int(load))), range_ratio=args.random_range_ratio)
        rows.append({"method": method.name, "K": method.num_speculative_tokens or None, "load": load,
                     "label": f"{method.name} (HTTP)", "client_processes": processes, **point})
        print(f"HTTP load {load:>6}: {point['output_tok_s']:8.1f} tok/s ({point['steady_tok_s'] or 0:.1f} steady), "
              f"TPOT {point['tpot_mean_ms']:.2f} ms, "
              f"TTFT {point['ttft_mean_ms']:.1f} ms, tau {point['mean_acceptance_length'] or 1:.2f}", flush=True)
        json_path, _ = benchmarking.write_results(args.name, rows, COLUMNS, meta, args.output)
        plot(rows, json_path.with_suffix(".png"), load_label)


def static_autoregressive(target, prompts, batch: int, new_tokens: int) -> dict:
    """The peer: generate's static batch of `batch` prompts, autoregressive (speed.tokens_per_s: the full
    run's time less a one-token run's, so neither prefill nor dispatch counts)."""
    prompt_len = max(len(p) for p in prompts)
    cache_size = speed.cache_size_for(prompt_len, new_tokens, 0)
    request = [prompts[i % len(prompts)] for i in range(batch)]
    run_args = loop_arrays(pad_request(target, request, new_tokens, 0, cache_size))[0]
    one_args = loop_arrays(pad_request(target, request, 1, 0, cache_size))[0]
    run = speed.autoregressive_run(target, cache_size)
    tok_s, _ = speed.tokens_per_s(run, run_args, one_args)
    with_prefill_s = benchmarking.timed(lambda: run(run_args))
    return {"output_tok_s": tok_s, "requests": batch, "with_prefill_tok_s": batch * new_tokens / with_prefill_s}


NOTES = ("Each engine has as many slots as the load's requests in flight: its step runs every slot, busy or not. "
         "'static AR' is decoding.generate's autoregressive loop on a static batch of that size: output tok/s counts "
         "decoding only, 'with prefill' the whole call (the engine's figures include its prefills).")


if __name__ == "__main__":
    main()
