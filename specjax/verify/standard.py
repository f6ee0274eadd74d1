"""Standard speculative sampling (Leviathan et al. 2023): accept X_i with probability
min(1, p(X_i) / q(X_i)) while every earlier one was accepted; at the first rejection sample from
norm(max(p - q, 0)); after K acceptances sample the bonus token from p at position K."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from specjax.verify.common import (Draws, draft_token_probs, from_draws, gather_position, leading_true,
                                   race_sample, residual_weights, token_probs, valid_drafts)


def acceptance_probs(target_probs: Float[Array, "B K1 V"], draft_tokens: Int[Array, "B K"],
                     draft_probs: Float[Array, "B K V"] | None) -> Float[Array, "B K"]:
    """min(1, p(X_i) / q(X_i)) for each draft position."""
    p = token_probs(target_probs[:, :-1], draft_tokens)
    q = draft_token_probs(draft_probs, draft_tokens)
    return jnp.minimum(1.0, p / jnp.maximum(q, jnp.finfo(jnp.float32).tiny))


def verify_with_draws(target_probs: Float[Array, "B K1 V"], draft_tokens: Int[Array, "B K"],
                      draft_probs: Float[Array, "B K V"] | None, draws: Draws, num_valid=None):
    num_draft = draft_tokens.shape[1]
    valid = valid_drafts(num_valid, draft_tokens)
    accepted = draws.uniforms < acceptance_probs(target_probs, draft_tokens, draft_probs)
    n = leading_true(accepted & (jnp.arange(num_draft)[None, :] < valid[:, None]))
    target_at_n = gather_position(target_probs, n)
    rejected_at = jnp.minimum(n, num_draft - 1)  # the position of the rejected draft (when n < K)
    residual = residual_weights(target_at_n,
                                None if draft_probs is None else gather_position(draft_probs, rejected_at),
                                gather_position(draft_tokens, rejected_at))
    weights = jnp.where((n < valid)[:, None], residual, target_at_n)  # all valid drafts accepted: the bonus
    return n, race_sample(weights, draws.exponentials)


verify = from_draws(verify_with_draws)
