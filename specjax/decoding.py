"""Generation: prefill, then one `lax.while_loop` that never leaves the device.

`generate` is the host-side entry point: it validates the request, pads the batch and the prompt
length to buckets (so a new prompt length in the same bucket reuses the compiled program), and runs
`decode_loop`, which is one jitted function: ragged prefill of every prompt in one forward, then a
while loop that emits a token per active row per step until every row has hit EOS or its budget.

Row b samples its i-th new token with `fold_in(key(seed_b), i)`, so a row's output depends on its
seed, prompt and sampling settings only, never on what else is in the batch. Sampling settings are
per-row data (specjax.verify.sampling), and so is the choice of lossless verifier: one compiled loop
serves a drafter's whole grid of them. The loops are made of `prefill` / `decode_step` and
`speculative_init` / `speculative_step`, which the serving engine (specjax.engine) runs too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from specjax.config import DTYPES, SamplingConfig, SpecConfig, dtype_from_name
from specjax.metrics import AcceptanceCounters, AcceptanceMetrics
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Hidden, PromptChunks, Transformer
from specjax.proposers import Context, Proposer, TargetOutput, build_proposer
from specjax import adaptive, benchmarking, sharding
from specjax.trees import masks, sizing, structure
from specjax.sharding import BATCH, constrain
from specjax.verify import SYNTHETIC, Verifier, lossless_verifiers, method_index, verify_drafts
from specjax.verify.sampling import GREEDY, SamplingMode, SamplingParams, sample

MIN_PROMPT_BUCKET = 16
CACHE_ALIGNMENT = 64
FINE_BATCH_FROM = 4096  # batch_bucket's


def bucket(n: int, minimum: int = 1) -> int:
    """The next power of two >= max(n, minimum): padded sizes that bound the number of compilations."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def batch_bucket(n: int) -> int:
    """A request's padded batch: bucket(n) up to FINE_BATCH_FROM rows, then the next multiple of a sixteenth of
    bucket(n) (at most 8 sizes an octave, under 1/8 of padding): a batch just past a power of two, such as the
    losslessness tests' 65,600 rows, would otherwise compute nearly twice the rows it has."""
    whole = bucket(n)
    if n <= FINE_BATCH_FROM:
        return whole
    step = whole // 16
    return -(-n // step) * step


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("tokens", "lengths", "num_generated", "done", "cache", "budgets", "streams", "sampling"),
                   meta_fields=())
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Every row's decoding state; each field has the batch on its first axis (the cache: KVCache's)."""

    tokens: Int[Array, "B S"]  # prompt followed by the generated tokens
    lengths: Int[Array, " B"]  # tokens in `tokens`; the last one is not yet in the cache
    num_generated: Int[Array, " B"]
    done: Bool[Array, " B"]  # hit EOS or its budget (padding rows and free engine slots are done)
    cache: KVCache
    budgets: Int[Array, " B"]  # new tokens the row may emit
    # The row's two key streams [B, 2], split from its seed key once at prefill (split_streams): draws of
    # tokens from the target alone ([:, 0], by the token's number) and of speculative steps ([:, 1]).
    streams: PRNGKeyArray
    sampling: SamplingParams  # the row's temperature, top-k, top-p


def commit(state: DecodeState, block: Int[Array, "B W"], num_candidates: Int[Array, " B"],
           eos_token_ids: tuple[int, ...]) -> tuple[DecodeState, Int[Array, " B"]]:
    """Appends the first num_candidates[b] tokens of block to each active row, cut after the first
    EOS and at the row's budget; marks rows that hit either as done. Returns the tokens kept."""
    active = ~state.done
    width = block.shape[1]
    index = jnp.arange(width)[None, :]
    candidate = index < num_candidates[:, None]
    is_eos = jnp.isin(block, jnp.asarray(eos_token_ids, jnp.int32)) if eos_token_ids else jnp.zeros_like(candidate)
    eos_at = jnp.argmax(is_eos & candidate, axis=1)  # first EOS (0 if none, then masked below)
    has_eos = jnp.any(is_eos & candidate, axis=1)
    room = state.budgets - state.num_generated
    kept = jnp.minimum(jnp.minimum(num_candidates, room), jnp.where(has_eos, eos_at + 1, width))
    kept = jnp.where(active, kept, 0)
    # Tokens not kept are written out of bounds, which a scatter drops.
    slots = jnp.where(index < kept[:, None], state.lengths[:, None] + index, state.tokens.shape[1])
    tokens = state.tokens.at[jnp.arange(block.shape[0])[:, None], slots].set(block)
    num_generated = state.num_generated + kept
    stopped_at_eos = has_eos & (eos_at < kept)
    done = state.done | (active & (stopped_at_eos | (num_generated >= state.budgets)))
    return dataclasses.replace(state, tokens=tokens, lengths=state.lengths + kept,
                               num_generated=num_generated, done=done), kept


def split_streams(keys: PRNGKeyArray) -> tuple[PRNGKeyArray, PRNGKeyArray]:
    """Two independent key streams per row: one for tokens sampled from the target alone (indexed by
    the token's number), one for speculative steps (indexed by the row's step number)."""
    streams = jax.vmap(jax.random.split)(keys)
    return streams[:, 0], streams[:, 1]


def token_keys(state: DecodeState) -> PRNGKeyArray:
    """The keys that draw each row's next token from the target alone."""
    return jax.vmap(jax.random.fold_in)(state.streams[:, 0], state.num_generated)


def prefill(model: Transformer, prompt_tokens: Int[Array, "B T"], prompt_lengths: Int[Array, " B"],
            budgets: Int[Array, " B"], keys: PRNGKeyArray, sampling: SamplingParams, *, mode: SamplingMode,
            eos_token_ids: tuple[int, ...], cache_size: int, cache_dtype: str | None,
            hidden_layers: tuple[int, ...] = (), cache: KVCache | None = None, start: Int[Array, " B"] | None = None,
            width: int | None = None) -> tuple[DecodeState, TargetOutput]:
    """Runs every (right-padded) prompt through the model in one call and emits the first new token of
    each row, drawn with fold_in(its token stream, 0) in both loops. Budgets may be 0 (padding rows).

    From an offset (prefix caching, chunked prefill): `cache` already holds row b's first start[b] positions
    and the call runs the `width` tokens from there (default: the rest of the padded prompt); the returned
    hidden states are the window's, index i at position start[b] + i. The first token is drawn only where the
    window reaches the prompt's end (an earlier chunk's draw is not used)."""
    batch, prompt_len = prompt_tokens.shape
    rows = jnp.arange(batch)
    if cache is None:
        cache = model.create_cache(batch, cache_size, cache_dtype and DTYPES[cache_dtype])
    start = jnp.zeros_like(prompt_lengths) if start is None else start
    width = prompt_len if width is None else width
    positions = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    # Window slots past the padded prompt read its last column: past every row's prompt, never used.
    window = jnp.take_along_axis(prompt_tokens, jnp.minimum(positions, prompt_len - 1), axis=1)
    _, hidden, cache = model(window, positions, cache.with_lengths(start), hidden_layers=hidden_layers,
                             compute_logits=False)
    logits = model.unembed(hidden.final[rows, jnp.clip(prompt_lengths - 1 - start, 0, width - 1)])
    tokens = constrain(jnp.zeros((batch, cache_size), jnp.int32), BATCH).at[:, :prompt_len].set(prompt_tokens)
    state = DecodeState(tokens=tokens, lengths=prompt_lengths, num_generated=jnp.zeros_like(budgets),
                        done=budgets <= 0, cache=cache.with_lengths(prompt_lengths), budgets=budgets,
                        streams=jnp.stack(split_streams(keys), axis=1),
                        sampling=sampling)
    first = sample(logits, token_keys(state), sampling, mode)
    state, _ = commit(state, first[:, None], jnp.ones_like(budgets), eos_token_ids)
    return state, TargetOutput(logits=None, hidden=hidden)


def decode_step(model: Transformer, state: DecodeState, *, mode: SamplingMode, eos_token_ids: tuple[int, ...],
                chunks: ChunkPlan | None = None) -> DecodeState:
    """One autoregressive token for every active row; with `chunks`, prompt chunks of rows waiting for their
    prefill (admit_prompts) run in the same forward (mixed prefill), and a row whose prompt they finish gets its
    first token, drawn as `prefill` draws it, and decodes from the next step."""
    rows = jnp.arange(state.tokens.shape[0])
    last = state.tokens[rows, state.lengths - 1]
    if chunks is None:
        logits, _, cache = model(last[:, None], (state.lengths - 1)[:, None], state.cache)
    else:
        prompt_chunks = chunks.of(state.tokens)
        logits, _, cache, chunk_hidden = model.mixed(last[:, None], (state.lengths - 1)[:, None], state.cache,
                                                     prompt_chunks)
    cache = cache.with_lengths(jnp.where(state.done, state.cache.lengths, cache.lengths))
    token = sample(logits[:, 0], token_keys(state), state.sampling, mode)
    state, _ = commit(dataclasses.replace(state, cache=cache), token[:, None], jnp.ones_like(state.budgets),
                      eos_token_ids)
    if chunks is not None:
        state = _prompts_prefilled(model, state, prompt_chunks, chunk_hidden.final, mode, eos_token_ids)
    return state


NO_BATCH = -1  # a state leaf without a batch axis (ChunkPlan's axes, the engine's slot functions)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("rows", "starts"),
                   meta_fields=("width", "proposer_axes", "cache_axes"))
@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """The prompt chunks of one mixed-prefill step: chunk r is row rows[r]'s prompt from position starts[r],
    `width` tokens (a row past the batch: no chunk). With speculation, the batch axis of each leaf of the proposer's
    state and of its per-position cache (Proposer.prefix_cache), NO_BATCH where none: the chunks' rows are taken out
    of them and put back. A speculative step takes one chunk of a row at most (each extends the row's cache as the
    step began)."""

    rows: Int[Array, " R"]
    starts: Int[Array, " R"]
    width: int
    proposer_axes: tuple[int, ...] | None = None
    cache_axes: tuple[int, ...] | None = None

    def of(self, tokens: Int[Array, "B S"]) -> PromptChunks:
        """The chunks' tokens, read from the rows' token buffers (past the buffer: its last column, unused)."""
        positions = self.starts[:, None] + jnp.arange(self.width, dtype=jnp.int32)[None, :]
        rows = jnp.minimum(self.rows, tokens.shape[0] - 1)
        chunk_tokens = tokens[rows[:, None], jnp.minimum(positions, tokens.shape[1] - 1)]
        return PromptChunks(tokens=chunk_tokens, rows=self.rows, starts=self.starts)


def _prompts_prefilled(model: Transformer, state: DecodeState, chunks: PromptChunks, final: Float[Array, "R C D"],
                       mode: SamplingMode, eos_token_ids: tuple[int, ...]) -> DecodeState:
    """The chunks' rows after them: a row whose prompt ended in its chunk active with its first token (fold_in(its
    token stream, 0), as `prefill` draws it). Its cache's fill level is already its prompt's length (admit_prompts)."""
    batch, width = state.tokens.shape[0], chunks.tokens.shape[1]
    rows = jnp.minimum(chunks.rows, batch - 1)
    prompt_len = state.lengths[rows]  # a waiting row's tokens are its prompt
    ends = (chunks.rows < batch) & (chunks.starts + width >= prompt_len)
    hidden = final[jnp.arange(rows.shape[0]), jnp.clip(prompt_len - 1 - chunks.starts, 0, width - 1)]
    sampling = jax.tree.map(lambda x: x if x.ndim == 0 else x[rows], state.sampling)
    first = sample(model.unembed(hidden), token_keys(state)[rows], sampling, mode)
    started = jnp.where(ends, chunks.rows, batch)  # past the batch: dropped
    done = state.done.at[started].set(state.budgets[rows] <= 0, mode="drop")
    block = jnp.zeros((batch, 1), jnp.int32).at[started, 0].set(first, mode="drop")
    count = jnp.zeros((batch,), jnp.int32).at[started].set(1, mode="drop")
    return commit(dataclasses.replace(state, done=done), block, count, eos_token_ids)[0]


def take_rows(tree, rows: Int[Array, " R"], axes: tuple[int, ...]):
    """tree's entries of `rows` along each leaf's batch axis (rows past the batch read its last; NO_BATCH leaves as
    they are)."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [x if a == NO_BATCH else jnp.take(x, rows, axis=a, mode="clip")
                                        for x, a in zip(leaves, axes)])


def put_rows(tree, part, rows: Int[Array, " R"], axes: tuple[int, ...]):
    """tree with part's entries written at `rows` along each leaf's batch axis (a row past the batch: dropped)."""
    leaves, treedef = jax.tree.flatten(tree)

    def put(full, new, axis):
        if axis == NO_BATCH:
            return full
        new = new if new.dtype == full.dtype else new.astype(full.dtype)
        return full.at[(slice(None),) * axis + (rows,)].set(new, mode="drop")

    return jax.tree.unflatten(treedef, [put(x, y, a) for x, y, a in zip(leaves, jax.tree.leaves(part), axes)])


def _drafter_prefilled(proposer: Proposer, draft_params: Any, proposer_state, decode: DecodeState,
                       chunks: PromptChunks, hidden: Hidden, plan: ChunkPlan, prompt_len: Int[Array, " R"]):
    """The proposer's state with the chunks' rows extended by their chunks (Proposer.extend from the rows' caches,
    as a chunked prefill's calls extend them): a row whose prompt ended has the whole state `speculative_init` would
    give it; an earlier chunk's row, its cache filled over the chunk (the rest of its state is rebuilt by the next)."""
    rows = jnp.minimum(chunks.rows, decode.tokens.shape[0] - 1)
    cache = proposer.prefix_cache(proposer_state)
    cache = None if cache is None else take_rows(cache, rows, plan.cache_axes)
    target_out = TargetOutput(logits=None, hidden=hidden)
    # The proposer sees the prompt followed by its first token (an earlier chunk's row: a token it does not use).
    extended = proposer.extend(draft_params, cache, decode.tokens[rows], prompt_len + 1, chunks.starts, target_out)
    return put_rows(proposer_state, extended, chunks.rows, plan.proposer_axes)


def admit_prompts(state: DecodeState, slots: Int[Array, " N"], prompt_tokens: Int[Array, "N T"],
                  prompt_lengths: Int[Array, " N"], budgets: Int[Array, " N"], keys: PRNGKeyArray,
                  sampling: SamplingParams) -> DecodeState:
    """state with rows waiting for their prompts' prefill in `slots` (a slot past the batch: dropped): each row's
    prompt, budget, key streams and sampling settings, done until decode_step's chunks have prefilled its prompt
    (mixed prefill; the engine's). Its cache's fill level is the prompt's length from the start: the steps before
    then write their (unused) entry for the row there, past every chunk's prompt slots; the chunks' attention masks
    by position, not by fill level."""
    def put(full, part):
        return full.at[slots].set(part if part.dtype == full.dtype else part.astype(full.dtype), mode="drop")

    width = prompt_tokens.shape[1]
    tokens = state.tokens.at[slots, :width].set(prompt_tokens, mode="drop")
    sampling = jax.tree.map(put, state.sampling, sampling)
    return dataclasses.replace(
        state, tokens=tokens, lengths=put(state.lengths, prompt_lengths),
        num_generated=put(state.num_generated, jnp.zeros_like(budgets)),
        done=put(state.done, jnp.ones_like(slots, bool)),
        cache=state.cache.with_lengths(put(state.cache.lengths, prompt_lengths)),
        budgets=put(state.budgets, budgets), streams=put(state.streams, jnp.stack(split_streams(keys), axis=1)),
        sampling=sampling)


@functools.partial(jax.jit, static_argnames=("mode", "eos_token_ids", "cache_size", "cache_dtype"))
def decode_loop(
    model: Transformer,
    prompt_tokens: Int[Array, "B T"],
    prompt_lengths: Int[Array, " B"],
    budgets: Int[Array, " B"],
    keys: PRNGKeyArray,
    sampling: SamplingParams,
    *,
    mode: SamplingMode,
    eos_token_ids: tuple[int, ...],
    cache_size: int,
    cache_dtype: str | None = None,
) -> DecodeState:
    """Autoregressive prefill and decode as one program: rows of any sampling settings that `mode` covers."""
    state, _ = prefill(model, prompt_tokens, prompt_lengths, budgets, keys, sampling, mode=mode,
                       eos_token_ids=eos_token_ids, cache_size=cache_size, cache_dtype=cache_dtype)
    step = functools.partial(decode_step, model, mode=mode, eos_token_ids=eos_token_ids)
    return jax.lax.while_loop(lambda state: ~jnp.all(state.done), step, state)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("decode", "proposer", "counters", "adaptive"),
                   meta_fields=())
@dataclasses.dataclass(frozen=True)
class SpecState:
    decode: DecodeState
    proposer: Any  # the proposer's own state pytree
    counters: AcceptanceCounters
    # Per-position acceptance estimates of adaptive verification (SpecConfig.enable_adaptive_verification); None
    # without it.
    adaptive: adaptive.AdaptiveState | None = None


def speculative_init(model: Transformer, draft_params: Any, prompt_tokens: Int[Array, "B T"],
                     prompt_lengths: Int[Array, " B"], budgets: Int[Array, " B"], keys: PRNGKeyArray,
                     sampling: SamplingParams, *, proposer: Proposer, eos_token_ids: tuple[int, ...],
                     cache_dtype: str | None = None, prefix: Prefix | None = None) -> SpecState:
    """The target's prefill, its first token, and the proposer's state for it; with a prefix, the prefill
    continues from caches that already hold each row's first prefix.start[b] positions (Proposer.extend)."""
    offset = {} if prefix is None else dict(cache=prefix.target, start=prefix.start, width=prefix.width)
    decode, target_out = prefill(model, prompt_tokens, prompt_lengths, budgets, keys, sampling,
                                 mode=proposer.settings.sampling, eos_token_ids=eos_token_ids,
                                 cache_size=proposer.settings.cache_size, cache_dtype=cache_dtype,
                                 hidden_layers=proposer.hidden_layers, **offset)
    # The proposer sees each prompt followed by the prefill's token: tokens[b, :lengths[b]].
    committed = decode.tokens[:, :prompt_tokens.shape[1] + 1]
    if prefix is None:
        state = proposer.init(draft_params, committed, decode.lengths, target_out)
    else:
        state = proposer.extend(draft_params, prefix.draft, committed, decode.lengths, prefix.start, target_out)
    spec, batch = proposer.settings.spec, prompt_tokens.shape[0]
    return SpecState(decode=decode, proposer=state,
                     counters=AcceptanceCounters.zeros(batch, spec.num_speculative_tokens,
                                                       max_steps=proposer.settings.cache_size),
                     adaptive=(adaptive.AdaptiveState.init(batch, spec.num_speculative_tokens)
                               if spec.enable_adaptive_verification else None))


@functools.partial(jax.tree_util.register_dataclass, data_fields=("target", "draft", "start"), meta_fields=("width",))
@dataclasses.dataclass(frozen=True)
class Prefix:
    """Caches that already hold each row's first start[b] positions (a prefix cache's blocks, or a long
    prompt's earlier chunks), and how many positions the next prefill call runs (static)."""

    target: KVCache
    draft: KVCache | None  # the proposer's (Proposer.new_cache); None for one that keeps none
    start: Int[Array, " B"]
    width: int


def speculative_step(model: Transformer, draft_params: Any, state: SpecState, method: Int[Array, ""], *,
                     proposer: Proposer, verifiers: tuple[Verifier, ...], eos_token_ids: tuple[int, ...],
                     gather_logits: bool = False, verify_costs: Float[Array, " W"] | None = None,
                     chunks: ChunkPlan | None = None, hold: int | None = None) -> SpecState:
    """One speculative step of every active row: propose K drafts, score the last committed token and
    the drafts in one target forward over K + 1 positions, verify (rule verifiers[method] for sampled
    rows), commit the accepted drafts plus one target token, and roll both caches back by their lengths.

    With adaptive verification (state.adaptive) the forward scores the first W + 1 positions only, W the
    width of spec.verify_widths chosen from the state's estimates and verify_costs (a step's cost at each
    width; default the analytic curve), and every active row verifies its first W drafts (specjax.adaptive); at
    width 0 a drafter that can skip drafting (Proposer.skips_drafting) drafts nothing and no verifier runs: the
    row's token is drawn from the target's distribution as decode_step draws it. Where W is chosen before
    drafting (no confidence head read), each width's branch of the switch drafts as well: one conditional a step.

    hold (adaptive verification): the index in spec.verify_widths of the width every active row verifies, with no
    switch; the width is chosen all the same, only to be kept in state.adaptive.chosen (the engine's held visits,
    speculative_loop's widest runs). Held at width 0, a drafter that can skip drafting drafts nothing.

    With `chunks`, prompt chunks of rows waiting for their prefill (admit_prompts) run in the verify forward (mixed
    prefill, as decode_step's): the drafter's state of each chunk's row is extended by it, and a row whose prompt it
    ends gets its first token and speculates from the next step."""
    spec, num_draft = proposer.settings.spec, proposer.settings.spec.num_speculative_tokens
    decode, active = state.decode, ~state.decode.done
    batch = decode.tokens.shape[0]
    rows = jnp.arange(batch)
    step_keys = jax.vmap(jax.random.fold_in)(decode.streams[:, 1], state.counters.steps)
    draft_keys, verify_keys = split_streams(step_keys)
    widths = spec.verify_widths
    if state.adaptive is not None and verify_costs is None:
        verify_costs = jnp.asarray(adaptive.CostCurve.analytic((batch,), widths, skips_drafting=proposer.skips_drafting)
                                   .costs(batch, widths))
    skip, counted, first, held_idle = False, None, False, False
    if state.adaptive is not None:  # the width the counts choose, before drafting (adaptive's docstring)
        counted = adaptive.choose_width(adaptive.conditional_acceptance(spec, state.adaptive, None, active), active,
                                        widths, verify_costs)
        # The step's width unless a confidence head is read after drafting. Then drafting moves into the verify
        # switch's branches: one conditional a step (each costs a device-to-host read of its index), and a drafter
        # that drafts_to_width drafts the branch's width only.
        first = not adaptive.reads_confidence(spec, proposer.draft_confidence(state.proposer))
    context = Context(tokens=decode.tokens, lengths=decode.lengths, sampling=decode.sampling)

    def drafted(width: int | None = None):
        return proposer.propose(draft_params, state.proposer, dataclasses.replace(context, verified=width), draft_keys)

    def idle():
        tokens, probs, _ = jax.eval_shape(drafted)
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), (tokens, probs))
        return (*zeros, proposer.idle(draft_params, state.proposer, context))

    def drafts_at(width: int):  # the drafts of a step that verifies `width`: none at 0 where the drafter can skip
        return idle() if width == 0 and proposer.skips_drafting else drafted(width)
    if first:
        draft_tokens = draft_probs = proposer_state = row_parents = None  # drafted in the switch's branches
    else:
        can_skip = state.adaptive is not None and widths[0] == 0 and proposer.skips_drafting
        held_idle = can_skip and hold == 0
        if held_idle:  # draft nothing; the width it would choose is the counts' (no confidence read)
            draft_tokens, draft_probs, proposer_state = idle()
        elif can_skip and hold is None:
            skip = counted == 0  # draft nothing
            draft_tokens, draft_probs, proposer_state = jax.lax.cond(skip, idle, drafted)
        else:
            draft_tokens, draft_probs, proposer_state = drafted()
        row_parents = proposer.tree_parents(proposer_state, batch)

    last = decode.tokens[rows, decode.lengths - 1]
    fill = decode.cache.lengths  # the block's first slot: the last committed token is not cached yet
    if row_parents is None:
        positions, mask = fill[:, None] + jnp.arange(num_draft + 1, dtype=jnp.int32)[None, :], None
    else:  # each node sees the cache, the root and its ancestors, at position fill + depth
        positions = masks.block_positions(row_parents, fill)
        mask = masks.tree_mask(row_parents)
    synthetic_rates = spec.synthetic_rates if spec.rejection_sample_method == SYNTHETIC else None
    verify = functools.partial(verify_drafts, keys=verify_keys, sampling=decode.sampling,
                               mode=proposer.settings.sampling, verifiers=verifiers, method=method)

    prompt_chunks = None if chunks is None else chunks.of(decode.tokens)

    def scored(width, draft_tokens, draft_probs, num_valid=None, attention_mask=None):
        """The forward over the block's first width + 1 positions (and the prompt chunks), and its drafts verified:
        (path, accepted, next token, the forward's logits and hidden states, the cache, the chunks' hidden states)."""
        block = jnp.concatenate([last[:, None], draft_tokens], axis=1)  # [B, K + 1], or [B, N + 1] for a tree
        chunk_hidden = None
        if prompt_chunks is None:
            logits, hidden, cache = model(block[:, :width + 1], positions[:, :width + 1], decode.cache,
                                          hidden_layers=proposer.hidden_layers, attention_mask=attention_mask)
        else:
            logits, hidden, cache, chunk_hidden = model.mixed(
                block[:, :width + 1], positions[:, :width + 1], decode.cache, prompt_chunks,
                hidden_layers=proposer.hidden_layers, attention_mask=attention_mask)
        if gather_logits:  # on a mesh: whole vocabulary rows on every model shard (one all-gather)
            logits = constrain(logits, BATCH)
        if width == 0:  # adaptive's width 0 verifies nothing: the target's token drawn as decode_step draws it
            token = sample(logits[:, 0], verify_keys, decode.sampling, proposer.settings.sampling)
            return None, jnp.zeros_like(token), token, logits, hidden, cache, chunk_hidden
        rates = None if synthetic_rates is None else synthetic_rates[:width]
        verified = verify(logits, draft_tokens[:, :width], None if draft_probs is None else draft_probs[:, :width],
                          parents=row_parents, synthetic_rates=rates, num_valid=num_valid)
        return *verified, logits, hidden, cache, chunk_hidden

    num_valid = chosen = None
    if state.adaptive is None:
        path, num_accepted, next_token, logits, hidden, cache, chunk_hidden = scored(
            draft_tokens.shape[1], draft_tokens, draft_probs, attention_mask=mask)
    else:  # chains only (SpecConfig refuses trees)
        choice = counted  # chosen again only where the drafter's confidence is read, now that it has drafted
        if not first and not held_idle:
            confidence = proposer.draft_confidence(proposer_state)
            conditional = adaptive.conditional_acceptance(spec, state.adaptive, confidence, active)
            choice = jnp.where(skip, 0, adaptive.choose_width(conditional, active, widths, verify_costs))
        chosen = jnp.where(active, choice, -1)
        if hold is not None:
            choice = hold
        num_valid = jnp.where(active, jnp.asarray(widths, jnp.int32)[choice], 0)

        def at_width(width):  # verified in the branch: the verifier's work, as the forward's, scales with the width
            drafts = drafts_at(width) if first else (draft_tokens, draft_probs, proposer_state)
            _, accepted, token, _, hidden, cache, chunk_hidden = scored(width, *drafts[:2], num_valid)
            # The drafter takes the committed positions here too, where their window (width + 1) is static.
            taken = proposer.accept_verified(draft_params, drafts[2], accepted, token,
                                             TargetOutput(logits=None, hidden=hidden, path=None), context)
            out = accepted, token, cache, chunk_hidden, taken
            return (*out, drafts[0]) if first else out  # the drafts leave the branch only if made there

        branches = [functools.partial(at_width, width) for width in widths]
        if hold is not None:
            out = branches[hold]()
        else:
            out = jax.lax.switch(choice, branches) if len(branches) > 1 else branches[-1]()
        num_accepted, next_token, cache, chunk_hidden, proposer_state = out[:5]
        if first:
            draft_tokens = out[5]
        path = None
    if path is not None:  # the accepted path into contiguous slots; from here on it reads as a chain
        path = path[:, :num_draft]  # a path is at most the tree's depth (K) long
        cache = masks.move_path(cache, fill, path, num_accepted)
        draft_tokens = jnp.take_along_axis(draft_tokens, jnp.maximum(path, 0), axis=1)
        logits, hidden = structure.along_path((logits, hidden), path)

    # The target cache keeps the last committed token and the accepted drafts: rollback is lengths.
    cache = cache.with_lengths(jnp.where(active, decode.lengths + num_accepted, decode.cache.lengths))
    emitted = jnp.concatenate([draft_tokens, jnp.zeros_like(last)[:, None]], axis=1)
    emitted = emitted.at[rows, num_accepted].set(next_token)
    decode, kept = commit(dataclasses.replace(decode, cache=cache), emitted, num_accepted + 1, eos_token_ids)
    if state.adaptive is None:  # else accepted in the switch's branch
        proposer_state = proposer.accept(proposer_state, num_accepted, next_token,
                                         TargetOutput(logits=logits, hidden=hidden, path=path))
    if chunks is not None:
        prompt_len = decode.lengths[jnp.minimum(chunks.rows, batch - 1)]  # a waiting row's tokens are its prompt
        decode = _prompts_prefilled(model, decode, prompt_chunks, chunk_hidden.final, proposer.settings.sampling,
                                    eos_token_ids)
        proposer_state = _drafter_prefilled(proposer, draft_params, proposer_state, decode, prompt_chunks, chunk_hidden,
                                            chunks, prompt_len)
    return SpecState(decode=decode, proposer=proposer_state,
                     counters=state.counters.update(active, num_accepted, kept, num_valid),
                     adaptive=None if state.adaptive is None else dataclasses.replace(
                         state.adaptive.observe(active, num_valid, num_accepted), chosen=chosen))


@functools.partial(jax.jit, static_argnames=("proposer", "verifiers", "eos_token_ids", "cache_dtype", "gather_logits",
                                             "widest_runs"))
def speculative_loop(
    model: Transformer,
    draft_params: Any,
    prompt_tokens: Int[Array, "B T"],
    prompt_lengths: Int[Array, " B"],
    budgets: Int[Array, " B"],
    keys: PRNGKeyArray,
    sampling: SamplingParams,
    method: Int[Array, ""] | int = 0,
    verify_costs: Float[Array, " W"] | None = None,
    *,
    proposer: Proposer,
    verifiers: tuple[Verifier, ...] | None = None,
    eos_token_ids: tuple[int, ...],
    cache_dtype: str | None = None,
    gather_logits: bool = False,
    widest_runs: bool = False,
) -> SpecState:
    """Speculative prefill and decode as one program (speculative_init, then speculative_step until
    every row is done). draft_params: the drafter's weights as proposer.bind made them (the protocol's
    `params`); sampling: per-row settings that proposer.settings.sampling covers; method: the index in
    `verifiers` (default: specjax.verify.lossless_verifiers of the proposer's spec) of the rule for sampled
    rows (specjax.verify.method_index); verify_costs: with adaptive verification, a step's cost at each of
    spec.verify_widths (specjax.adaptive.verify_costs; default the analytic curve).

    widest_runs (adaptive verification; off by default, one while_loop): after a step whose choice was K, steps held
    at K (speculative_step's hold) run in a loop of their own inside the loop's body, until one whose choice would
    have been narrower; then a step with the switch again. The engine's held visits at K, in one program. Off
    because in `generate` the switch costs little and the nested loop more (docs/performance.md, twenty-fourth
    session). Lossless: which step runs depends on past steps only."""
    verifiers = verifiers if verifiers is not None else lossless_verifiers(proposer.settings.spec)
    state = speculative_init(model, draft_params, prompt_tokens, prompt_lengths, budgets, keys, sampling,
                             proposer=proposer, eos_token_ids=eos_token_ids, cache_dtype=cache_dtype)
    step = functools.partial(speculative_step, model, draft_params, method=method, proposer=proposer,
                             verifiers=verifiers, eos_token_ids=eos_token_ids, gather_logits=gather_logits,
                             verify_costs=verify_costs)

    def running(state: SpecState):
        return ~jnp.all(state.decode.done)
    if state.adaptive is None or not widest_runs or len(proposer.settings.spec.verify_widths) == 1:
        return jax.lax.while_loop(running, step, state)

    widest = len(proposer.settings.spec.verify_widths) - 1

    def switched_then_widest(state: SpecState) -> SpecState:
        return jax.lax.while_loop(lambda state: running(state) & adaptive.holds(state.adaptive, widest),
                                  functools.partial(step, hold=widest), step(state))

    return jax.lax.while_loop(running, switched_then_widest, state)


def static_spec(spec: SpecConfig, mode: SamplingMode) -> SpecConfig:
    """spec with what the loop takes as data normalised away, so that one program serves every value of it:
    the lossless rule (an argument of the loop) and, for all-greedy rows, the block implementation."""
    if spec.rejection_sample_method != SYNTHETIC:
        spec = dataclasses.replace(spec, rejection_sample_method="standard")
    if not mode.sampled:
        spec = dataclasses.replace(spec, verify_impl="auto")
    return spec


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    tokens: np.ndarray  # [B, max_new_tokens] generated ids; past num_generated[b] they are 0
    num_generated: np.ndarray  # [B]
    stopped_by_eos: np.ndarray  # [B] bool
    metrics: AcceptanceMetrics | None = None  # speculative decoding only
    tree_size_choice: sizing.TreeSizeChoice | None = None  # what total_tokens 'auto' chose, and why

    def sequences(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.tokens, self.num_generated)]


@dataclasses.dataclass(frozen=True)
class PaddedBatch:
    """A request padded to bucket sizes, ready for `decode_loop`."""

    tokens: np.ndarray  # [B_pad, T_pad]
    lengths: np.ndarray  # [B_pad]
    budgets: np.ndarray  # [B_pad]; 0 for padding rows
    seeds: np.ndarray  # [B_pad]
    cache_size: int
    batch_size: int  # real rows


def pad_request(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                seeds: int | Sequence[int] = 0, cache_size: int | None = None, lookahead: int = 0,
                batch_multiple: int = 1) -> PaddedBatch:
    """Validates a request and pads it to buckets; every problem is a ValueError naming the row.

    lookahead: cache slots needed past prompt + budget (K + 1 for speculative decoding, whose last
    verify may write K + 1 entries past the last committed token). batch_multiple: the padded batch
    is a multiple of it (the data axis of a mesh)."""
    config = model.config
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt (a list of token ids)")
    batch = len(prompts)
    budgets = np.broadcast_to(np.asarray(max_new_tokens, np.int64), (batch,))
    seeds = np.broadcast_to(np.asarray(seeds, np.int64), (batch,))
    for row, (prompt, budget) in enumerate(zip(prompts, budgets)):
        if len(prompt) == 0:
            raise ValueError(f"prompt {row} is empty: each prompt needs at least one token")
        bad = [t for t in prompt if not 0 <= int(t) < config.vocab_size]
        if bad:
            raise ValueError(f"prompt {row} has token id {bad[0]}: allowed 0..{config.vocab_size - 1}")
        if budget < 0:
            raise ValueError(f"max_new_tokens for row {row} is {budget}: allowed >= 0")
    lengths = np.array([len(p) for p in prompts])
    totals = lengths + budgets
    # Past its positions a model computes silently wrong (learned: clamped lookups; RoPE: angles it never saw).
    if totals.max() > config.max_position_embeddings:
        row = int(totals.argmax())
        kind = "learned positions" if config.position == "learned" else "positions (RoPE)"
        raise ValueError(f"row {row}: prompt ({lengths[row]} tokens) + max_new_tokens ({budgets[row]}) = "
                         f"{totals[row]} exceeds max_position_embeddings ({config.max_position_embeddings}) "
                         f"of this model's {kind}: allowed at most {config.max_position_embeddings} in all")
    prompt_bucket = bucket(int(lengths.max()), MIN_PROMPT_BUCKET)
    if cache_size is None:
        needed = prompt_bucket + int(budgets.max()) + lookahead
        cache_size = -(-needed // CACHE_ALIGNMENT) * CACHE_ALIGNMENT
    elif totals.max() + lookahead > cache_size:
        row = int(totals.argmax())
        extra = f" + drafts scored per step + 1 ({lookahead})" if lookahead else ""
        raise ValueError(f"row {row}: prompt ({lengths[row]} tokens) + max_new_tokens ({budgets[row]}){extra} = "
                         f"{totals[row] + lookahead} does not fit cache_size {cache_size}: allowed at most "
                         f"{cache_size}")
    # A prompt bucket larger than the cache would prefill out of bounds: pad only as far as it fits.
    prompt_bucket = min(prompt_bucket, cache_size)
    padded_batch = -(-batch_bucket(batch) // batch_multiple) * batch_multiple
    tokens = np.zeros((padded_batch, prompt_bucket), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = prompt
    pad = padded_batch - batch
    return PaddedBatch(tokens=tokens,
                       lengths=np.concatenate([lengths, np.ones(pad, np.int64)]).astype(np.int32),
                       budgets=np.concatenate([budgets, np.zeros(pad, np.int64)]).astype(np.int32),
                       seeds=np.concatenate([seeds, np.zeros(pad, np.int64)]).astype(np.uint32),
                       cache_size=cache_size, batch_size=batch)


def loop_arrays(request: PaddedBatch, sampling: SamplingConfig | Sequence[SamplingConfig] = SamplingConfig()
                ) -> tuple[tuple, SamplingMode]:
    """The loops' array arguments (tokens, lengths, budgets, keys, sampling params) for a padded request
    whose rows all sample with one SamplingConfig or each with its own, and the mode that covers them."""
    configs = [sampling] * request.batch_size if isinstance(sampling, SamplingConfig) else list(sampling)
    if len(configs) != request.batch_size:
        raise ValueError(f"sampling has {len(configs)} settings for {request.batch_size} prompts: allowed one "
                         "SamplingConfig, or one per prompt")
    args = (jnp.asarray(request.tokens), jnp.asarray(request.lengths), jnp.asarray(request.budgets),
            jax.vmap(jax.random.key)(jnp.asarray(request.seeds)),
            jax.tree.map(jnp.asarray, SamplingParams.of(configs, len(request.lengths))))
    return args, SamplingMode.of(configs)


def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    sampling: SamplingConfig | Sequence[SamplingConfig] = SamplingConfig(),
    eos_token_ids: Sequence[int] = (),
    seeds: int | Sequence[int] = 0,
    cache_size: int | None = None,
    cache_dtype: str | None = None,
    spec: SpecConfig | None = None,
    drafter: Any = None,
    mesh: Mesh | None = None,
    gather_logits: bool = False,
    cost_curve: adaptive.CostCurve | None = None,
) -> GenerationResult:
    """Generation for a batch of ragged prompts (lists of token ids): autoregressive, or speculative
    when `spec` is given (`drafter` is then the proposer's weights, e.g. the draft Transformer).

    max_new_tokens, sampling and seeds are one value or one per prompt (rows of different sampling
    settings run in one program). A row stops after its budget or at the first EOS (which is kept in
    its output). cache_size defaults to what the padded request needs.
    mesh (specjax.sharding.make_mesh) runs the same program over several devices: weights split by
    specjax.sharding's rules (placed once: pass models already `sharding.shard`ed to skip the check),
    rows over the data axis. The verifier then works on vocabulary-split logits, or, with
    gather_logits, on logits gathered once per step.
    Models in the stacked layout run correctly but, on GPUs, slower: pass `transformer.to_decoding_layout`
    of them (`experiments.load_models` does) to decode at speed.
    cost_curve: with spec.enable_adaptive_verification, a step's cost by batch and verify width
    (specjax.adaptive.CostCurve); default: specjax.adaptive.default_cost_curve (profiled once and cached on
    an accelerator, analytic on the CPU).
    """
    if cache_dtype is not None:
        dtype_from_name(cache_dtype, "cache_dtype")
    eos_token_ids = tuple(int(t) for t in eos_token_ids)
    lookahead = 0 if spec is None else spec.num_draft_nodes + 1
    request = pad_request(model, prompts, max_new_tokens, seeds, cache_size, lookahead,
                          batch_multiple=1 if mesh is None else mesh.shape[sharding.DATA])
    args, mode = loop_arrays(request, sampling)
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        if mesh is not None:
            model, args = sharding.shard(model, mesh), sharding.put(args, mesh)
        if spec is None:
            state = decode_loop(model, *args, mode=mode, eos_token_ids=eos_token_ids,
                                cache_size=request.cache_size, cache_dtype=cache_dtype)
            return _result(state, request, eos_token_ids)
        run = functools.partial(run_speculative, model, drafter, args, cache_size=request.cache_size,
                                mode=mode, mesh=mesh, eos_token_ids=eos_token_ids, cache_dtype=cache_dtype,
                                gather_logits=gather_logits, cost_curve=cost_curve)
        choice = None
        if spec.total_tokens == "auto":
            choice = sizing.choose_tree_size(run, model, spec, request.batch_size)
            spec = dataclasses.replace(spec, total_tokens=choice.total_tokens)
        state, _ = run(spec)
    metrics = AcceptanceMetrics.from_counters(state.counters, request.batch_size)
    return dataclasses.replace(_result(state.decode, request, eos_token_ids), metrics=metrics, tree_size_choice=choice)


def run_speculative(model: Transformer, drafter: Any, args: tuple, spec: SpecConfig, *, cache_size: int,
                    mode: SamplingMode = GREEDY, mesh: Mesh | None = None, eos_token_ids: tuple[int, ...] = (),
                    cache_dtype: str | None = None, gather_logits: bool = False,
                    max_new_tokens: int | None = None,
                    cost_curve: adaptive.CostCurve | None = None) -> tuple[SpecState, Proposer]:
    """(the speculative loop's final SpecState, its proposer) for a padded request's device arrays
    args = (tokens, lengths, budgets, keys, sampling params), each row's budget capped at max_new_tokens
    when given; mode covers the rows' sampling settings; the model (and args) already placed on the mesh
    when one is given; cost_curve as generate's. generate's speculative path."""
    proposer = build_proposer(static_spec(spec, mode), mode, cache_size, drafter)
    proposer.check(drafter, model.config)
    draft_params = proposer.bind(drafter, model)
    if mesh is not None:
        draft_params = sharding.shard(draft_params, mesh)
    tokens, lengths, budgets, keys, sampling = args
    if max_new_tokens is not None:
        budgets = jnp.minimum(budgets, max_new_tokens)
    costs = None
    if spec.enable_adaptive_verification:
        batch = tokens.shape[0]
        curve = cost_curve or adaptive.default_cost_curve(model, batch, spec.verify_widths, cache_size,
                                                          step_timing(model, draft_params, proposer))
        costs = adaptive.verify_costs(spec, curve, batch)
    state = speculative_loop(model, draft_params, tokens, lengths, budgets, keys, sampling,
                             jnp.int32(method_index(spec)), costs, proposer=proposer, verifiers=lossless_verifiers(spec),
                             eos_token_ids=eos_token_ids, cache_dtype=cache_dtype, gather_logits=gather_logits)
    return state, proposer


def step_timing(model: Transformer, draft_params: Any, proposer: Proposer) -> adaptive.StepTiming:
    """The speculative loop's side of adaptive verification's cost profile: keyed by the proposer's spec and its
    weights' shapes, timed by step_seconds."""
    shapes = [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(draft_params)]
    return adaptive.StepTiming(key=repr((proposer.settings.spec, shapes)),
                               seconds=functools.partial(step_seconds, model, draft_params, proposer),
                               skips_drafting=proposer.skips_drafting)


PROFILE_INVARIANT = 6  # step_profile_loop's arguments before the carried state: the same every step


def step_seconds(model: Transformer, draft_params: Any, proposer: Proposer, batch: int,
                 costs: Sequence[np.ndarray]) -> list[float]:
    """Device seconds of one speculative_step at `batch` greedy rows under each cost vector (the width it forces:
    adaptive.forced_costs): the loop of step_profile_loop, one program for every vector, timed by
    benchmarking.time_in_loop."""
    step, program, arguments = step_profile_loop(model, draft_params, proposer, batch)
    return [benchmarking.time_in_loop(step, *arguments(forced), invariant=PROFILE_INVARIANT, carry=True,
                                      program=program, iterations=adaptive.PROFILE_ITERATIONS,
                                      samples=adaptive.PROFILE_SAMPLES, warmup=1)["median_s"] for forced in costs]


def step_profile_loop(model: Transformer, draft_params: Any, proposer: Proposer,
                      batch: int) -> tuple[Callable, Callable, Callable[[np.ndarray], tuple]]:
    """What step_seconds times: (the step, its jitted loop (benchmarking.loop_program: program(count, *arguments)),
    arguments(costs)). The loop carries the state, as the decode loop does (its caches written in place), from
    caches filled to half the proposer's cache size (or less, to leave a block's room), and sets the state's integer
    leaves (lengths, tokens, counters, done) back before each step, so that every step starts where the first did
    and no row ends."""
    spec = proposer.settings.spec
    cache_size, block = proposer.settings.cache_size, spec.num_speculative_tokens + 1
    prompt_len = min(cache_size // 2, cache_size - 2 * block)
    if prompt_len < 1:
        raise ValueError(f"cache_size {cache_size} is too small to profile a step of K + 1 = {block} positions: "
                         f"allowed at least {2 * block + 1}")
    tokens = jnp.arange(batch * prompt_len, dtype=jnp.int32).reshape(batch, prompt_len) % model.config.vocab_size
    sampling = jax.tree.map(jnp.asarray, SamplingParams.of([SamplingConfig()] * batch, batch))
    init = jax.jit(functools.partial(speculative_init, proposer=proposer, eos_token_ids=()))
    # A budget past one step's tokens: no row ends inside the step, which always starts from this state.
    state = init(model, draft_params, tokens, jnp.full((batch,), prompt_len, jnp.int32),
                 jnp.full((batch,), block + 1, jnp.int32), jax.vmap(jax.random.key)(jnp.arange(batch)), sampling)
    is_int = [not jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in jax.tree.leaves(state)]
    start = tuple(leaf for leaf, integer in zip(jax.tree.leaves(state), is_int) if integer)
    step = functools.partial(_profiled_step, proposer=proposer, verifiers=lossless_verifiers(spec),
                             is_int=tuple(is_int))
    method = jnp.int32(method_index(spec))
    return (step, benchmarking.loop_program(step, invariant=PROFILE_INVARIANT, carry=True),
            lambda costs: (model, draft_params, method, jnp.asarray(costs), start, jnp.bool_(False), state))


def _profiled_step(model, draft_params, method, costs, start, keep, state, *, proposer, verifiers, is_int):
    """step_profile_loop's step: one from `state` with its integer leaves set back to `start` (unless `keep`, which
    is False); (the rows' lengths as its output, the state carried)."""
    leaves, treedef = jax.tree.flatten(state)
    given = iter(start)
    # A traced `keep` the compiler cannot fold: set back unconditionally, the last step's integer leaves would be
    # dead, and XLA would drop the work that made them (token writes, counters), which the loop's step does.
    state = treedef.unflatten([jnp.where(keep, leaf, next(given)) if integer else leaf
                               for leaf, integer in zip(leaves, is_int)])
    state = speculative_step(model, draft_params, state, method, proposer=proposer, verifiers=verifiers,
                             eos_token_ids=(), verify_costs=costs)
    return state.decode.lengths, (state,)


def _result(state: DecodeState, request: PaddedBatch, eos_token_ids: tuple[int, ...]) -> GenerationResult:
    tokens, num_generated = sharding.to_host((state.tokens, state.num_generated))
    rows = request.batch_size
    width = int(request.budgets[:rows].max())
    out = np.zeros((rows, width), np.int32)
    stopped = np.zeros(rows, bool)
    for row in range(rows):
        n, start = int(num_generated[row]), int(request.lengths[row])
        out[row, :n] = tokens[row, start:start + n]
        stopped[row] = n > 0 and int(out[row, n - 1]) in eos_token_ids
    return GenerationResult(tokens=out, num_generated=num_generated[:rows].astype(np.int64),
                            stopped_by_eos=stopped)
