"""The device programs an engine runs between its host visits, each jitted once per static description (Program)
and shape: a prefill of admitted rows (init_rows), a visit's steps of the busy slots (run_steps), mixed prefill's
admission of waiting prompts (admit_waiting) and empty cache rows for a prefill from an offset (empty_caches); what
the host reads after a visit (Visit); how an admission splits into prefill calls (prefill_pieces)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax import adaptive, decoding
from specjax.config import DTYPES
from specjax.decoding import NO_BATCH
from specjax.engine._mixed import ChunkSchedule
from specjax.engine._offload import DraftKVLayout
from specjax.proposers import Proposer
from specjax.verify import Verifier
from specjax.verify.sampling import SamplingMode, SamplingParams


@functools.partial(jax.tree_util.register_dataclass, data_fields=("steps", "tokens", "count", "done", "chosen"),
                   meta_fields=())
@dataclasses.dataclass(frozen=True)
class Visit:
    """What the host reads after a visit, for the slots it stepped: one small transfer, not the whole state."""

    steps: jax.Array  # steps the visit ran
    tokens: jax.Array  # [rows, W]: each row's tokens of this visit first (W bounds what a visit can emit)
    count: jax.Array  # [rows]: tokens each row emitted in this visit
    done: jax.Array  # [rows]
    chosen: jax.Array  # adaptive verification: the width index the last step chose (or would have); else -1

    @classmethod
    def of(cls, steps, state, before: jax.Array, width: int) -> Visit:
        """The summary of rows that had generated `before` tokens when the visit began."""
        decode = decode_state(state)
        counts = getattr(state, "adaptive", None)
        chosen = jnp.int32(-1) if counts is None else jnp.max(counts.chosen)  # one choice a step; -1: none stepped
        size = decode.tokens.shape[1]
        width = min(width, size)
        first = decode.lengths - decode.num_generated + before  # where each row's tokens of this visit begin
        index = jnp.minimum(first[:, None] + jnp.arange(width)[None, :], size - 1)
        return cls(steps=steps, tokens=jnp.take_along_axis(decode.tokens, index, axis=1),
                   count=decode.num_generated - before, done=decode.done, chosen=chosen)


@dataclasses.dataclass(frozen=True)
class Program:
    """What the engine's prefill and step compute, all static and hashable: the jitted functions below take it as
    a static argument and the weights and the state as traced ones, so that engines of equal settings (a second
    test's, a server restarted in one process) share one compiled program per mode and shape."""

    proposer: Proposer | None  # None: autoregressive decoding
    mode: SamplingMode  # what the rows' sampling settings need of the program
    eos_token_ids: tuple[int, ...]
    cache_size: int  # EngineConfig.max_model_len
    cache_dtype: str | None  # the target's cache dtype (EngineConfig.kv_cache_dtype)
    verifiers: tuple[Verifier, ...] | None  # the lossless rules a step switches among; None without speculation
    prefill_chunk: int | None = None  # EngineConfig.mixed_prefill_tokens
    # With mixed prefill and speculation: the batch axes of the proposer state's leaves and of its per-position cache's
    # (decoding.ChunkPlan's).
    proposer_axes: tuple[int, ...] | None = None
    cache_axes: tuple[int, ...] | None = None
    # With adaptive verification: the index in spec.verify_widths of the width every step verifies, with no switch;
    # the visit ends at a step whose choice would have been another unless it runs whole (run_steps' whole;
    # decoding.speculative_step's hold; the engine's "held visits"). None: the switch chooses.
    hold: int | None = None

    def init(self, weights: tuple, tokens, lengths, budgets, seeds, sampling, prefix=None):
        """The loop state of rows prefilled from their prompts (from prefix's caches where given)."""
        model, draft_params = weights
        if self.proposer is None:
            offset = {} if prefix is None else dict(cache=prefix.target, start=prefix.start, width=prefix.width)
            return decoding.prefill(model, tokens, lengths, budgets, seed_keys(seeds), sampling, mode=self.mode,
                                    eos_token_ids=self.eos_token_ids, cache_size=self.cache_size,
                                    cache_dtype=self.cache_dtype, **offset)[0]
        return decoding.speculative_init(model, draft_params, tokens, lengths, budgets, seed_keys(seeds), sampling,
                                         proposer=self.proposer, eos_token_ids=self.eos_token_ids,
                                         cache_dtype=self.cache_dtype, prefix=prefix)

    def step(self, weights: tuple, state, method, costs, chunks: decoding.ChunkPlan | None = None):
        """One step of every row of the state (a done row is left as it is), prefilling `chunks` (mixed prefill)."""
        model, draft_params = weights
        if self.proposer is None:
            return decoding.decode_step(model, state, mode=self.mode, eos_token_ids=self.eos_token_ids, chunks=chunks)
        return decoding.speculative_step(model, draft_params, state, method, proposer=self.proposer,
                                         verifiers=self.verifiers, eos_token_ids=self.eos_token_ids,
                                         verify_costs=costs, chunks=chunks, hold=self.hold)


@functools.partial(jax.jit, static_argnames="program")
def init_rows(weights, tokens, lengths, budgets, seeds, sampling, prefix=None, *, program: Program):
    """program.init, compiled per program, batch and prompt width (and prefix width)."""
    return program.init(weights, tokens, lengths, budgets, seeds, sampling, prefix)


def prefill_pieces(count: int, call_rows: float) -> list[int]:
    """How `count` admitted requests split into prefill calls, each padded to a power of two rows: the split (a
    power of two, then the rest split alike) with the fewest padded rows plus call_rows a call. Each piece is a
    count warm-up compiled (power-of-two counts up to the admission's own bucket)."""
    best = {0: (0.0, [])}
    for n in range(1, count + 1):
        whole = (decoding.bucket(n) + call_rows, [n])
        top = 1 << (n.bit_length() - 1)  # the largest power of two up to n, then the rest
        rest = best[n - top]
        best[n] = whole if top == n or whole[0] <= top + call_rows + rest[0] else (
            top + call_rows + rest[0], [top, *rest[1]])
    return best[count][1]


@functools.partial(jax.jit, static_argnames=("program", "rows", "width", "axes", "layout"), donate_argnums=1)
def run_steps(weights, state, draft, method, max_steps, stop_after_ends, costs, plan: ChunkSchedule | None = None,
              whole=False, *, program: Program, rows: int, width: int, axes: tuple[int, ...],
              layout: DraftKVLayout | None):
    """Steps the first `rows` slots (the busy ones are kept first) until max_steps, every row done, or
    stop_after_ends of them ended in this visit (a slot to fill); the other slots are left as they are. With draft KV
    offload (layout), draft holds those slots' host buffers: in for the steps, back out after them. method: the
    lossless rule of sampled rows; costs: adaptive verification's cost of a step of `rows` slots at each verify
    width (None without it); plan: the prompt chunks its first steps prefill (mixed prefill; None without); axes:
    the state leaves' batch axes (NO_BATCH for the offloaded ones); whole: a held visit (program.hold) runs to its
    end though the choice moves (adaptive_held_whole_visits; data, so that held visits either way share a program).
    Returns the visit's summary of those slots, `width` tokens a row (what the host reads), the state, the draft
    buffers, and the acceptance counters after the visit (a copy, which the host reads when requests end: the state
    itself may be in the next visit by then; None without speculation)."""
    def cond(carry, limit, prefilling: bool = False):
        steps, state = carry
        done = decode_state(state).done
        busy = True if prefilling else ~jnp.all(done)  # rows being prefilled are done rows
        if program.hold is not None:  # a moved choice hands the visit back to the host, unless it runs whole
            busy = busy & (whole | adaptive.holds(state.adaptive, program.hold))
        return (steps < limit) & busy & (jnp.sum(done & ~done_before) < stop_after_ends)

    def step(carry, chunks: bool = False):
        steps, state = carry
        plans = plan.at(steps, program.prefill_chunk, program.proposer_axes, program.cache_axes) if chunks else None
        return steps + 1, program.step(weights, state, method, costs, plans)

    leaves, treedef = jax.tree.flatten(state)
    busy = [x if a == NO_BATCH else jax.lax.slice_in_dim(x, 0, rows, axis=a) for x, a in zip(leaves, axes)]
    if layout is not None:
        busy = layout.unpack(layout.to_device(draft), busy)
    busy = jax.tree.unflatten(treedef, busy)
    before, done_before = decode_state(busy).num_generated, decode_state(busy).done
    carry = (jnp.int32(0), busy)
    if plan is not None:  # the steps that prefill come first, in a loop of their own (a lax.cond would copy the caches)
        carry = jax.lax.while_loop(lambda c: cond(c, jnp.minimum(max_steps, plan.count), prefilling=True),
                                   lambda c: step(c, chunks=True), carry)
    steps, busy = jax.lax.while_loop(lambda c: cond(c, max_steps), step, carry)
    visit = Visit.of(steps, busy, before, width)
    counters = None if isinstance(busy, decoding.DecodeState) else jax.tree.map(jnp.copy, busy.counters)
    busy = jax.tree.leaves(busy)
    draft = None if layout is None else layout.to_host(layout.pack(busy))
    leaves = [x if a == NO_BATCH else jax.lax.dynamic_update_slice_in_dim(x, part, 0, axis=a)
              for x, part, a in zip(leaves, busy, axes)]
    return visit, jax.tree.unflatten(treedef, leaves), draft, counters


@functools.partial(jax.jit, donate_argnums=0)
def admit_waiting(state, slots, tokens, lengths, budgets, seeds, sampling):
    """decoding.admit_prompts into the engine's state (donated: written in place): rows waiting for mixed prefill;
    with speculation their acceptance counters and adaptive counts zero (the drafter's state is the chunks' to
    build)."""
    decode = decoding.admit_prompts(decode_state(state), slots, tokens, lengths, budgets, seed_keys(seeds), sampling)
    if isinstance(state, decoding.DecodeState):
        return decode
    zero = lambda x: x.at[slots].set(jnp.zeros((), x.dtype), mode="drop")  # noqa: E731 (batch-first fields)
    fresh = None if state.adaptive is None else adaptive.AdaptiveState.init(1, state.adaptive.passed.shape[1])
    return dataclasses.replace(state, decode=decode, counters=jax.tree.map(zero, state.counters),
                               adaptive=jax.tree.map(lambda x, new: x.at[slots].set(new[0], mode="drop"),
                                                     state.adaptive, fresh))


@functools.partial(jax.jit, static_argnames=("program", "batch"))
def empty_caches(weights, *, program: Program, batch: int) -> tuple:
    """Empty cache rows for a prefill from an offset: (the target's, the drafter's or None)."""
    model, draft_params = weights
    draft = None if program.proposer is None else program.proposer.new_cache(draft_params, batch)
    dtype = program.cache_dtype and DTYPES[program.cache_dtype]
    return model.create_cache(batch, program.cache_size, dtype), draft


def free_rows(batch: int, width: int) -> tuple:
    """The initialiser's arguments for `batch` rows of zero budget (done at once: free slots), prompts of width."""
    return (np.zeros((batch, width), np.int32), np.ones((batch,), np.int32), np.zeros((batch,), np.int32),
            np.zeros((batch,), np.uint32), SamplingParams.of([], batch))


def seed_keys(seeds: jax.Array) -> jax.Array:
    """Each row's key from its request's seed (inside the compiled initialiser)."""
    return jax.vmap(jax.random.key)(seeds)


def decode_state(state) -> decoding.DecodeState:
    """The DecodeState of either loop's state."""
    return state if isinstance(state, decoding.DecodeState) else state.decode
