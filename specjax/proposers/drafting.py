"""What drafters share when they draft: drawing a draft token (`draw_draft_tokens`), the target's unembedding
bound with a reduced draft vocabulary (`TargetHeadParams`, FR-Spec: specjax.models.vocabulary), and a chain of
K drafts, one drafter step each (`draft_chain`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from specjax.models.transformer import Transformer, unembed
from specjax.models.vocabulary import restricted_unembedding, to_target_vocabulary
from specjax.proposers.base import ProposerSettings
from specjax.sharding import MODEL, vocabulary_argmax
from specjax.verify.sampling import SamplingParams, processed_probs, sample


def draw_draft_tokens(logits: Float[Array, "B V"], keys: PRNGKeyArray, settings: ProposerSettings,
                      sampling: SamplingParams):
    """The next draft token per row and, for probabilistic drafting, its processed distribution (greedy
    rows of a sampled batch: the argmax, one-hot)."""
    if not settings.sampling.sampled or settings.spec.draft_sample_method == "greedy":
        return vocabulary_argmax(logits), None
    return sample(logits, keys, sampling, settings.sampling), processed_probs(logits, sampling, settings.sampling)


def draft_chain(draw: Callable[[Any, PRNGKeyArray], tuple], step: Callable[[Any, Int[Array, " B"]], Any], carry: Any,
                keys: PRNGKeyArray, num_draft: int):
    """K = num_draft drafts in a chain, in one lax.scan: draw(carry, keys[B]) -> (token [B], probs [B, V] or None)
    from what the carry holds (logits or a feature), step(carry, token) -> the carry after one drafter step over
    the token; the last draft needs no step. Returns (tokens [B, K], probs [B, K, V] or None, the last carry)."""
    step_keys = jax.vmap(lambda key: jax.random.split(key, num_draft))(keys).swapaxes(0, 1)  # [K, B]

    def body(carry, step_key):
        token, probs = draw(carry, step_key)
        return step(carry, token), (token, probs)

    carry, (tokens, probs) = jax.lax.scan(body, carry, step_keys[:-1])
    last_token, last_probs = draw(carry, step_keys[-1])
    tokens = jnp.concatenate([tokens, last_token[None]], axis=0).swapaxes(0, 1)  # [B, K]
    if last_probs is not None:
        probs = jnp.concatenate([probs, last_probs[None]], axis=0).swapaxes(0, 1)  # [B, K, V]
    return tokens, probs, carry


@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetHeadParams:
    """Bound weights of a drafter that drafts through the target's embedding and LM head (None when tied)
    and, with a draft vocabulary (FR-Spec), the target's unembedding restricted to it, gathered once when
    bound, not in every draft step (None otherwise). Subclasses add the drafter's own weights."""

    embed: Float[Array, "V D"]
    lm_head: Float[Array, "D V"] | None
    draft_lm_head: Float[Array, "D Vd"] | None = None
    # specjax.sharding's rule for the name not among a Transformer's: split over the vocabulary.
    parameter_rules: ClassVar[dict[str, tuple[str | None, ...]]] = {"draft_lm_head": (None, MODEL)}

    @classmethod
    def bound(cls, target: Transformer, draft_ids: Int[Array, " Vd"] | None, **weights):
        """The params over target's unembedding, restricted to draft_ids where given, with the drafter's weights."""
        embed, lm_head = target.embed[...], None if target.lm_head is None else target.lm_head[...]
        restricted = None if draft_ids is None else restricted_unembedding(embed, lm_head, draft_ids)
        return cls(embed=embed, lm_head=lm_head, draft_lm_head=restricted, **weights)

    def target_logits(self, features: Float[Array, "... D"], dtype) -> Float[Array, "... V"]:
        """Logits over the target's whole vocabulary (its unembedding in compute dtype `dtype`)."""
        return unembed(features, self.embed, self.lm_head, dtype)

    def draft_logits(self, features: Float[Array, "... D"], dtype) -> Float[Array, "... Vd"]:
        """Logits over the draft vocabulary alone (draft_lm_head's ids, in their order)."""
        return unembed(features, self.embed, self.draft_lm_head, dtype)  # draft_lm_head is an LM head's [D, Vd]

    def logits(self, features: Float[Array, "... D"], dtype, draft_ids: Int[Array, " Vd"] | None,
               vocab_size: int) -> Float[Array, "... V"]:
        """Float32 logits over the target's vocabulary: the target's, or with a draft vocabulary its rows only,
        -inf at every other id."""
        if self.draft_lm_head is None:
            return self.target_logits(features, dtype)
        return to_target_vocabulary(self.draft_logits(features, dtype), draft_ids, vocab_size)
