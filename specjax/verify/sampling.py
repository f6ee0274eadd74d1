"""Sampling transforms: logits -> processed distribution (temperature, top-k, top-p) -> token.

The processed distribution is the one decoding is lossless with respect to: speculative verifiers
compare target and draft distributions processed by these same functions. Temperature 0 is greedy;
then nothing over the vocabulary is built beyond an argmax.

Settings are data. `SamplingParams` holds one temperature, top-k and top-p per row as arrays traced in
the program, so one compiled loop serves any mix of greedy and sampled rows and a temperature sweep
compiles once. What must be static is only what changes the program's shape, `SamplingMode`: whether
any row samples (an all-greedy batch skips every pass over the vocabulary but the argmax), a bound on
the rows' top-k (the width of one `lax.top_k`), and whether any row filters by top-p (a sort).
Every function also takes a plain `SamplingConfig`, the same settings for every row.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from specjax.config import SamplingConfig
from specjax.sharding import vocabulary_argmax

# The smallest top-k bound compiled: top-k values up to it share one program.
MIN_TOP_K_BOUND = 8


@dataclasses.dataclass(frozen=True)
class SamplingMode:
    """The static part of a batch's sampling settings: what the compiled program must be able to do."""

    sampled: bool = False  # some row has temperature > 0
    top_k_bound: int = 0  # >= every sampled row's top_k (a power of two); 0: no row filters by top-k
    top_p: bool = False  # some sampled row has top_p < 1

    @classmethod
    def of(cls, configs: Sequence[SamplingConfig]) -> SamplingMode:
        """The least mode that serves every config (greedy rows need nothing)."""
        sampled = [c for c in configs if not c.is_greedy]
        largest_k = max((c.top_k for c in sampled), default=0)
        bound = 0 if largest_k == 0 else max(MIN_TOP_K_BOUND, 1 << (largest_k - 1).bit_length())
        return cls(sampled=bool(sampled), top_k_bound=bound, top_p=any(c.top_p < 1.0 for c in sampled))

    def covers(self, other: SamplingMode) -> bool:
        """Whether a program compiled for self serves rows that need other."""
        return ((self.sampled or not other.sampled) and self.top_k_bound >= other.top_k_bound
                and (self.top_p or not other.top_p))

    def union(self, other: SamplingMode) -> SamplingMode:
        return SamplingMode(sampled=self.sampled or other.sampled,
                            top_k_bound=max(self.top_k_bound, other.top_k_bound), top_p=self.top_p or other.top_p)


GREEDY = SamplingMode()


@functools.partial(jax.tree_util.register_dataclass, data_fields=("temperature", "top_k", "top_p"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling settings as arrays ([B], or 0-d for every row alike); temperature 0 is greedy,
    top_k 0 and top_p 1 switch those filters off."""

    temperature: Float[Array, " B"]
    top_k: Int[Array, " B"]
    top_p: Float[Array, " B"]

    @classmethod
    def of(cls, configs: Sequence[SamplingConfig], batch: int | None = None) -> SamplingParams:
        """One row per config, padded with greedy rows to `batch` (host arrays; jit moves them)."""
        pad = (batch or len(configs)) - len(configs)
        configs = list(configs) + [SamplingConfig()] * pad
        return cls(temperature=np.array([c.temperature for c in configs], np.float32),
                   top_k=np.array([c.top_k for c in configs], np.int32),
                   top_p=np.array([c.top_p for c in configs], np.float32))

    @classmethod
    def uniform(cls, config: SamplingConfig) -> SamplingParams:
        """The same settings for every row (0-d arrays)."""
        return cls(temperature=np.float32(config.temperature), top_k=np.int32(config.top_k),
                   top_p=np.float32(config.top_p))

    @property
    def is_greedy(self) -> Array:
        return self.temperature == 0.0


def as_params(sampling: SamplingConfig | SamplingParams, mode: SamplingMode | None) -> tuple[SamplingParams, SamplingMode]:
    """(params, mode) from either form; a SamplingConfig brings its own mode."""
    if isinstance(sampling, SamplingConfig):
        return SamplingParams.uniform(sampling), SamplingMode.of([sampling])
    if mode is None:
        raise TypeError("per-row SamplingParams need their SamplingMode (the static part of the settings)")
    return sampling, mode


def per_row(x: Array, logits: Array) -> Array:
    """A row setting of shape [B] (or 0-d) shaped to broadcast against logits [B, ..., V]."""
    x = jnp.asarray(x)
    return x.reshape(x.shape + (1,) * (logits.ndim - x.ndim))


def processed_logits(logits: Float[Array, "B ... V"], sampling: SamplingConfig | SamplingParams,
                     mode: SamplingMode | None = None) -> Float[Array, "B ... V"]:
    """Float32 logits / temperature with tokens outside top-k and top-p set to -inf; greedy rows are
    divided by 1 (their tokens are the argmax, taken elsewhere).

    top-k keeps every token whose logit ties the k-th largest. top-p keeps the smallest set of most
    probable tokens whose mass reaches top_p, plus any token tied with the least probable of them, so
    the result never depends on how a sort breaks ties.
    """
    params, mode = as_params(sampling, mode)
    if not mode.sampled:
        raise ValueError("processed_logits needs temperature > 0; greedy decoding takes the argmax")
    temperature = per_row(params.temperature, logits)
    logits = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)
    neg_inf = jnp.float32(-jnp.inf)
    vocab = logits.shape[-1]
    if mode.top_k_bound:
        bound = min(mode.top_k_bound, vocab)
        top_k = per_row(params.top_k, logits)
        largest = jax.lax.top_k(logits, bound)[0]
        kth_largest = jnp.take_along_axis(largest, jnp.clip(top_k - 1, 0, bound - 1), axis=-1)
        filters = (top_k > 0) & (top_k < vocab)
        logits = jnp.where(filters & (logits < kth_largest), neg_inf, logits)
    if mode.top_p:
        top_p = per_row(params.top_p, logits)
        probs = jax.nn.softmax(logits, axis=-1)
        sorted_probs = -jnp.sort(-probs, axis=-1)
        # Kept apart from what follows: XLA's GPU fusion of the sorted values into the kept-set kernels
        # miscomputed large batches inside the speculative loop (docs/performance.md; the barrier is cheap).
        probs, sorted_probs = jax.lax.optimization_barrier((probs, sorted_probs))
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        num_kept = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)
        smallest_kept = jnp.take_along_axis(sorted_probs, num_kept - 1, axis=-1)
        # Rows with top_p 1 are left alone: float cumulative sums can reach 1 before the tail.
        logits = jnp.where((top_p < 1.0) & (probs < smallest_kept), neg_inf, logits)
    return logits


def processed_probs(logits: Float[Array, "B ... V"], sampling: SamplingConfig | SamplingParams,
                    mode: SamplingMode | None = None) -> Float[Array, "B ... V"]:
    """The processed distribution; one-hot at the argmax for greedy rows."""
    params, mode = as_params(sampling, mode)
    one_hot = jax.nn.one_hot(vocabulary_argmax(logits), logits.shape[-1], dtype=jnp.float32)
    if not mode.sampled:
        return one_hot
    probs = jax.nn.softmax(processed_logits(logits, params, mode), axis=-1)
    return jnp.where(per_row(params.is_greedy, logits), one_hot, probs)


def categorical(keys: PRNGKeyArray, logits: Float[Array, "B V"]) -> Int[Array, " B"]:
    """jax.vmap(jax.random.categorical)(keys, logits), the same tokens bit for bit (the Gumbel-max
    construction jax.random.categorical uses), with the argmax taken by sharding.vocabulary_argmax:
    one collective, not two, when the vocabulary is split over a mesh."""
    noise = jax.vmap(lambda key, row: jax.random.gumbel(key, row.shape, row.dtype))(keys, logits)
    return vocabulary_argmax(noise + logits)


def sample(logits: Float[Array, "B V"], keys: PRNGKeyArray, sampling: SamplingConfig | SamplingParams,
           mode: SamplingMode | None = None) -> Int[Array, " B"]:
    """One token per row from the processed distribution, row b drawing with its own key keys[b]; greedy
    rows take the argmax. One argmax over the vocabulary for both kinds of row (one collective on a mesh):
    the sampled rows' scores are categorical's Gumbel-perturbed logits, bit for bit."""
    params, mode = as_params(sampling, mode)
    if not mode.sampled:
        return vocabulary_argmax(logits)
    processed = processed_logits(logits, params, mode)
    noise = jax.vmap(lambda key, row: jax.random.gumbel(key, row.shape, row.dtype))(keys, processed)
    greedy = per_row(params.is_greedy, logits)
    return vocabulary_argmax(jnp.where(greedy, logits.astype(jnp.float32), processed + noise))
