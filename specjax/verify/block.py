"""Block verification (Sun et al. 2024, arXiv 2403.10444): accept the longest prefix allowed by the
joint prefix ratio rather than token by token. Never accepts less than standard verification in
expectation; equal in distribution to it for one-hot drafts.

With p the target and q the draft distributions along the drafted prefix X^i:
  p_0 = 1,  p_i = min(1, p_{i-1} p(X_i | X^{i-1}) / q(X_i | X^{i-1}))
  Z_{i+1} = sum_x max(p_i p(x | X^i) - q(x | X^i), 0)
  h_i = Z_{i+1} / (Z_{i+1} + 1 - p_i) for i < K,   h_K = p_K
  tau = max{i in 1..K : eta_i <= h_i}, 0 if none
The next token is the bonus sample from p(. | X^K) if tau = K, else a sample of
norm(max(p_tau p(. | X^tau) - q(. | X^tau), 0)).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from specjax.verify.common import (Draws, draft_token_probs, from_draws, gather_position, race_sample,
                                   residual_weights, token_probs, valid_drafts)


def prefix_ratios(target_probs, draft_tokens, draft_probs) -> Float[Array, "B K1"]:
    """p_0 .. p_K."""
    p = token_probs(target_probs[:, :-1], draft_tokens)
    q = draft_token_probs(draft_probs, draft_tokens)
    ratios = [jnp.ones(draft_tokens.shape[0], jnp.float32)]
    for i in range(draft_tokens.shape[1]):
        ratios.append(jnp.minimum(1.0, ratios[-1] * p[:, i] / jnp.maximum(q[:, i], jnp.finfo(jnp.float32).tiny)))
    return jnp.stack(ratios, axis=1)


def residual_masses(target_probs, draft_tokens, draft_probs, ratios) -> Float[Array, "B K"]:
    """Z_1 .. Z_K: the mass of max(p_i p(. | X^i) - q(. | X^i), 0) for i = 0 .. K - 1."""
    p_i = ratios[:, :-1]
    if draft_probs is None:  # q is the indicator of X_{i+1}, and p_i p(x) <= 1
        return p_i * (1.0 - token_probs(target_probs[:, :-1], draft_tokens))
    weights = jnp.maximum(p_i[..., None] * target_probs[:, :-1] - draft_probs, 0.0)
    return jnp.sum(weights, axis=-1)


def stopping_probs(target_probs, draft_tokens, draft_probs) -> tuple[Float[Array, "B K"], Float[Array, "B K1"]]:
    """h_1 .. h_K, and the prefix ratios p_0 .. p_K they came from."""
    ratios = prefix_ratios(target_probs, draft_tokens, draft_probs)
    masses = residual_masses(target_probs, draft_tokens, draft_probs, ratios)
    return stopping_from_masses(masses, ratios), ratios


def stopping_from_masses(masses: Float[Array, "B K"], ratios: Float[Array, "B K1"]) -> Float[Array, "B K"]:
    """h_1 .. h_K from the residual masses Z_1 .. Z_K and the prefix ratios p_0 .. p_K."""
    z_next, p_i = masses[:, 1:], ratios[:, 1:-1]  # Z_{i+1} and p_i for i = 1 .. K - 1
    denominator = z_next + 1.0 - p_i
    # 0 / 0 happens only when p_i = 1 and the target equals the draft at X^i; then p_{i+1} = 1 too,
    # so a later position is accepted for sure, and h_i = 0 keeps tau off an empty residual.
    h = jnp.where(denominator > 0, z_next / jnp.where(denominator > 0, denominator, 1.0), 0.0)
    return jnp.concatenate([h, ratios[:, -1:]], axis=1)


def truncated_stopping(h: Float[Array, "B K"], ratios: Float[Array, "B K1"], valid: Int[Array, " B"]):
    """h_1 .. h_K of the block cut to its first valid[b] drafts: h_i where i < w, h_w = p_w (the last
    position of a w-draft block), and never past w (-1 is below every uniform)."""
    positions = jnp.arange(1, h.shape[1] + 1)[None, :]
    last = gather_position(ratios, valid)[:, None]
    return jnp.where(positions < valid[:, None], h, jnp.where(positions == valid[:, None], last, -1.0))


def accepted_length(h: Float[Array, "B K"], uniforms: Float[Array, "B K"]) -> Int[Array, " B"]:
    """tau = max{i in 1..K : eta_i <= h_i}, 0 if none."""
    positions = jnp.arange(1, h.shape[1] + 1)
    return jnp.max(jnp.where(uniforms <= h, positions, 0), axis=1).astype(jnp.int32)


def verify_with_draws(target_probs: Float[Array, "B K1 V"], draft_tokens: Int[Array, "B K"],
                      draft_probs: Float[Array, "B K V"] | None, draws: Draws, num_valid=None):
    num_draft = draft_tokens.shape[1]
    valid = valid_drafts(num_valid, draft_tokens)
    h, ratios = stopping_probs(target_probs, draft_tokens, draft_probs)
    if num_valid is not None:
        h = truncated_stopping(h, ratios, valid)
    tau = accepted_length(h, draws.uniforms)
    target_at_tau = gather_position(target_probs, tau)
    stop = jnp.minimum(tau, num_draft - 1)  # the draft position after the accepted prefix (tau < K)
    residual = residual_weights(target_at_tau,
                                None if draft_probs is None else gather_position(draft_probs, stop),
                                gather_position(draft_tokens, stop), gather_position(ratios, tau))
    weights = jnp.where((tau < valid)[:, None], residual, target_at_tau)  # tau = w: the bonus
    return tau, race_sample(weights, draws.exponentials)


verify = from_draws(verify_with_draws)
