"""Generation: prefill, then one `lax.while_loop` that never leaves the device.

`generate` is the host-side entry point: it validates the request, pads the batch and the prompt
length to buckets (so a new prompt length in the same bucket reuses the compiled program), and runs
`decode_loop`, which is one jitted function: ragged prefill of every prompt in one forward, then a
while loop that emits a token per active row per step until every row has hit EOS or its budget.

Row b samples its i-th new token with `fold_in(key(seed_b), i)`, so a row's output depends on its
seed and prompt only, never on what else is in the batch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int, PRNGKeyArray

from specjax.config import DTYPES, SamplingConfig, dtype_from_name
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Transformer
from specjax.verify.sampling import sample

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


def _emit(state: DecodeState, next_token: Int[Array, " B"], budgets: Int[Array, " B"],
          eos_token_ids: tuple[int, ...]) -> DecodeState:
    """Appends next_token to every active row and marks rows that hit EOS or their budget as done."""
    active = ~state.done
    rows = jnp.arange(next_token.shape[0])
    # Inactive rows write out of bounds, which a scatter drops.
    slot = jnp.where(active, state.lengths, state.tokens.shape[1])
    tokens = state.tokens.at[rows, slot].set(next_token)
    num_generated = state.num_generated + active
    is_eos = jnp.isin(next_token, jnp.asarray(eos_token_ids, jnp.int32)) if eos_token_ids else False
    done = state.done | (active & (is_eos | (num_generated >= budgets)))
    return dataclasses.replace(state, tokens=tokens, lengths=state.lengths + active,
                               num_generated=num_generated, done=done)


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
    """Prefill and decode as one program. Prompts are right-padded; budgets may be 0 (padding rows)."""
    batch, prompt_len = prompt_tokens.shape
    rows = jnp.arange(batch)
    cache = KVCache.create(model.config, batch, cache_size, cache_dtype and DTYPES[cache_dtype])
    positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
    _, hidden, cache = model(prompt_tokens, positions, cache, compute_logits=False)
    logits = model.unembed(hidden.final[rows, prompt_lengths - 1])
    tokens = jnp.zeros((batch, cache_size), jnp.int32).at[:, :prompt_len].set(prompt_tokens)
    state = DecodeState(tokens=tokens, lengths=prompt_lengths, num_generated=jnp.zeros_like(budgets),
                        done=budgets <= 0, cache=cache.with_lengths(prompt_lengths))

    def next_token(logits, state):
        step_keys = jax.vmap(jax.random.fold_in)(keys, state.num_generated)
        return sample(logits, step_keys, sampling)

    state = _emit(state, next_token(logits, state), budgets, eos_token_ids)

    def step(state: DecodeState) -> DecodeState:
        last = state.tokens[rows, state.lengths - 1]
        logits, _, cache = model(last[:, None], (state.lengths - 1)[:, None], state.cache)
        cache = cache.with_lengths(jnp.where(state.done, state.cache.lengths, cache.lengths))
        state = dataclasses.replace(state, cache=cache)
        return _emit(state, next_token(logits[:, 0], state), budgets, eos_token_ids)

    return jax.lax.while_loop(lambda state: ~jnp.all(state.done), step, state)


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    tokens: np.ndarray  # [B, max_new_tokens] generated ids; past num_generated[b] they are 0
    num_generated: np.ndarray  # [B]
    stopped_by_eos: np.ndarray  # [B] bool

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
                seeds: int | Sequence[int] = 0, cache_size: int | None = None) -> PaddedBatch:
    """Validates a request and pads it to buckets; every problem is a ValueError naming the row."""
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
    if config.position == "learned" and totals.max() > config.max_position_embeddings:
        row = int(totals.argmax())
        raise ValueError(f"row {row}: prompt ({lengths[row]} tokens) + max_new_tokens ({budgets[row]}) = "
                         f"{totals[row]} exceeds max_position_embeddings ({config.max_position_embeddings}) "
                         "of this model's learned positions")
    prompt_bucket = bucket(int(lengths.max()), MIN_PROMPT_BUCKET)
    if cache_size is None:
        needed = max(prompt_bucket, prompt_bucket + int(budgets.max()))
        cache_size = -(-needed // CACHE_ALIGNMENT) * CACHE_ALIGNMENT
    elif totals.max() > cache_size:
        row = int(totals.argmax())
        raise ValueError(f"row {row}: prompt ({lengths[row]} tokens) + max_new_tokens ({budgets[row]}) = "
                         f"{totals[row]} does not fit cache_size {cache_size}: allowed at most {cache_size}")
    # A prompt bucket larger than the cache would prefill out of bounds: pad only as far as it fits.
    prompt_bucket = min(prompt_bucket, cache_size)
    batch_bucket = bucket(batch)
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
) -> GenerationResult:
    """Autoregressive generation for a batch of ragged prompts (lists of token ids).

    max_new_tokens and seeds are one value or one per prompt. A row stops after its budget or at the
    first EOS (which is kept in its output). cache_size defaults to what the padded request needs.
    """
    request = pad_request(model, prompts, max_new_tokens, seeds, cache_size)
    if cache_dtype is not None:
        dtype_from_name(cache_dtype, "cache_dtype")
    keys = jax.vmap(jax.random.key)(jnp.asarray(request.seeds))
    state = decode_loop(model, jnp.asarray(request.tokens), jnp.asarray(request.lengths),
                        jnp.asarray(request.budgets), keys, sampling=sampling,
                        eos_token_ids=tuple(int(t) for t in eos_token_ids),
                        cache_size=request.cache_size, cache_dtype=cache_dtype)
    return _result(state, request, max(int(b) for b in request.budgets[:request.batch_size]),
                   set(eos_token_ids))


def _result(state: DecodeState, request: PaddedBatch, width: int, eos_token_ids) -> GenerationResult:
    tokens, num_generated = jax.device_get((state.tokens, state.num_generated))
    rows = request.batch_size
    out = np.zeros((rows, width), np.int32)
    stopped = np.zeros(rows, bool)
    for row in range(rows):
        n, start = int(num_generated[row]), int(request.lengths[row])
        out[row, :n] = tokens[row, start:start + n]
        stopped[row] = n > 0 and int(out[row, n - 1]) in eos_token_ids
    return GenerationResult(tokens=out, num_generated=num_generated[:rows].astype(np.int64),
                            stopped_by_eos=stopped)
