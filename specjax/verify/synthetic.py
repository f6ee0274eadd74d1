"""Synthetic acceptance, a benchmark mode that is *not* lossless: position i is accepted with the
conditional rate a_i / a_{i-1} (a_0 = 1), stopping at the first rejection, whatever the draft says;
the next token is the target's own sample at the stopping position. It fixes the acceptance
statistics so that speed can be measured at a chosen mean acceptance length."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from specjax.verify.common import Draws, gather_position, leading_true, race_sample, valid_drafts


def conditional_rates(rates: tuple[float, ...]) -> np.ndarray:
    """a_i / a_{i-1}, with 0 after a zero rate."""
    unconditional = np.asarray((1.0, *rates))
    previous = unconditional[:-1]
    return np.where(previous > 0, unconditional[1:] / np.where(previous > 0, previous, 1.0), 0.0)


def verify_with_draws(target_probs: Float[Array, "B K1 V"], draft_tokens: Int[Array, "B K"], draft_probs,
                      draws: Draws, *, rates: tuple[float, ...], num_valid=None):
    n = leading_true(draws.uniforms < jnp.asarray(conditional_rates(rates), jnp.float32))
    n = jnp.minimum(n, valid_drafts(num_valid, draft_tokens))
    return n, race_sample(gather_position(target_probs, n), draws.exponentials)
