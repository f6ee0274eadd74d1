"""What the verifiers share: their random draws, and sampling by an exponential race.

Every verifier has one signature, `verify(target_probs[B,K+1,V], draft_tokens[B,K],
draft_probs[B,K,V] | None, keys[B]) -> (num_accepted[B], next_token[B])`, and is built from a
`verify_with_draws` that takes the draws explicitly: the Pallas kernel consumes the same draws, so
the jnp verifiers reproduce its output exactly. draft_probs None means one-hot drafts (q = 1 for
the drafted token).

num_valid[B] (keyword, optional): row b verifies only its first num_valid[b] drafts, exactly as if
they were its whole draft (adaptive verification, specjax.adaptive): at most num_valid[b] accepted,
and when all of them are the next token is the bonus sample at position num_valid[b]. Because the
target is causal, its scores at positions 0..w do not depend on drafts past w, so this is the rule
run on a w-draft chain and stays lossless for any w fixed before the target's scores are seen.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from specjax.sharding import vocabulary_argmax


@functools.partial(jax.tree_util.register_dataclass, data_fields=("uniforms", "exponentials"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class Draws:
    uniforms: Float[Array, "B K"]  # acceptance tests, one per draft position
    exponentials: Float[Array, "B V"]  # the race that samples the correction or bonus token


def make_draws(keys: PRNGKeyArray, num_draft: int, vocab_size: int) -> Draws:
    """Row b's draws come from keys[b] alone."""
    def one_row(key):
        accept_key, race_key = jax.random.split(key)
        return (jax.random.uniform(accept_key, (num_draft,)),
                jax.random.exponential(race_key, (vocab_size,)))

    uniforms, exponentials = jax.vmap(one_row)(keys)
    return Draws(uniforms=uniforms, exponentials=exponentials)


def from_draws(verify_with_draws: Callable) -> Callable:
    """The keyed verifier of the common signature, drawing from keys[b] for row b."""
    @functools.wraps(verify_with_draws)
    def verify(target_probs, draft_tokens, draft_probs, keys, **options):
        draws = make_draws(keys, draft_tokens.shape[1], target_probs.shape[-1])
        return verify_with_draws(target_probs, draft_tokens, draft_probs, draws, **options)

    return verify


def race_sample(weights: Float[Array, "B V"], exponentials: Float[Array, "B V"]) -> Int[Array, " B"]:
    """A token drawn with probability weights / sum(weights), with no normalising pass:
    argmax(w / E) over E ~ Exp(1) (the argmin of exponential clocks with rates w).

    A float32 exponential is exactly 0 about once in 2^24 draws; 0 / 0 would be NaN, which argmax
    picks, so a zero-weight token could win. Zero weights therefore score -1 and never win (a row
    whose weights are all zero, possible only through rounding, takes token 0)."""
    scores = jnp.where(weights > 0, weights / exponentials, -1.0)
    return vocabulary_argmax(scores)


def token_probs(probs: Float[Array, "B K V"], tokens: Int[Array, "B K"]) -> Float[Array, "B K"]:
    return jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]


def draft_token_probs(draft_probs: Float[Array, "B K V"] | None, draft_tokens: Int[Array, "B K"]):
    """q(X_i) for each drafted token; 1 for one-hot drafts."""
    if draft_probs is None:
        return jnp.ones(draft_tokens.shape, jnp.float32)
    return token_probs(draft_probs, draft_tokens)


def residual_weights(target: Float[Array, "B V"], draft: Float[Array, "B V"] | None,
                     draft_token: Int[Array, " B"], scale: Float[Array, " B"] | float = 1.0):
    """max(scale * p - q, 0), unnormalised; with one-hot drafts q is the indicator of draft_token."""
    if draft is None:
        draft = jax.nn.one_hot(draft_token, target.shape[-1], dtype=target.dtype)
    scale = jnp.asarray(scale, target.dtype)
    scale = scale[:, None] if scale.ndim else scale
    return jnp.maximum(scale * target - draft, 0.0)


def leading_true(accepted: Array) -> Int[Array, " B"]:
    """How many leading entries of each row are True."""
    return jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def valid_drafts(num_valid: Int[Array, " B"] | None, draft_tokens: Int[Array, "B K"]) -> Int[Array, " B"]:
    """Each row's count of drafts to verify: num_valid, or all K when it is None."""
    if num_valid is None:
        return jnp.full(draft_tokens.shape[:1], draft_tokens.shape[1], jnp.int32)
    return jnp.minimum(num_valid, draft_tokens.shape[1]).astype(jnp.int32)


def gather_position(x: Array, index: Int[Array, " B"]) -> Array:
    """x[b, index[b]] for x of shape [B, N, ...]."""
    return x[jnp.arange(x.shape[0]), index]
