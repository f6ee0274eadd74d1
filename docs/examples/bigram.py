"""Bigram lookup (`method` "bigram"), the example drafter of docs/research-guide.md.

Each draft token is the token that followed the latest earlier occurrence of the token before it in
the row's committed context: d_1 follows the last committed token, d_2 follows d_1, and so on. Where
a token never occurred before (with a successor), the draft repeats it. The draft is deterministic
(draft_probs None: one-hot to the verifier) and the proposer has no weights and no state.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Int, PRNGKeyArray

from specjax.proposers.base import Context, TargetOutput, WeightlessProposer, register


def next_after(tokens: Int[Array, "B S"], lengths: Int[Array, " B"], token: Int[Array, " B"]) -> Int[Array, " B"]:
    """Per row, the committed token after the latest earlier occurrence of `token`, else `token`."""
    positions = jnp.arange(tokens.shape[1])[None, :]
    # Only committed tokens that have a committed successor (the buffer past lengths is not the row's).
    hits = (tokens == token[:, None]) & (positions < lengths[:, None] - 1)
    last = jnp.max(jnp.where(hits, positions, -1), axis=1)
    follower = jnp.take_along_axis(tokens, (last + 1)[:, None], axis=1)[:, 0]
    return jnp.where(last >= 0, follower, token)


@register("bigram")
@dataclasses.dataclass(frozen=True)
class BigramProposer(WeightlessProposer):
    def init(self, params: None, prompt: Int[Array, "B T"], lengths: Int[Array, " B"],
             target_out: TargetOutput) -> tuple:
        return ()

    def propose(self, params: None, state: tuple, context: Context, keys: PRNGKeyArray):
        rows = jnp.arange(context.tokens.shape[0])
        token = context.tokens[rows, context.lengths - 1]  # the newest committed token
        drafts = []
        for _ in range(self.settings.spec.num_speculative_tokens):  # K is static: unrolled
            token = next_after(context.tokens, context.lengths, token)
            drafts.append(token)
        return jnp.stack(drafts, axis=1).astype(jnp.int32), None, state

    def accept(self, state: tuple, num_accepted: Int[Array, " B"], next_token: Int[Array, " B"],
               target_out: TargetOutput) -> tuple:
        return state
