"""Generation: prefill, then one `lax.while_loop` that never leaves the device.

`generate` is the host-side entry point: it validates the request, pads the batch and the prompt
length to buckets (so a new prompt length in the same bucket reuses the compiled program), and runs
`decode_loop`, which is one jitted function: ragged prefill of every prompt in one forward, then a
while loop that emits a token per active row per step until every row has hit EOS or its budget.

Row b samples its i-th new token with `fold_in(key(seed_b), i)`, so a row's output depends on its
seed and prompt only, never on what else is in the batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Int, PRNGKeyArray

from specjax.config import DTYPES, SamplingConfig, SpecConfig, dtype_from_name
from specjax.metrics import AcceptanceCounters, AcceptanceMetrics
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Transformer
from specjax.proposers import Context, Proposer, TargetOutput, build_proposer
from specjax import draft_tree, sharding, tree_size
from specjax.sharding import BATCH, constrain
from specjax.verify import tree_verifier_for, verifier_for, verifier_name
from specjax.verify.sampling import processed_probs, sample

MIN_PROMPT_BUCKET = 16
CACHE_ALIGNMENT = 64


def bucket(n: int, minimum: int = 1) -> int:
    """The next power of two >= max(n, minimum): padded sizes that bound the number of compilations."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("tokens", "lengths", "num_generated", "done", "cache"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class DecodeState:
    tokens: Int[Array, "B S"]  # prompt followed by the generated tokens
    lengths: Int[Array, " B"]  # tokens in `tokens`; the last one is not yet in the cache
    num_generated: Int[Array, " B"]
    done: Bool[Array, " B"]
    cache: KVCache


def _commit(state: DecodeState, block: Int[Array, "B W"], num_candidates: Int[Array, " B"],
            budgets: Int[Array, " B"], eos_token_ids: tuple[int, ...]) -> tuple[DecodeState, Int[Array, " B"]]:
    """Appends the first num_candidates[b] tokens of block to each active row, cut after the first
    EOS and at the row's budget; marks rows that hit either as done. Returns the tokens kept."""
    active = ~state.done
    width = block.shape[1]
    index = jnp.arange(width)[None, :]
    candidate = index < num_candidates[:, None]
    is_eos = jnp.isin(block, jnp.asarray(eos_token_ids, jnp.int32)) if eos_token_ids else jnp.zeros_like(candidate)
    eos_at = jnp.argmax(is_eos & candidate, axis=1)  # first EOS (0 if none, then masked below)
    has_eos = jnp.any(is_eos & candidate, axis=1)
    room = budgets - state.num_generated
    kept = jnp.minimum(jnp.minimum(num_candidates, room), jnp.where(has_eos, eos_at + 1, width))
    kept = jnp.where(active, kept, 0)
    # Tokens not kept are written out of bounds, which a scatter drops.
    slots = jnp.where(index < kept[:, None], state.lengths[:, None] + index, state.tokens.shape[1])
    tokens = state.tokens.at[jnp.arange(block.shape[0])[:, None], slots].set(block)
    num_generated = state.num_generated + kept
    stopped_at_eos = has_eos & (eos_at < kept)
    done = state.done | (active & (stopped_at_eos | (num_generated >= budgets)))
    return dataclasses.replace(state, tokens=tokens, lengths=state.lengths + kept,
                               num_generated=num_generated, done=done), kept


def _prefill(model: Transformer, prompt_tokens, prompt_lengths, budgets, token_keys, *, sampling, eos_token_ids,
             cache_size, cache_dtype, hidden_layers=()) -> tuple[DecodeState, TargetOutput]:
    """Runs every prompt through the model in one call and emits the first new token of each row,
    drawn with fold_in(token_keys[b], 0) in both loops."""
    batch, prompt_len = prompt_tokens.shape
    rows = jnp.arange(batch)
    cache = model.create_cache(batch, cache_size, cache_dtype and DTYPES[cache_dtype])
    positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
    _, hidden, cache = model(prompt_tokens, positions, cache, hidden_layers=hidden_layers, compute_logits=False)
    logits = model.unembed(hidden.final[rows, prompt_lengths - 1])
    tokens = constrain(jnp.zeros((batch, cache_size), jnp.int32), BATCH).at[:, :prompt_len].set(prompt_tokens)
    state = DecodeState(tokens=tokens, lengths=prompt_lengths, num_generated=jnp.zeros_like(budgets),
                        done=budgets <= 0, cache=cache.with_lengths(prompt_lengths))
    first = sample(logits, jax.vmap(jax.random.fold_in)(token_keys, state.num_generated), sampling)
    state, _ = _commit(state, first[:, None], jnp.ones_like(budgets), budgets, eos_token_ids)
    return state, TargetOutput(logits=None, hidden=hidden)


def _split_streams(keys: PRNGKeyArray) -> tuple[PRNGKeyArray, PRNGKeyArray]:
    """Two independent key streams per row: one for tokens sampled from the target alone (indexed by
    the token's number), one for speculative steps (indexed by the step's number)."""
    streams = jax.vmap(jax.random.split)(keys)
    return streams[:, 0], streams[:, 1]


@functools.partial(jax.jit, static_argnames=("sampling", "eos_token_ids", "cache_size", "cache_dtype"))
def decode_loop(
    model: Transformer,
    prompt_tokens: Int[Array, "B T"],
    prompt_lengths: Int[Array, " B"],
    budgets: Int[Array, " B"],
    keys: PRNGKeyArray,
    *,
    sampling: SamplingConfig,
    eos_token_ids: tuple[int, ...],
    cache_size: int,
    cache_dtype: str | None = None,
) -> DecodeState:
    """Autoregressive prefill and decode as one program. Prompts are right-padded; budgets may be 0
    (padding rows)."""
    token_keys, _ = _split_streams(keys)
    state, _ = _prefill(model, prompt_tokens, prompt_lengths, budgets, token_keys, sampling=sampling,
                        eos_token_ids=eos_token_ids, cache_size=cache_size, cache_dtype=cache_dtype)
    rows = jnp.arange(prompt_tokens.shape[0])

    def step(state: DecodeState) -> DecodeState:
        last = state.tokens[rows, state.lengths - 1]
        logits, _, cache = model(last[:, None], (state.lengths - 1)[:, None], state.cache)
        cache = cache.with_lengths(jnp.where(state.done, state.cache.lengths, cache.lengths))
        step_keys = jax.vmap(jax.random.fold_in)(token_keys, state.num_generated)
        token = sample(logits[:, 0], step_keys, sampling)
        state, _ = _commit(dataclasses.replace(state, cache=cache), token[:, None], jnp.ones_like(budgets),
                           budgets, eos_token_ids)
        return state

    return jax.lax.while_loop(lambda state: ~jnp.all(state.done), step, state)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("decode", "proposer", "counters"),
                   meta_fields=())
@dataclasses.dataclass(frozen=True)
class SpecState:
    decode: DecodeState
    proposer: Any  # the proposer's own state pytree
    counters: AcceptanceCounters


@functools.partial(jax.jit, static_argnames=("proposer", "eos_token_ids", "cache_dtype", "gather_logits"))
def speculative_loop(
    model: Transformer,
    draft_params: Any,
    prompt_tokens: Int[Array, "B T"],
    prompt_lengths: Int[Array, " B"],
    budgets: Int[Array, " B"],
    keys: PRNGKeyArray,
    *,
    proposer: Proposer,
    eos_token_ids: tuple[int, ...],
    cache_dtype: str | None = None,
    gather_logits: bool = False,
) -> SpecState:
    """Speculative prefill and decode as one program: each step proposes K drafts, scores the last
    committed token and the drafts in one target forward over K + 1 positions, verifies, commits
    the accepted drafts plus one target token, and rolls both caches back by their lengths.
    draft_params: the drafter's weights as proposer.bind made them (the protocol's `params`)."""
    settings = proposer.settings
    sampling, num_draft = settings.sampling, settings.spec.num_speculative_tokens
    verifier = verifier_for(settings.spec, sampling)
    # A draft tree's verifier (specjax.draft_tree); None for a chain.
    tree_verifier = tree_verifier_for(settings.spec, sampling) if settings.spec.drafts_tree else None
    scores_are_logits = verifier_name(settings.spec, sampling) == "greedy"
    token_keys, step_keys = _split_streams(keys)
    decode, target_out = _prefill(model, prompt_tokens, prompt_lengths, budgets, token_keys, sampling=sampling,
                                  eos_token_ids=eos_token_ids, cache_size=settings.cache_size,
                                  cache_dtype=cache_dtype, hidden_layers=proposer.hidden_layers)
    batch = prompt_tokens.shape[0]
    rows = jnp.arange(batch)
    # The proposer sees each prompt followed by the prefill's token: tokens[b, :lengths[b]].
    committed = decode.tokens[:, :prompt_tokens.shape[1] + 1]
    state = SpecState(decode=decode, proposer=proposer.init(draft_params, committed, decode.lengths, target_out),
                      counters=AcceptanceCounters.zeros(batch, num_draft))

    def step(state: SpecState) -> SpecState:
        decode, active = state.decode, ~state.decode.done
        keys = jax.vmap(jax.random.fold_in)(step_keys, state.counters.steps)
        draft_keys, verify_keys = _split_streams(keys)
        context = Context(tokens=decode.tokens, lengths=decode.lengths)
        draft_tokens, draft_probs, proposer_state = proposer.propose(draft_params, state.proposer, context, draft_keys)

        last = decode.tokens[rows, decode.lengths - 1]
        block = jnp.concatenate([last[:, None], draft_tokens], axis=1)  # [B, K + 1], or [B, N + 1] for a tree
        fill = decode.cache.lengths  # the block's first slot: the last committed token is not cached yet
        row_parents = proposer.tree_parents(proposer_state, batch)
        if row_parents is None:
            positions, mask = fill[:, None] + jnp.arange(num_draft + 1, dtype=jnp.int32)[None, :], None
        else:  # each node sees the cache, the root and its ancestors, at position fill + depth
            positions = draft_tree.block_positions(row_parents, fill)
            mask = draft_tree.tree_mask(row_parents)
        logits, hidden, cache = model(block, positions, decode.cache, hidden_layers=proposer.hidden_layers,
                                      attention_mask=mask)
        if gather_logits:  # on a mesh: whole vocabulary rows on every model shard (one all-gather)
            logits = constrain(logits, BATCH)
        scores = logits if scores_are_logits else processed_probs(logits, sampling)
        if row_parents is None:
            num_accepted, next_token = verifier(scores, draft_tokens, draft_probs, verify_keys)
        else:  # the accepted path into contiguous slots; from here on it reads as a chain
            path, num_accepted, next_token = tree_verifier(scores, draft_tokens, row_parents, draft_probs, verify_keys)
            path = path[:, :num_draft]  # a path is at most the tree's depth (K) long
            cache = draft_tree.move_path(cache, fill, path, num_accepted)
            draft_tokens = jnp.take_along_axis(draft_tokens, jnp.maximum(path, 0), axis=1)
            logits, hidden = draft_tree.along_path((logits, hidden), path)

        # The target cache keeps the last committed token and the accepted drafts: rollback is lengths.
        cache = cache.with_lengths(jnp.where(active, decode.lengths + num_accepted, decode.cache.lengths))
        emitted = jnp.concatenate([draft_tokens, jnp.zeros_like(last)[:, None]], axis=1)
        emitted = emitted.at[rows, num_accepted].set(next_token)
        decode, kept = _commit(dataclasses.replace(decode, cache=cache), emitted, num_accepted + 1, budgets,
                               eos_token_ids)
        target_out = TargetOutput(logits=logits, hidden=hidden, path=None if row_parents is None else path)
        return SpecState(decode=decode,
                         proposer=proposer.accept(proposer_state, num_accepted, next_token, target_out),
                         counters=state.counters.update(active, num_accepted, kept))

    return jax.lax.while_loop(lambda state: ~jnp.all(state.decode.done), step, state)


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    tokens: np.ndarray  # [B, max_new_tokens] generated ids; past num_generated[b] they are 0
    num_generated: np.ndarray  # [B]
    stopped_by_eos: np.ndarray  # [B] bool
    metrics: AcceptanceMetrics | None = None  # speculative decoding only
    tree_size_choice: tree_size.TreeSizeChoice | None = None  # what total_tokens 'auto' chose, and why

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
    batch_bucket = -(-bucket(batch) // batch_multiple) * batch_multiple
    tokens = np.zeros((batch_bucket, prompt_bucket), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = prompt
    pad = batch_bucket - batch
    return PaddedBatch(tokens=tokens,
                       lengths=np.concatenate([lengths, np.ones(pad, np.int64)]).astype(np.int32),
                       budgets=np.concatenate([budgets, np.zeros(pad, np.int64)]).astype(np.int32),
                       seeds=np.concatenate([seeds, np.zeros(pad, np.int64)]).astype(np.uint32),
                       cache_size=cache_size, batch_size=batch)


def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    sampling: SamplingConfig = SamplingConfig(),
    eos_token_ids: Sequence[int] = (),
    seeds: int | Sequence[int] = 0,
    cache_size: int | None = None,
    cache_dtype: str | None = None,
    spec: SpecConfig | None = None,
    drafter: Any = None,
    mesh: Mesh | None = None,
    gather_logits: bool = False,
) -> GenerationResult:
    """Generation for a batch of ragged prompts (lists of token ids): autoregressive, or speculative
    when `spec` is given (`drafter` is then the proposer's weights, e.g. the draft Transformer).

    max_new_tokens and seeds are one value or one per prompt. A row stops after its budget or at the
    first EOS (which is kept in its output). cache_size defaults to what the padded request needs.
    mesh (specjax.sharding.make_mesh) runs the same program over several devices: weights split by
    specjax.sharding's rules (placed once: pass models already `sharding.shard`ed to skip the check),
    rows over the data axis. The verifier then works on vocabulary-split logits, or, with
    gather_logits, on logits gathered once per step.
    Models in the stacked layout run correctly but, on GPUs, slower: pass `transformer.to_decoding_layout`
    of them (`experiments.load_models` does) to decode at speed.
    """
    if cache_dtype is not None:
        dtype_from_name(cache_dtype, "cache_dtype")
    eos_token_ids = tuple(int(t) for t in eos_token_ids)
    lookahead = 0 if spec is None else spec.num_draft_nodes + 1
    request = pad_request(model, prompts, max_new_tokens, seeds, cache_size, lookahead,
                          batch_multiple=1 if mesh is None else mesh.shape[sharding.DATA])
    args = (jnp.asarray(request.tokens), jnp.asarray(request.lengths), jnp.asarray(request.budgets),
            jax.vmap(jax.random.key)(jnp.asarray(request.seeds)))
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        if mesh is not None:
            model, args = sharding.shard(model, mesh), sharding.put(args, mesh)
        if spec is None:
            state = decode_loop(model, *args, sampling=sampling, eos_token_ids=eos_token_ids,
                                cache_size=request.cache_size, cache_dtype=cache_dtype)
            return _result(state, request, eos_token_ids)
        if verifier_name(spec, sampling) == "greedy":  # every lossless verifier: one program at T = 0
            spec = dataclasses.replace(spec, rejection_sample_method="standard", verify_impl="auto")
        run = functools.partial(run_speculative, model, drafter, args, cache_size=request.cache_size,
                                sampling=sampling, mesh=mesh, eos_token_ids=eos_token_ids, cache_dtype=cache_dtype,
                                gather_logits=gather_logits)
        choice = None
        if spec.total_tokens == "auto":
            choice = choose_tree_size(run, model, spec, request.batch_size)
            spec = dataclasses.replace(spec, total_tokens=choice.total_tokens)
        state, _ = run(spec)
    metrics = AcceptanceMetrics.from_counters(state.counters, request.batch_size)
    return dataclasses.replace(_result(state.decode, request, eos_token_ids), metrics=metrics, tree_size_choice=choice)


def run_speculative(model: Transformer, drafter: Any, args: tuple, spec: SpecConfig, *, cache_size: int,
                    sampling: SamplingConfig = SamplingConfig(), mesh: Mesh | None = None,
                    eos_token_ids: tuple[int, ...] = (), cache_dtype: str | None = None, gather_logits: bool = False,
                    max_new_tokens: int | None = None) -> tuple[SpecState, Proposer]:
    """(the speculative loop's final SpecState, its proposer) for a padded request's device arrays
    args = (tokens, lengths, budgets, keys), each row's budget capped at max_new_tokens when given; the
    model (and args) already placed on the mesh when one is given. generate's speculative path."""
    proposer = build_proposer(spec, sampling, cache_size, drafter)
    proposer.check(drafter, model.config)
    draft_params = proposer.bind(drafter, model)
    if mesh is not None:
        draft_params = sharding.shard(draft_params, mesh)
    tokens, lengths, budgets, keys = args
    if max_new_tokens is not None:
        budgets = jnp.minimum(budgets, max_new_tokens)
    state = speculative_loop(model, draft_params, tokens, lengths, budgets, keys, proposer=proposer,
                             eos_token_ids=eos_token_ids, cache_dtype=cache_dtype, gather_logits=gather_logits)
    return state, proposer


def choose_tree_size(run, model: Transformer, spec: SpecConfig, batch: int) -> tree_size.TreeSizeChoice:
    """total_tokens 'auto' (specjax.tree_size): calibration runs of the request at the smallest and the
    largest candidate size (each the fastest of REPEATS runs of CALIBRATION_TOKENS tokens a row, less the
    fastest of one token a row, so that neither the prefill nor the compile counts), the largest tree's
    drafts' confidences and measured acceptance, and the target's forward timed at every candidate size.
    run(spec, max_new_tokens=n) -> (SpecState, proposer), as run_speculative with the request bound."""
    sizes = spec.auto_tree_sizes

    def calibrate(size):
        def timed(max_new_tokens):
            start = time.perf_counter()
            state, proposer = run(dataclasses.replace(spec, total_tokens=size), max_new_tokens=max_new_tokens)
            return jax.block_until_ready(state), proposer, time.perf_counter() - start

        timed(1)  # compiles
        # The first run of each budget is slower (allocation): the fastest of a few runs counts.
        short, _, short_s = min((timed(1) for _ in range(tree_size.REPEATS)), key=lambda timing: timing[2])
        state, proposer, long_s = min((timed(tree_size.CALIBRATION_TOKENS) for _ in range(tree_size.REPEATS)),
                                      key=lambda timing: timing[2])
        steps = int(state.counters.steps.max()) - int(short.counters.steps.max())
        return state, proposer, (long_s - short_s) / max(steps, 1)

    state, proposer, largest_step_s = calibrate(sizes[-1])
    measured = AcceptanceMetrics.from_counters(state.counters, batch).summary()["mean_acceptance_length"]
    log_probs = np.asarray(sharding.to_host(proposer.tree_log_probs(state.proposer)))[:batch]
    acceptance = tree_size.estimated_acceptance(log_probs, sizes, measured)
    verify_s = tree_size.verify_seconds(model, state.decode.cache, sizes)
    smallest_step_s = calibrate(sizes[0])[2] if len(sizes) > 1 else largest_step_s
    return tree_size.choose(sizes, acceptance, verify_s, (smallest_step_s, largest_step_s), batch)


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
