"""The engine's host side: requests in, slots of one loop state, a jitted run of steps (engine/_programs.py)
between host visits.

    add_request ──> waiting (FIFO) ──admit──> slot b of the state ──run──> finished ──> RequestOutput
                                  prefill of the admitted rows       K-step rounds until a row ends
                                  (decoding.speculative_init),       (decoding.speculative_step),
                                  written into free slots            the host reads the new tokens
                                  or, with mixed prefill, the prompt
                                  waits in the slot for the steps'
                                  chunks (engine/_mixed.py)

The device state is the same pytree `generate` runs (decoding.SpecState, or DecodeState without
speculation) with `max_num_seqs` rows; a free slot is a done row, which every step skips. The host
visits between device calls: it admits waiting requests into free slots, reads the tokens each slot
emitted, and finishes requests. Each row's draws come from its request's seed, numbered by its own
tokens and steps, and its sampling settings are data: a request's output is what `generate` gives it
alone, and one compiled program serves greedy and sampled requests together.

Held visits (EngineConfig.adaptive_held_visits): with adaptive verification a visit's program chooses each step's
width by a switch over the compiled widths; once a visit's last step chose width w, the next visit runs the same step
held at w with no switch, to its end whatever its steps choose, and the next is held at its last step's choice
(EngineConfig.adaptive_held_whole_visits; without it a held visit ends at the first step whose choice would have
been another, after which the switch's program runs again). On a GPU a step with the switch in its body gains
less from CUDA graphs (docs/performance.md, twenty-second session). Each count of slots stepped compiles the
switch's program and one held at each width worth choosing at that count (adaptive.verify_costs); a width not worth
choosing there runs the switch.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import time
from typing import Any, Callable

import jax
import numpy as np

from specjax import adaptive, decoding
from specjax.config import SamplingConfig
from specjax.engine._blocks import PrefixCache, block_keys
from specjax.engine._config import EngineConfig
from specjax.engine._mixed import ChunkSchedule, plan_chunks
from specjax.engine._offload import DraftKVLayout, DraftKVSlots, check_host_memory
from specjax.engine._pacing import VisitPacing
from specjax.engine._programs import (Program, Visit, admit_waiting, decode_state, empty_caches, free_rows, init_rows,
                                      prefill_pieces, run_steps)
from specjax.engine._request import Request, RequestError, RequestOutput, check_request
from specjax.engine._slots import batch_axes, insert_rows, move_rows, padded_slots, release_slots
from specjax.metrics import AcceptanceMetrics
from specjax.models.transformer import Transformer
from specjax.proposers import build_proposer, proposer_class
from specjax.verify import lossless_verifiers, method_index
from specjax.verify.sampling import GREEDY, SamplingMode, SamplingParams

log = logging.getLogger("specjax.engine")


@dataclasses.dataclass
class _Running:
    """A request in a slot, as the host follows it."""

    request: Request
    arrival: float
    stop: frozenset  # the request's own stop ids (the device knows only the EOS ids)
    tokens: list = dataclasses.field(default_factory=list)
    token_times: list = dataclasses.field(default_factory=list)
    first_token_time: float | None = None
    stopped: bool = False  # emitted one of the request's stop ids (which the device does not know)
    blocks: list = dataclasses.field(default_factory=list)  # prefix cache blocks it holds (released at its end)
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache (vLLM's num_cached_tokens)
    ended: bool = False  # its output is made (a visit dispatched before its end may still hold its slot)
    prefilled: int | None = None  # mixed prefill: prompt tokens in its cache while it waits for the rest; None: all
    keys: list = dataclasses.field(default_factory=list)  # mixed prefill: its prompt's block keys (stored at its end)


@dataclasses.dataclass
class _Chunked:
    """A long prompt prefilled in chunks (max_num_batched_tokens): its caches so far, one row."""

    request: Request
    arrival: float
    start: int  # positions its caches hold
    caches: tuple  # (the target's KVCache, the drafter's or None)
    keys: list  # its prefix cache block keys, matched blocks, held blocks
    matched: int
    blocks: list


@dataclasses.dataclass
class _Dispatched:
    """A visit dispatched and not yet read (async scheduling), with what the host knew when it went."""

    result: concurrent.futures.Future  # of (the visit's summary on the host, the state after it, its counters)
    running: dict  # slot -> _Running at dispatch: the rows the summary's slots hold
    rows: int  # slots it steps
    planned: list  # its prompt chunks (mixed prefill): _mixed.plan_chunks'


class Engine:
    """Continuous batching with speculative decoding over one model (and drafter) on one device.

    engine.add_request(Request(...)); while engine.has_work(): outputs += engine.step(). `step` admits
    what fits, runs one device call of up to steps_per_visit steps, and returns the requests that ended.
    `on_tokens({request_id: new_token_ids})` is called with the requests' new tokens at every visit (and with
    the admitted requests' first tokens before it), once for all of them."""

    def __init__(self, model: Transformer, config: EngineConfig, drafter: Any = None,
                 on_tokens: Callable[[dict[str, list[int]]], None] | None = None):
        self.model, self.config, self.drafter, self.on_tokens = model, config, drafter, on_tokens
        self.waiting: collections.deque[tuple[Request, float]] = collections.deque()
        self.running: dict[int, _Running] = {}  # slot -> request
        self.finished: list[RequestOutput] = []  # refused requests wait here for the next step's return
        self.aborted: set[str] = set()  # ids to end at the next step (a client went away)
        self.mode = GREEDY  # what the compiled programs can sample; grows with the requests seen
        self.steps_run = 0  # device steps, all visits together
        self.visits = 0
        self.slot_steps = 0  # slots stepped times steps, all visits together (free slots below busy ones count)
        self.busy_slot_steps = 0  # ... of which the slot held a request when its visit began
        self.prefill_calls = 0  # admission prefills (each of up to max_prefill_batch requests)
        self.prefill_padded_rows = 0  # rows those calls computed past their requests (each padded to a power of two)
        self.prefilled_requests = 0
        self.prefill_chunks = 0  # prompt chunks prefilled by decode steps (mixed prefill)
        # Seconds of step() spent waiting on the device (the loop's call, reading its results, and reading the
        # prefills' first tokens, which waits for the prefills), and all of it: the difference is host work
        # between device calls (admission, bookkeeping, streaming).
        self.device_wait_s = 0.0
        # The part of it spent reading the prefills' first tokens, which is the prefills' device time (the visit before
        # has been read by then): the rest over the steps is a decode step's, what adaptive's cost curve predicts.
        self.prefill_wait_s = 0.0
        self.step_s = 0.0
        self.pacing = VisitPacing()  # what chooses the ends a visit waits for (EngineConfig.visit_ends None)
        self.paced_visits = 0  # visits run while requests waited, and the ends they were to stop at, summed
        self.paced_ends = 0
        self.held_steps = 0  # steps of held visits (the module's docstring)
        self._visited: tuple[float, int] | None = None  # the device seconds and steps of the visit this step ran
        spec = config.spec
        self._method = None if spec is None else np.int32(method_index(spec))  # the rule for sampled rows: data
        self._verifiers = None if spec is None else lossless_verifiers(spec)
        self._programs: dict = {}  # mode (or (mode, width index) for held visits) -> Program
        # (the target, the drafter's bound params): arguments of every program, not constants closed over (which XLA
        # would fold into the program: slower to compile and, measured on the CPU, about 4x slower to run).
        self._weights = None
        self._step_compiles: dict[tuple[SamplingMode, int], int] = {}  # run_steps programs this engine compiled
        self._hold: int | None = None  # the width index the last visit's last step chose (held visits)
        self._axes: tuple[int, ...] | None = None  # the state leaves' batch axes (batch_axes), as the programs use them
        self.state = None
        self.prefix_cache = None if not config.enable_prefix_caching else PrefixCache(
            config.block_size, config.num_prefix_blocks,
            drop_tail=not config.disable_eagle_block_drop and spec is not None
            and proposer_class(spec.method).draft_kv_reads_next_token, max_model_len=config.max_model_len)
        self.chunked: _Chunked | None = None  # the long prompt being prefilled in chunks
        self._costs = {}  # slots stepped -> adaptive verification's cost at each verify width
        self._holdables: dict[int, list[int]] = {}  # slots stepped -> the width indices a visit may be held at
        self._curves = {}  # slots stepped -> the cost curve those costs came from (stats' adaptive_costs)
        # (mode, admission batch) -> the prompt widths warmup compiled the initialiser at; a prefill pads its
        # prompts up to the narrowest that holds them rather than compile its own width while serving.
        self._warm_widths: dict[tuple[SamplingMode, int], set[int]] = {}
        # Draft KV offload: the layout of the drafter's K and V in the state, and the slots' host buffers.
        self._draft_layout: DraftKVLayout | None = None
        self.draft_kv: DraftKVSlots | None = None
        # Async scheduling: the visit in flight, the thread that makes its call, and the slots of requests that
        # ended in the visit read last (released when the state is the engine's again, at the next step).
        self._dispatched: _Dispatched | None = None
        self._dispatcher: concurrent.futures.ThreadPoolExecutor | None = None
        self._unreleased: list[int] = []
        if config.draft_kv_offload:
            # The engine runs on one device, JAX's default.
            self._device = jax.config.jax_default_device or jax.devices()[0]
            check_host_memory(self._device)
            self._program(GREEDY)  # refuses a drafter without a KV cache now, not at the first request

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        """Queues a request; one the engine cannot serve ends at the next step as finish_reason 'error'."""
        now = time.perf_counter()
        try:
            self.check(request)
        except RequestError as error:
            log.warning("refused %s", error)
            self.finished.append(RequestOutput(request_id=request.request_id, tokens=(), finish_reason="error",
                                               error=str(error), arrival_time=now, finish_time=now))
            return
        self.waiting.append((request, now))

    def check(self, request: Request) -> None:
        """Raises RequestError naming the field if the engine cannot serve the request (a server answers
        it at once; add_request ends it as finish_reason 'error')."""
        check_request(request, vocab_size=self.model.config.vocab_size, max_model_len=self.config.max_model_len,
                      lookahead=self.config.lookahead)

    def abort_request(self, request_id: str) -> None:
        """Ends a waiting or running request at the next step (finish_reason 'abort'), freeing its slot.
        Safe to call from another thread than the one that steps."""
        self.aborted.add(request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.finished or self.aborted or self.chunked
                    or self._dispatched or self._unreleased)

    def stats(self) -> dict:
        """The engine's counters: device steps, visits, slot-steps (all, and busy), admission prefills (calls,
        requests, rows padded; prompt chunks of mixed prefill), seconds in step(), waiting on the device and, of that,
        on the prefills, visits run while requests waited and the ends they were to stop at (summed:
        EngineConfig.visit_ends), and the prefix cache's (hits and queries in tokens and blocks, hit_rate; None when
        prefix caching is off), and with adaptive verification the cost curve of each count of slots stepped so far
        (its seconds at each verify width and its source: 'analytic' or where it was profiled) and the steps of held
        visits."""
        return {"steps": self.steps_run, "visits": self.visits, "slot_steps": self.slot_steps,
                "busy_slot_steps": self.busy_slot_steps, "prefill_calls": self.prefill_calls,
                "prefill_padded_rows": self.prefill_padded_rows, "prefilled_requests": self.prefilled_requests,
                "prefill_chunks": self.prefill_chunks,
                "step_s": self.step_s, "paced_visits": self.paced_visits, "paced_ends": self.paced_ends,
                "held_steps": self.held_steps,
                "device_wait_s": self.device_wait_s, "prefill_wait_s": self.prefill_wait_s,
                "running": len(self.running), "waiting": len(self.waiting),
                "prefix_cache": None if self.prefix_cache is None else self.prefix_cache.stats.as_dict(),
                "draft_kv_offload": None if self.draft_kv is None else self.draft_kv.stats(),
                "adaptive_costs": {rows: self._curve_stats(rows, curve) for rows, curve in self._curves.items()}}

    def _curve_stats(self, rows: int, curve: adaptive.CostCurve) -> dict:
        """stats' adaptive_costs of one count of slots: the curve's seconds at each verify width, and its source."""
        widths = list(self.config.spec.verify_widths)
        return {"widths": widths, "seconds": [float(c) for c in curve.costs(rows, widths)], "source": curve.source}

    def run(self, requests=()) -> list[RequestOutput]:
        """Adds the requests and steps until every request has ended; outputs in the order they ended."""
        for request in requests:
            self.add_request(request)
        outputs = []
        while self.has_work():
            outputs += self.step()
        return outputs

    # ------------------------------------------------------------------ programs

    def _program(self, mode: SamplingMode, hold: int | None = None) -> Program:
        """The static description of the programs that run rows mode covers (built once per mode); hold: its step
        held at that width index, with no switch (the module's docstring, held visits)."""
        if hold is not None:
            if (mode, hold) not in self._programs:
                self._programs[(mode, hold)] = dataclasses.replace(self._program(mode), hold=hold)
            return self._programs[(mode, hold)]
        if mode in self._programs:
            return self._programs[mode]
        config = self.config
        proposer = None
        if config.spec is not None:
            proposer = build_proposer(decoding.static_spec(config.spec, mode), mode, config.max_model_len, self.drafter)
        if self._weights is None:
            if proposer is not None:
                proposer.check(self.drafter, self.model.config)
            self._weights = (self.model, None if proposer is None else proposer.bind(self.drafter, self.model))
        program = Program(proposer=proposer, mode=mode, eos_token_ids=tuple(config.eos_token_ids),
                           cache_size=config.max_model_len, cache_dtype=config.kv_cache_dtype,
                           verifiers=self._verifiers, prefill_chunk=config.mixed_prefill_tokens)
        if config.mixed_prefill_tokens is not None and proposer is not None:
            rows_at = functools.partial(init_rows, self._weights, program=program)
            drafter_at = lambda batch: rows_at(*free_rows(batch, 16)).proposer  # noqa: E731
            program = dataclasses.replace(program, proposer_axes=batch_axes(drafter_at),
                                          cache_axes=batch_axes(lambda batch: proposer.prefix_cache(drafter_at(batch))))
        self._programs[mode] = program
        if self._axes is None:  # the state's layout, the same in every mode's
            rows_at = functools.partial(init_rows, self._weights, program=program)
            self._axes = batch_axes(lambda batch: rows_at(*free_rows(batch, 16)))
            if config.draft_kv_offload:
                shapes = jax.eval_shape(lambda: rows_at(*free_rows(1, 16)))
                self._draft_layout = DraftKVLayout.of(shapes, shapes.proposer, self._axes, self._device,
                                                      config.spec.method)
                # The slot functions and the run leave the offloaded leaves' placeholders alone.
                self._axes = self._draft_layout.resident_axes
        return program

    def _init(self, mode: SamplingMode, arrays: tuple, prefix: decoding.Prefix | None = None):
        """Prefilled rows of the loop state (_row_arrays' arrays; from prefix's caches where given)."""
        program = self._program(mode)  # first: the first program binds the weights
        return init_rows(self._weights, *arrays, prefix, program=program)

    def _run(self, mode: SamplingMode, max_steps: int, stop_after_ends: int, rows: int, plan=None,
             hold: int | None = None) -> tuple:
        """run_steps over the first `rows` slots of the state, now: (the visit's summary, the counters after it)."""
        layout = self._draft_layout
        draft = None if layout is None else self.draft_kv.take(rows)
        visit, self.state, draft, counters = self._run_steps(
            mode, max_steps, stop_after_ends, rows, self._verify_costs(rows, self._program(mode).proposer),
            self.state, draft, plan, hold)
        if layout is not None:
            self.draft_kv.put(draft)
        return visit, counters

    def _run_steps(self, mode: SamplingMode, max_steps: int, stop_after_ends: int, rows: int, costs, state,
                   draft, plan, hold: int | None) -> tuple:
        """run_steps over the first `rows` slots of `state` (one program per count of _row_buckets, more with held
        visits); touches no other engine field than the compile count, so that the dispatch thread may make it."""
        compiled = run_steps._cache_size()
        args, statics = self._visit_args(mode, max_steps, stop_after_ends, rows, costs, state, draft, plan, hold)
        out = run_steps(*args, **statics)
        key = (mode, rows)
        self._step_compiles[key] = self._step_compiles.get(key, 0) + run_steps._cache_size() - compiled
        return out

    def _visit_args(self, mode: SamplingMode, max_steps: int, stop_after_ends: int, rows: int, costs, state, draft,
                    plan, hold: int | None) -> tuple[tuple, dict]:
        """run_steps' arguments and static arguments for a visit (one place: step_hlo compiles what visits run)."""
        width = self.config.steps_per_visit * max(self.config.lookahead, 1)
        return ((self._weights, state, draft, self._method, np.int32(max_steps), np.int32(stop_after_ends), costs,
                 plan, np.bool_(self.config.adaptive_held_whole_visits)),
                dict(program=self._program(mode, hold), rows=rows, width=width, axes=self._axes,
                     layout=self._draft_layout))

    def _dispatch(self, mode: SamplingMode, max_steps: int, stop_after_ends: int, rows: int, plan,
                  planned: list) -> None:
        """Async scheduling: starts a visit from the dispatch thread; the state is the visit's until _land."""
        if self._dispatcher is None:
            self._dispatcher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specjax-visit")
        costs = self._verify_costs(rows, self._program(mode).proposer)
        state, self.state = self.state, None  # donated to the visit
        hold = self._held(rows)

        def visit():
            summary, after, _, counters = self._run_steps(mode, max_steps, stop_after_ends, rows, costs, state, None,
                                                          plan, hold)
            return jax.device_get(summary), after, counters

        self._dispatched = _Dispatched(result=self._dispatcher.submit(visit), running=dict(self.running), rows=rows,
                                       planned=planned)

    def _land(self) -> tuple:
        """Async scheduling: waits for the visit in flight, whose state becomes the engine's again; returns what
        _collect reads of it."""
        dispatched, self._dispatched = self._dispatched, None
        wait = time.perf_counter()
        visit, self.state, counters = dispatched.result.result()
        self.device_wait_s += time.perf_counter() - wait
        self._count(visit, dispatched.rows, len(dispatched.running), dispatched.planned)
        return visit, dispatched.running, counters

    def _count(self, visit: Visit, rows: int, busy: int, planned: list) -> None:
        """Counts the visit's steps; moves on the prompts whose chunks it prefilled (mixed prefill)."""
        steps = int(visit.steps)
        prefilled = []  # (slot, request) of the prompts whose prefill ended, for the prefix cache
        for slot, running, step, filled in planned:
            if step < steps:
                self.prefill_chunks += 1
                running.prefilled = None if filled >= len(running.request.prompt) else filled
                if running.prefilled is None and self.prefix_cache is not None:
                    prefilled.append((slot, running))
        if prefilled:  # the slots are the visit's still: the host compacts them after this
            stored = self.prefix_cache.store(decode_state(self.state).cache, None,
                                             [(slot, r.keys, len(r.blocks)) for slot, r in prefilled])
            for (_, running), held in zip(prefilled, stored):
                running.blocks += held
        self.held_steps += steps if self._held(rows) is not None else 0  # what this visit ran under
        self._hold = int(visit.chosen) if self._held_visits() and int(visit.chosen) >= 0 else None
        self.steps_run += steps
        self.visits += 1
        self.slot_steps += rows * steps
        self.busy_slot_steps += busy * steps

    def _held_visits(self) -> bool:
        """Whether visits may run held programs (EngineConfig.adaptive_held_visits, with adaptive verification)."""
        spec = self.config.spec
        return spec is not None and spec.enable_adaptive_verification and self.config.adaptive_held_visits

    def _holdable(self, rows: int) -> list[int]:
        """The width indices a visit of `rows` slots may be held at: those worth choosing at that count (held
        visits; none without them)."""
        if not self._held_visits():
            return []
        if rows not in self._holdables:  # read from the device once a count, not every visit
            costs = np.asarray(self._verify_costs(rows, self._program(self.mode).proposer))
            self._holdables[rows] = [index for index, cost in enumerate(costs) if cost < adaptive.FORCED_OUT]
        return self._holdables[rows]

    def _held(self, rows: int) -> int | None:
        """The width index the next visit of `rows` slots is held at (None: the switch's program runs)."""
        return self._hold if self._hold is not None and self._hold in self._holdable(rows) else None

    def _verify_costs(self, rows: int, proposer):
        """Adaptive verification's costs for a step of `rows` slots (None without it), found once per count."""
        spec = self.config.spec
        if spec is None or not spec.enable_adaptive_verification:
            return None
        if rows not in self._costs:
            curve = self.config.cost_curve or adaptive.default_cost_curve(
                self.model, rows, spec.verify_widths, self.config.max_model_len,
                decoding.step_timing(self.model, self._weights[1], proposer))
            self._costs[rows], self._curves[rows] = adaptive.verify_costs(spec, curve, rows), curve
        return self._costs[rows]

    def step_programs(self) -> dict[tuple[SamplingMode, int], int]:
        """The step programs this engine's visits compiled, by the sampling mode and the count of slots they step:
        0 where an engine of the same settings compiled it before in this process (engines share programs), 1 (2
        with held visits, the switch's and one a width held), more a recompile."""
        return dict(self._step_compiles)

    def step_hlo(self, rows: int | None = None) -> str:
        """The compiled visit program over `rows` slots (default: all) in the engine's widest sampling mode, as
        optimised HLO text: where a researcher (or a test) reads what a step copies and fuses."""
        mode = self.mode
        self._ensure_state(mode)
        rows = rows or self.config.max_num_seqs
        costs = self._verify_costs(rows, self._program(mode).proposer)
        args, statics = self._visit_args(mode, 0, rows + 1, rows, costs, self.state, None, self._plan()[0], None)
        return run_steps.lower(*args, **statics).compile().as_text()

    def _ensure_state(self, mode: SamplingMode) -> None:
        """The engine's state: every slot free (done), built by the initialiser over zero-budget rows."""
        if self.state is None:
            rows = self.config.max_num_seqs
            self.state = self._init(mode, free_rows(rows, 16))
            if self._draft_layout is not None:  # every slot gets its host buffer (a free slot's is stepped too)
                self.draft_kv = DraftKVSlots(self._draft_layout, rows)
                self.draft_kv.store(self.state, list(range(rows)))
                self.state = self._draft_layout.strip(self.state)

    # ------------------------------------------------------------------ one visit

    def warmup(self, prompt_len: int, sampling: SamplingConfig = SamplingConfig()) -> None:
        """Compiles what requests with prompts of up to prompt_len tokens and these sampling settings will
        run (every admission bucket at prompt_len's width, which shorter prompts are padded to; the step
        programs), changing no slot, so that timed runs compile nothing."""
        mode = SamplingMode.of([sampling])
        mode = GREEDY if not mode.sampled else self.mode.union(mode)
        self.mode = self.mode.union(mode)
        self._ensure_state(mode)
        width = min(decoding.bucket(prompt_len, decoding.MIN_PROMPT_BUCKET), self.config.max_model_len)
        nowhere = self.config.max_num_seqs  # a target past the rows: every move and release is dropped
        batch = 1
        while self.config.mixed_prefill_tokens is None and batch <= decoding.bucket(
                min(self.config.max_prefill_batch, self.config.max_num_seqs)):
            rows = self._init(mode, free_rows(batch, width))
            self._insert(rows, [nowhere] * batch)  # every row dropped
            self._warm_widths.setdefault((mode, batch), set()).add(width)
            batch *= 2
        if self.config.mixed_prefill_tokens is not None:  # the admissions' programs (padded_slots' counts)
            for count in (1 << i for i in range(decoding.bucket(nowhere).bit_length())):
                slots = padded_slots([nowhere] * count, nowhere)  # every row dropped
                self.state = admit_waiting(self.state, slots, *free_rows(count, self.config.max_model_len))
                if self.prefix_cache is not None:
                    cache, _ = self.prefix_cache.load(self.state.cache, None, [[]] * count, slots)
                    self.state = dataclasses.replace(self.state, cache=cache)
            if self.prefix_cache is not None:
                self.prefix_cache.copy_in(self.state.cache, None, [], [], [])  # a store's program, copying nothing
        for rows in self._row_buckets():
            for hold in (None, *self._holdable(rows)):
                self._run(mode, 0, rows + 1, rows, self._plan()[0], hold)
        for count in (1 << i for i in range(decoding.bucket(nowhere).bit_length())):  # padded_slots' counts
            self.state = move_rows(self.state, padded_slots([0] * count, 0), padded_slots([nowhere] * count, nowhere),
                                   axes=self._axes)
            self._release([nowhere] * count)
        self._warm_offsets(mode, prompt_len)
        jax.block_until_ready(self.state)

    def _warm_offsets(self, mode: SamplingMode, prompt_len: int) -> None:
        """Compiles the prefills from an offset that prefix caching and chunked prefill run: each admission
        bucket at each width, the block copies; a long prompt's chunks (one row, power-of-two widths up to
        max_num_batched_tokens). Nothing changes in the pool (its copies go past it) or the slots."""
        config = self.config
        top = min(decoding.bucket(prompt_len, decoding.MIN_PROMPT_BUCKET), config.max_model_len)
        # The admission widths: powers of two from the minimum bucket, and the cache's length where that is less.
        widths = sorted({w for w in (decoding.MIN_PROMPT_BUCKET << i for i in range(top.bit_length())) if w < top}
                        | {top})
        batches = []
        if self.prefix_cache is not None:
            batches = [b for b in (1 << i for i in range(8)) if b <= decoding.bucket(
                min(config.max_prefill_batch, config.max_num_seqs))]
        chunk_widths = []
        if config.max_num_batched_tokens is not None:
            chunk_widths = [1 << i for i in range(config.max_num_batched_tokens.bit_length())]
            batches = sorted(set(batches) | {1})
        for batch in batches:
            for width in widths + (chunk_widths if batch == 1 else []):
                caches = self._empty_caches(mode, batch)
                if self.prefix_cache is not None:
                    caches = self.prefix_cache.load(*caches, [[]] * batch)
                rows = self._init(mode, free_rows(batch, top), decoding.Prefix(
                    target=caches[0], draft=caches[1], start=np.zeros(batch, np.int32), width=width))
            if self.prefix_cache is not None:
                proposer = self._program(mode).proposer
                self.prefix_cache.copy_in(decode_state(rows).cache,
                                          None if proposer is None else proposer.prefix_cache(rows.proposer),
                                          [], [], [])

    def _row_buckets(self) -> list[int]:
        """The counts of slots a visit steps: EngineConfig.step_slot_counts, or powers of two below max_num_seqs, and
        max_num_seqs."""
        if self.config.step_slot_counts is not None:
            return list(self.config.step_slot_counts)
        counts, rows = [], 1
        while rows < self.config.max_num_seqs:
            counts.append(rows)
            rows *= 2
        return counts + [self.config.max_num_seqs]

    def _rows_to_step(self) -> int:
        """The smallest row bucket that holds every busy slot (busy slots are kept first: _compact)."""
        last = max(self.running) + 1
        return next(rows for rows in self._row_buckets() if rows >= last)

    def step(self, *, end_on_finish: bool = False) -> list[RequestOutput]:
        """Admits waiting requests into free slots, runs one device call, and returns the requests that
        ended (and those refused since the last step).

        The call runs steps_per_visit steps, or while requests wait until rows end (EngineConfig.visit_ends:
        as many as the last visits' costs make worth a visit, or as wait if fewer). end_on_finish: until a row
        ends even though none waits, for a caller whose requests arrive while it runs (a server, whose clients
        replace each request that ends: its slot would otherwise stay empty, and its end unsent, until the
        visit's last step). With async_scheduling the call is dispatched and the step returns what the visit
        before it gave (the host reads that one while the device runs this one)."""
        start, waited, self._visited = time.perf_counter(), self.device_wait_s, None
        try:
            outputs = self._step(end_on_finish)
        finally:
            self.step_s += time.perf_counter() - start
        if self._visited is not None:
            device_s, steps = self._visited
            host_s = time.perf_counter() - start - (self.device_wait_s - waited)
            self.pacing.record(host_s, device_s, steps,
                               sum(output.finish_reason in ("stop", "length") for output in outputs))
        return outputs

    def _step(self, end_on_finish: bool) -> list[RequestOutput]:
        ended, self.finished = self.finished, []
        landed = None if self._dispatched is None else self._land()
        if self._unreleased:
            self._release(self._unreleased)
            self._unreleased = []
        self._compact()
        if self.aborted:
            ended += self._abort()
        free = [slot for slot in range(self.config.max_num_seqs) if slot not in self.running]
        prefilled = []  # (prefilled rows, their slots) of this visit's admissions
        budget = self.config.max_num_batched_tokens or float("inf")  # prompt tokens this visit may prefill
        if self.chunked is not None:
            budget -= self._next_chunk(budget, free, prefilled)
            free = [slot for slot in free if slot not in self.running]
        if self.config.mixed_prefill_tokens is not None and self.waiting and free:
            self._admit_waiting(free)
        while (self.waiting and len(free) > (self.chunked is not None) and budget > 0
               and self.config.mixed_prefill_tokens is None):
            used = self._admit(free[:len(free) - (self.chunked is not None)], budget, prefilled)
            free = [slot for slot in free if slot not in self.running]
            budget -= used
            if not used:
                break
        if self.running:
            ended += self._visit(end_on_finish, prefilled)
        if landed is not None:
            ended += self._collect(*landed)
        return ended

    def _visit(self, end_on_finish: bool, prefilled: list) -> list[RequestOutput]:
        """Runs (or with async scheduling dispatches) a visit of the running slots; what it ended."""
        mode = SamplingMode.of([r.request.sampling for r in self.running.values()])
        if not self.mode.covers(mode):
            self.mode = self.mode.union(mode)
        # All-greedy rows run the greedy program; sampled ones the one that covers every mode seen.
        mode = GREEDY if not mode.sampled else self.mode
        rows = self._rows_to_step()
        stop_after_ends = rows + 1
        if self.waiting or end_on_finish:  # as many as wait, when fewer: more ends would leave slots empty
            stop_after_ends = min(self._visit_ends(), len(self.waiting) or 1)
            self.paced_visits += 1
            self.paced_ends += stop_after_ends
        if prefilled:  # the prefills' first tokens now: on a GPU the call below returns only when its loop has
            self._first_tokens(prefilled)  # ended (the host reads the loop's condition), so reading them after it
            # would make the time to first token that of a whole visit
        plan, planned = self._plan()
        max_steps = self.config.steps_per_visit
        if planned and all(r.prefilled is not None for r in self.running.values()):
            max_steps = int(plan.count)  # nothing decodes yet: the visit ends with the prefill (time to first token)
        if self.config.async_scheduling:
            self._dispatch(mode, max_steps, stop_after_ends, rows, plan, planned)
            return []
        wait = time.perf_counter()  # the call itself may block until its loop ends (GPU): device time
        visit, counters = self._run(mode, max_steps, stop_after_ends, rows, plan, self._held(rows))
        visit = jax.device_get(visit)  # one transfer of the visit's summary
        self.device_wait_s += time.perf_counter() - wait
        self._visited = (time.perf_counter() - wait, int(visit.steps))
        self._count(visit, rows, len(self.running), planned)
        return self._collect(visit, dict(self.running), counters)

    def _visit_ends(self) -> int:
        """The rows a visit lets end before it stops for waiting requests (EngineConfig.visit_ends)."""
        if self.config.visit_ends is not None:
            return self.config.visit_ends
        if self.config.async_scheduling:
            return 1
        return self.pacing.ends_to_stop(len(self.running))

    def _admit(self, free: list[int], budget: float, prefilled: list) -> int:
        """Prefills the first waiting requests that fit in `budget` prompt tokens into the free slots; the
        first that does not fit starts a chunked prefill (max_num_batched_tokens). Appends (the prefilled rows,
        their slots) to `prefilled`; returns the prompt tokens prefilled."""
        admitted, used = [], 0
        for request, arrival in self.waiting:
            if len(admitted) == min(len(free), self.config.max_prefill_batch):
                break
            todo = len(request.prompt) - self._cached_tokens(request.prompt)
            if used + todo > budget:
                break
            admitted.append((request, arrival))
            used += todo
        for _ in admitted:
            self.waiting.popleft()
        start = 0
        for piece in prefill_pieces(len(admitted), self.config.prefill_call_rows):
            prefilled.append(self._prefill(admitted[start:start + piece], free[start:start + piece]))
            start += piece
        if self.waiting and self.chunked is None and budget - used > 0 and len(free) > len(admitted) and (
                len(admitted) < self.config.max_prefill_batch):
            request, arrival = self.waiting.popleft()  # too long for what is left of the budget: in chunks
            keys, blocks = self._lookup(request.prompt)
            start = len(blocks) * self.config.block_size
            mode = self._mode_of([request])
            caches = self._empty_caches(mode, 1)
            if self.prefix_cache is not None:
                caches = self.prefix_cache.load(*caches, [blocks])
            self.chunked = _Chunked(request=request, arrival=arrival, start=start, caches=caches, keys=keys,
                                    matched=len(blocks), blocks=blocks)
            # Its last chunk when the blocks its batch mates just stored leave few enough tokens: then a slot.
            used += self._next_chunk(budget - used, free[len(admitted):], prefilled)
        return used

    def _admit_waiting(self, free: list[int]) -> None:
        """Mixed prefill: the first waiting requests into the free slots, their prompts to be prefilled by the
        next steps' chunks (_plan)."""
        admitted = [self.waiting.popleft() for _ in range(min(len(free), len(self.waiting)))]
        self._mode_of([request for request, _ in admitted])  # widens the modes seen; builds the state at first
        slots = padded_slots(free[:len(admitted)], self.config.max_num_seqs)
        arrays = self._row_arrays(admitted, len(slots), self.config.max_model_len)
        self.state = admit_waiting(self.state, slots, *arrays)
        self.prefilled_requests += len(admitted)
        looked = [self._lookup(request.prompt) for request, _ in admitted]
        if self.prefix_cache is not None:  # the matched blocks into the slots' caches; the chunks start after them
            blocks = [held for _, held in looked] + [[]] * (len(slots) - len(admitted))
            cache, _ = self.prefix_cache.load(self.state.cache, None, blocks, slots)
            self.state = dataclasses.replace(self.state, cache=cache)
        for slot, (request, arrival), (keys, blocks) in zip(free, admitted, looked):
            self._start(slot, request, arrival, blocks, len(blocks))
            self.running[slot].prefilled = len(blocks) * self.config.block_size
            self.running[slot].keys = keys

    def _plan(self) -> tuple[ChunkSchedule | None, list]:
        """The visit's prompt chunks (mixed prefill; _mixed.plan_chunks) and what they do; (None, []) without it."""
        config = self.config
        if config.mixed_prefill_tokens is None:
            return None, []
        waiting = sorted(((slot, r) for slot, r in self.running.items() if r.prefilled is not None),
                         key=lambda item: item[1].arrival)
        return plan_chunks(waiting, steps=config.steps_per_visit, chunks=config.mixed_prefill_chunks,
                           width=config.mixed_prefill_tokens, nowhere=config.max_num_seqs,
                           one_per_step=config.spec is not None)

    def _cached_tokens(self, prompt) -> int:
        """Prompt tokens the prefix cache would give this prompt now (0 without one); changes nothing."""
        if self.prefix_cache is None:
            return 0
        keys = block_keys(prompt, self.config.block_size, len(prompt) - 1)
        matched = len(self.prefix_cache.table.match(keys))
        return max(0, matched - self.prefix_cache.drop_tail) * self.config.block_size

    def _lookup(self, prompt) -> tuple[list, list]:
        return ([], []) if self.prefix_cache is None else self.prefix_cache.lookup(prompt)

    def _mode_of(self, requests: list[Request]) -> SamplingMode:
        """The program mode that prefills these requests (and widens what the engine has seen)."""
        mode = SamplingMode.of([request.sampling for request in requests])
        self.mode = self.mode.union(mode)
        mode = GREEDY if not mode.sampled else self.mode
        self._ensure_state(mode)
        return mode

    def _empty_caches(self, mode: SamplingMode, batch: int) -> tuple:
        """Empty cache rows for a prefill from an offset: (the target's, the drafter's or None)."""
        program = self._program(mode)
        return empty_caches(self._weights, program=program, batch=batch)

    def _prompt_width(self, admitted: list[tuple[Request, float]], mode: SamplingMode | None = None,
                      batch: int = 1) -> int:
        """The prompt width a prefill of the requests runs at: their longest prompt's bucket, or with mode and batch
        the narrowest width warmup compiled for them that holds it (padding a prompt costs a little prefill;
        compiling a width while serving stalls every request in flight, seconds at the 8B shape)."""
        width = min(decoding.bucket(max(len(r.prompt) for r, _ in admitted), decoding.MIN_PROMPT_BUCKET),
                    self.config.max_model_len)
        warm = [w for w in self._warm_widths.get((mode, batch), ()) if w >= width]
        return min(warm, default=width)

    def _row_arrays(self, admitted: list[tuple[Request, float]], batch: int, width: int) -> tuple:
        """The initialiser's arrays for the requests, padded to `batch` rows and `width` prompt tokens."""
        tokens = np.zeros((batch, width), np.int32)
        lengths, budgets, seeds = np.ones(batch, np.int32), np.zeros(batch, np.int32), np.zeros(batch, np.uint32)
        for row, (request, _) in enumerate(admitted):
            tokens[row, :len(request.prompt)] = request.prompt
            lengths[row], budgets[row], seeds[row] = len(request.prompt), request.max_tokens, request.seed
        # Host arrays: the jitted initialiser moves them (an eager jnp.asarray or key op each costs a dispatch).
        return tokens, lengths, budgets, seeds, SamplingParams.of([r.sampling for r, _ in admitted], batch)

    def _prefill(self, admitted: list[tuple[Request, float]], slots: list[int]) -> tuple[Any, list[int]]:
        """Prefills the requests (from their prefix cache blocks, where prefix caching is on) into the slots."""
        count = len(admitted)
        self.prefill_calls += 1
        self.prefilled_requests += count
        mode = self._mode_of([request for request, _ in admitted])
        batch = decoding.bucket(count)
        self.prefill_padded_rows += batch - count
        arrays = self._row_arrays(admitted, batch, self._prompt_width(admitted, mode, batch))
        looked = [self._lookup(request.prompt) for request, _ in admitted]
        if self.prefix_cache is None:
            rows = self._init(mode, arrays)
        else:
            starts = [len(blocks) * self.config.block_size for _, blocks in looked]
            todo = max(len(request.prompt) - start for (request, _), start in zip(admitted, starts))
            width = min(decoding.bucket(todo, decoding.MIN_PROMPT_BUCKET), self.config.max_model_len)
            target, draft = self.prefix_cache.load(*self._empty_caches(mode, batch),
                                                   [blocks for _, blocks in looked] + [[]] * (batch - count))
            start = np.asarray(starts + [0] * (batch - count), np.int32)
            rows = self._init(mode, arrays, decoding.Prefix(target=target, draft=draft, start=start, width=width))
        # Padding rows go to an index past the state's rows, which the scatter drops.
        targets = np.full(batch, self.config.max_num_seqs, np.int32)
        targets[:count] = slots
        self._insert(rows, targets.tolist())
        stored = self._store(mode, rows, [(row, keys, len(blocks)) for row, (keys, blocks) in enumerate(looked)])
        for row, (slot, (request, arrival)) in enumerate(zip(slots, admitted)):
            self._start(slot, request, arrival, looked[row][1] + stored[row], len(looked[row][1]))
        return rows, slots

    def _insert(self, rows, slots: list[int]) -> None:
        """Writes prefilled rows into the slots (an index past the state's rows drops that row): into the
        engine's state and, with draft KV offload, the drafter's K and V into the slots' host buffers."""
        self.state = insert_rows(self.state, rows, np.asarray(slots, np.int32), axes=self._axes)
        if self.draft_kv is not None:
            self.draft_kv.store(rows, slots)

    def _store(self, mode: SamplingMode, rows, keys: list) -> list[list[int]]:
        """The prefilled rows' new full blocks into the prefix cache; each row's newly held blocks."""
        if self.prefix_cache is None:
            return [[] for _ in keys]
        proposer = self._program(mode).proposer
        draft = None if proposer is None else proposer.prefix_cache(rows.proposer)
        return self.prefix_cache.store(decode_state(rows).cache, draft, keys)

    def _start(self, slot: int, request: Request, arrival: float, blocks: list, matched: int) -> None:
        self.running[slot] = _Running(request=request, arrival=arrival, stop=frozenset(request.stop_token_ids),
                                      blocks=blocks, num_cached_tokens=matched * self.config.block_size)
        log.debug("admitted %s into slot %d (%d prompt tokens, %d cached, max_tokens %d)", request.request_id, slot,
                  len(request.prompt), matched * self.config.block_size, request.max_tokens)

    def _next_chunk(self, budget: float, free: list[int], prefilled: list) -> int:
        """Prefills the next chunk of the chunked prompt, at most `budget` tokens (a power of two of them where
        more remain, so that chunk programs are few); after its last chunk the request takes the first free
        slot (one is kept for it). Returns the prompt tokens prefilled."""
        chunked = self.chunked
        request = chunked.request
        todo = len(request.prompt) - chunked.start
        if budget < 1 or not free:
            return 0
        last = todo <= budget
        width = (min(decoding.bucket(todo, decoding.MIN_PROMPT_BUCKET), self.config.max_model_len) if last
                 else 1 << (int(budget).bit_length() - 1))
        mode = self._mode_of([request])
        arrays = self._row_arrays([(request, chunked.arrival)], 1, self._prompt_width([(request, chunked.arrival)]))
        prefix = decoding.Prefix(target=chunked.caches[0], draft=chunked.caches[1],
                                 start=np.asarray([chunked.start], np.int32), width=width)
        rows = self._init(mode, arrays, prefix)
        if not last:
            proposer = self._program(mode).proposer
            chunked.caches = (decode_state(rows).cache, None if proposer is None else proposer.prefix_cache(rows.proposer))
            chunked.start += width
            return width
        slot = free[0]
        self._insert(rows, [slot])
        stored = self._store(mode, rows, [(0, chunked.keys, chunked.matched)])
        self._start(slot, request, chunked.arrival, chunked.blocks + stored[0], chunked.matched)
        prefilled.append((rows, [slot]))
        self.chunked = None
        return todo

    def _first_tokens(self, prefilled: list[tuple[Any, list[int]]]) -> None:
        """Streams each admitted request's first token (the prefill's): the time to first token is the
        prefill's, not that of the visit's steps after it."""
        wait = time.perf_counter()  # the prefills' device time: prefill calls return at once
        read = jax.device_get([(decode_state(rows).tokens, decode_state(rows).lengths) for rows, _ in prefilled])
        now = time.perf_counter()
        self.device_wait_s += now - wait
        self.prefill_wait_s += now - wait
        first = {}
        for (tokens, lengths), (_, slots) in zip(read, prefilled):
            count = len(slots)
            for slot, token in zip(slots, tokens[np.arange(count), lengths[:count] - 1].tolist()):
                running = self.running[slot]
                running.first_token_time = now
                running.tokens.append(token)
                running.token_times.append(now)
                running.stopped = token in running.stop
                first[running.request.request_id] = [token]
        if self.on_tokens is not None:
            self.on_tokens(first)

    def _collect(self, visit: Visit, running_at: dict[int, _Running], counters) -> list[RequestOutput]:
        """Reads the new tokens of each request the visit stepped (running_at: slot -> request when it began) from
        its summary; ends requests that are done or hit a stop id. Their slots are released now, or with async
        scheduling at the next step (the state is in the next visit)."""
        now = time.perf_counter()
        if visit.count.size and visit.count.max() > visit.tokens.shape[1]:  # Visit's width bounds a visit
            raise RuntimeError(f"a row emitted {visit.count.max()} tokens in a visit: the summary holds "
                               f"{visit.tokens.shape[1]}")
        counts, done = visit.count.tolist(), visit.done.tolist()
        ending = []  # (slot, running, index of a stop id in its tokens of this visit or None)
        emitted = {}  # request id -> its new tokens
        for slot, running in running_at.items():
            # Ended by the host after this visit was dispatched (async scheduling, aborts), or still prefilling.
            if running.ended or running.prefilled is not None:
                continue
            count, hit = counts[slot], None
            if running.stopped:  # its first token was a stop id: what the device emitted after it is dropped
                hit, count = 0, 0
            new = visit.tokens[slot, :count].tolist() if count else []
            if running.stop and not running.stop.isdisjoint(new):  # a stop id the device does not know
                hit = next(i for i, t in enumerate(new) if t in running.stop)
                new = new[:hit + 1]
            if new:
                if running.first_token_time is None:
                    running.first_token_time = now
                running.tokens += new
                running.token_times += [now] * len(new)
                emitted[running.request.request_id] = new
            if hit is not None or done[slot]:
                ending.append((slot, running, hit))
        if emitted and self.on_tokens is not None:
            self.on_tokens(emitted)
        if not ending:
            return []
        eos = set(self.config.eos_token_ids)
        ended, released = [], []
        where = {id(running): slot for slot, running in self.running.items()}  # slots move between visits (_compact)
        for (slot, running, hit), metrics in zip(ending, self._metrics(counters, [slot for slot, _, _ in ending])):
            request = running.request
            reason = "stop" if hit is not None or (running.tokens and running.tokens[-1] in eos) else "length"
            ended.append(RequestOutput(request_id=request.request_id, tokens=tuple(running.tokens),
                                       finish_reason=reason, metrics=metrics, arrival_time=running.arrival,
                                       first_token_time=running.first_token_time, finish_time=now,
                                       token_times=tuple(running.token_times),
                                       num_cached_tokens=running.num_cached_tokens))
            if self.prefix_cache is not None:
                self.prefix_cache.release(running.blocks)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("finished %s: %d tokens (%s)%s", request.request_id, len(running.tokens), reason,
                          "" if metrics is None else
                          f", mean acceptance length {metrics['mean_acceptance_length']:.2f}")
            running.ended = True
            del self.running[where[id(running)]]
            if not done[slot]:
                released.append(where[id(running)])
        if self.config.async_scheduling:
            self._unreleased += released
        elif released:
            self._release(released)
        return ended

    def _metrics(self, counters, slots: list[int]) -> list[dict | None]:
        """The acceptance counts of the requests in these slots of a visit (None each without speculation), from
        its counters: one read, at visits where requests end."""
        if self.config.spec is None:
            return [None] * len(slots)
        counters = jax.device_get(counters)
        rows = AcceptanceMetrics(**{f.name: np.asarray(getattr(counters, f.name))[slots].astype(np.int64)
                                    for f in dataclasses.fields(counters)})
        return [metrics | rows.per_step(row) for row, metrics in enumerate(rows.per_request())]

    def _abort(self) -> list[RequestOutput]:
        """Ends the aborted requests that are waiting or running (ids of neither are forgotten)."""
        aborted, self.aborted = self.aborted, set()
        now = time.perf_counter()
        ended = [RequestOutput(request_id=request.request_id, tokens=(), finish_reason="abort", arrival_time=arrival,
                               finish_time=now) for request, arrival in self.waiting if request.request_id in aborted]
        self.waiting = collections.deque((r, t) for r, t in self.waiting if r.request_id not in aborted)
        if self.chunked is not None and self.chunked.request.request_id in aborted:
            chunked, self.chunked = self.chunked, None
            ended.append(RequestOutput(request_id=chunked.request.request_id, tokens=(), finish_reason="abort",
                                       arrival_time=chunked.arrival, finish_time=now))
            if self.prefix_cache is not None:
                self.prefix_cache.release(chunked.blocks)
        slots = [slot for slot, running in self.running.items() if running.request.request_id in aborted]
        for slot in slots:
            running = self.running.pop(slot)
            running.ended = True
            ended.append(RequestOutput(request_id=running.request.request_id, tokens=tuple(running.tokens),
                                       finish_reason="abort", arrival_time=running.arrival,
                                       first_token_time=running.first_token_time, finish_time=now,
                                       token_times=tuple(running.token_times),
                                       num_cached_tokens=running.num_cached_tokens))
            if self.prefix_cache is not None:
                self.prefix_cache.release(running.blocks)
            log.info("aborted %s in slot %d after %d tokens", running.request.request_id, slot, len(running.tokens))
        if slots:
            self._release(slots)
        return ended

    def _compact(self) -> None:
        """Moves the busy slots' rows into the free slots below them, so that the busy slots come first and a
        visit steps only a bucket of them; a slot a row left is marked done."""
        busy = sorted(self.running)
        holes = [slot for slot in range(len(busy)) if slot not in self.running]
        sources = [slot for slot in reversed(busy) if slot >= len(busy)][:len(holes)]
        if not holes:
            return
        self.state = move_rows(self.state, padded_slots(sources, 0), padded_slots(holes, self.config.max_num_seqs),
                               axes=self._axes)
        if self.draft_kv is not None:
            self.draft_kv.move(sources, holes)
        for source, hole in zip(sources, holes):
            self.running[hole] = self.running.pop(source)
        self._release(sources)

    def _release(self, slots: list[int]) -> None:
        """Marks slots done on the device (their requests ended on the host)."""
        decode = decode_state(self.state)
        done = release_slots(decode.done, padded_slots(slots, self.config.max_num_seqs))
        decode = dataclasses.replace(decode, done=done)
        self.state = decode if self.config.spec is None else dataclasses.replace(self.state, decode=decode)
