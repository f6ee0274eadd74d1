"""Sampling transforms: logits -> processed distribution (temperature, top-k, top-p) -> token.

The processed distribution is the one decoding is lossless with respect to: speculative verifiers
compare target and draft distributions processed by these same functions. Temperature 0 is greedy;
then nothing over the vocabulary is built beyond an argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from specjax.config import SamplingConfig
from specjax.sharding import vocabulary_argmax


def processed_logits(logits: Float[Array, "... V"], sampling: SamplingConfig) -> Float[Array, "... V"]:
    """Float32 logits / temperature with tokens outside top-k and top-p set to -inf.

    top-k keeps every token whose logit ties the k-th largest. top-p keeps the smallest set of most
    probable tokens whose mass reaches top_p, plus any token tied with the least probable of them, so
    the result never depends on how a sort breaks ties.
    """
    if sampling.is_greedy:
        raise ValueError("processed_logits needs temperature > 0; greedy decoding takes the argmax")
    logits = logits.astype(jnp.float32) / sampling.temperature
    neg_inf = jnp.float32(-jnp.inf)
    if 0 < sampling.top_k < logits.shape[-1]:
        kth_largest = jax.lax.top_k(logits, sampling.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth_largest, neg_inf, logits)
    if sampling.top_p < 1.0:
        probs = jax.nn.softmax(logits, axis=-1)
        sorted_probs = -jnp.sort(-probs, axis=-1)
        # Kept apart from what follows: XLA's GPU fusion of the sorted values into the kept-set kernels
        # miscomputed large batches inside the speculative loop (docs/performance.md; the barrier is cheap).
        probs, sorted_probs = jax.lax.optimization_barrier((probs, sorted_probs))
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        num_kept = jnp.sum(mass_before < sampling.top_p, axis=-1, keepdims=True)
        smallest_kept = jnp.take_along_axis(sorted_probs, num_kept - 1, axis=-1)
        logits = jnp.where(probs < smallest_kept, neg_inf, logits)
    return logits


def processed_probs(logits: Float[Array, "... V"], sampling: SamplingConfig) -> Float[Array, "... V"]:
    """The processed distribution; one-hot at the argmax when greedy."""
    if sampling.is_greedy:
        return jax.nn.one_hot(vocabulary_argmax(logits), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(processed_logits(logits, sampling), axis=-1)


def categorical(keys: PRNGKeyArray, logits: Float[Array, "B V"]) -> Int[Array, " B"]:
    """jax.vmap(jax.random.categorical)(keys, logits), the same tokens bit for bit (the Gumbel-max
    construction jax.random.categorical uses), with the argmax taken by sharding.vocabulary_argmax:
    one collective, not two, when the vocabulary is split over a mesh."""
    noise = jax.vmap(lambda key, row: jax.random.gumbel(key, row.shape, row.dtype))(keys, logits)
    return vocabulary_argmax(noise + logits)


def sample(logits: Float[Array, "B V"], keys: PRNGKeyArray, sampling: SamplingConfig) -> Int[Array, " B"]:
    """One token per row from the processed distribution, row b drawing with its own key keys[b]."""
    if sampling.is_greedy:
        return vocabulary_argmax(logits)
    return categorical(keys, processed_logits(logits, sampling))
