"""Greedy verification: accept while the draft equals the target's argmax; the next token is the
argmax at the first mismatch (or the bonus argmax after all K). Needs no randomness and reads the
target's scores only through an argmax, so logits serve as well as probabilities."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from specjax.sharding import vocabulary_argmax
from specjax.verify.common import gather_position, leading_true, valid_drafts


def verify(target_probs: Float[Array, "B K1 V"], draft_tokens: Int[Array, "B K"], draft_probs=None, keys=None,
           num_valid=None):
    target_tokens = vocabulary_argmax(target_probs)  # [B, K + 1]
    num_accepted = jnp.minimum(leading_true(draft_tokens == target_tokens[:, :-1]), valid_drafts(num_valid, draft_tokens))
    return num_accepted, gather_position(target_tokens, num_accepted)
