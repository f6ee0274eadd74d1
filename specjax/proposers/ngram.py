"""N-gram prompt lookup (vLLM's method "ngram"): the draft is copied from the row's own context.

For each row, with committed tokens c = context.tokens[b, :context.lengths[b]] of length L: for n
from prompt_lookup_max down to prompt_lookup_min, find the most recent earlier occurrence of the
last n tokens, i.e. the largest end e with n - 1 <= e < L - 1 and c[e - n + 1 .. e] == c[L - n ..
L - 1]; the longest n that has one wins, and the draft is the K tokens that followed it,
c[e + 1 .. e + K]. Where fewer than K of them are committed, the lookup is continued with its own
draft: the tail c[e + 1 .. L - 1] repeats with period L - 1 - e (what the match predicts when read
over the drafted tokens too). With no match the draft is K zeros; the verifier rejects whatever is
wrong and the step still emits the target's token, so any draft is lossless.

The draft is deterministic (draft_probs None, one-hot to the verifier) and the proposer has no
weights and no state. Everything is [B, S] comparisons over the token buffer, so it runs inside the
jitted loop with static shapes, vectorised over the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, PRNGKeyArray

from specjax.config import SpecConfig, require, require_positive_ints
from specjax.proposers.base import OPTION_IGNORED, Context, TargetOutput, WeightlessProposer, register

NO_MATCH = -1


def last_match_end(tokens: Int[Array, "B S"], lengths: Int[Array, " B"], n: int) -> Int[Array, " B"]:
    """Per row, the end of the most recent earlier occurrence of the last n committed tokens, or NO_MATCH."""
    size = tokens.shape[1]
    ends = jnp.arange(size)[None, :]
    # Rows shorter than n read clipped garbage here; no end passes the range mask below for them.
    suffix = jnp.take_along_axis(tokens, jnp.clip(lengths[:, None] - n + jnp.arange(n)[None, :], 0, size - 1), axis=1)
    matches: Bool[Array, "B S"] = (ends >= n - 1) & (ends < lengths[:, None] - 1)
    for i in range(n):
        # Token i of the window that ends at e sits at e - (n - 1 - i).
        shift = n - 1 - i
        shifted = jnp.pad(tokens, ((0, 0), (shift, 0)))[:, :size]
        matches &= shifted == suffix[:, i:i + 1]
    return jnp.max(jnp.where(matches, ends, NO_MATCH), axis=1)


def ngram_draft(tokens: Int[Array, "B S"], lengths: Int[Array, " B"], num_draft: int, min_n: int,
                max_n: int) -> Int[Array, "B K"]:
    end = jnp.full(lengths.shape, NO_MATCH, jnp.int32)
    for n in range(max_n, min_n - 1, -1):
        end = jnp.where(end == NO_MATCH, last_match_end(tokens, lengths, n), end)
    # The occurrence ends before the suffix, so at least one committed token follows it.
    period = jnp.maximum(lengths - 1 - end, 1)
    index = end[:, None] + 1 + jnp.arange(num_draft)[None, :] % period[:, None]
    draft = jnp.take_along_axis(tokens, jnp.clip(index, 0, tokens.shape[1] - 1), axis=1)
    return jnp.where((end == NO_MATCH)[:, None], 0, draft).astype(jnp.int32)


@register("ngram")
@dataclasses.dataclass(frozen=True)
class NgramProposer(WeightlessProposer):
    # prompt_lookup_min / prompt_lookup_max: the n-gram lengths tried, longest first.
    options: ClassVar[dict[str, Any]] = {"prompt_lookup_min": OPTION_IGNORED, "prompt_lookup_max": OPTION_IGNORED}
    skips_drafting: ClassVar[bool] = True  # no state: the lookup reads the committed tokens

    @classmethod
    def check_options(cls, spec: SpecConfig) -> None:
        require_positive_ints(spec, "prompt_lookup_min")
        require(isinstance(spec.prompt_lookup_max, int) and spec.prompt_lookup_max >= spec.prompt_lookup_min,
                "SpecConfig", "prompt_lookup_max", spec.prompt_lookup_max,
                f"an integer >= prompt_lookup_min ({spec.prompt_lookup_min})")

    def init(self, params, prompt, lengths, target_out) -> tuple:
        return ()

    def extend(self, params, cache: None, prompt: Int[Array, "B T"], lengths: Int[Array, " B"],
               start: Int[Array, " B"], target_out: TargetOutput) -> tuple:
        return ()

    def propose(self, params, state: tuple, context: Context, keys: PRNGKeyArray):
        spec = self.settings.spec
        draft = ngram_draft(context.tokens, context.lengths, spec.num_speculative_tokens, spec.prompt_lookup_min,
                            spec.prompt_lookup_max)
        return draft, None, state

    def idle(self, params, state: tuple, context: Context) -> tuple:
        return state

    def accept(self, state: tuple, num_accepted, next_token, target_out) -> tuple:
        return state
