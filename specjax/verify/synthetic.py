"""Synthetic acceptance, a benchmark mode that is *not* lossless: position i is accepted with the
conditional rate a_i / a_{i-1} (a_0 = 1), stopping at the first rejection, whatever the draft says;
the next token is the target's own sample at the stopping position. It fixes the acceptance
statistics so that speed can be measured at a chosen mean acceptance length.

With every row greedy the target is given as its argmaxes [B, K + 1] rather than distributions [B, K + 1, V]:
the race over a one-hot row is its argmax, so the tokens are the same, read without one-hot rows and an
exponential drawn for every vocabulary entry, as the greedy rule reads them (a step costs what a real greedy
verify costs)."""

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


def verify_with_draws(target: Array, draft_tokens: Int[Array, "B K"], draft_probs, draws: Draws, *,
                      rates: tuple[float, ...], num_valid=None):
    """target: distributions [B, K + 1, V], or with every row greedy argmaxes [B, K + 1] (module docstring)."""
    n = leading_true(draws.uniforms < jnp.asarray(conditional_rates(rates), jnp.float32))
    n = jnp.minimum(n, valid_drafts(num_valid, draft_tokens))
    return n, stopping_token(gather_position(target, n), draws.exponentials)


def stopping_token(at_stop: Array, exponentials: Float[Array, "B V"]) -> Int[Array, " B"]:
    """The next token from the target's row at the stopping position: an argmax as it is, a distribution raced."""
    return at_stop if at_stop.ndim == 1 else race_sample(at_stop.astype(jnp.float32), exponentials)
