"""DSpark drafting (`method: dspark`): DFlash's block forward, then the Markov head drafts sequentially.

The block, its cache and its bookkeeping are DFlash's (specjax.proposers.dflash, shared, not copied): one
drafter forward gives the base logits of the K slots that draft. Then, in a scan over the K slots inside
the jitted propose, draft k is drawn from base_k + W2 . W1[x_{k-1}] (x_0 the anchor, x_{k-1} the draft just
drawn; specjax.models.dspark). With SpecConfig.dspark_draft_topk = k, each slot's distribution is restricted
to its k candidates of highest base logit, the bias added to those only. Either way the draft
probabilities handed to the verifier are the distribution each draft was drawn from, given the drafts
before it, so standard and block verification stay lossless.

The confidence head's sigmoid(w . [h_k, W1[x_{k-1}]] + b) for each draft is kept in the state
(`DSparkState.draft_confidence`, [B, K]; None for a drafter without the head), for verification schemes
that choose how many drafts to verify (Proposer.draft_confidence; specjax.adaptive).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from specjax.config import SpecConfig, require
from specjax.models.dspark import ARCHITECTURE, DSparkDrafter, load_dspark
from specjax.proposers.base import Context, TargetOutput, register
from specjax.proposers.dflash import DFlashParams, DFlashProposer, DFlashState
from specjax.proposers.drafting import draw_draft_tokens


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("cache", "pending", "num_pending", "draft_confidence"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class DSparkState(DFlashState):
    # The confidence head's estimate, per draft of the last propose, that it is accepted given the one
    # before it was ([B, K]; None without a confidence head).
    draft_confidence: Float[Array, "B K"] | None


def top_candidates(logits: Float[Array, "... V"], k: int) -> Float[Array, "... V"]:
    """The logits with every id outside the k highest set to -inf (ties with the k-th kept)."""
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits >= kth, logits, -jnp.inf)


@register("dspark")
@dataclasses.dataclass(frozen=True)
class DSparkProposer(DFlashProposer):
    default_drafter: ClassVar[str | None] = "default:dspark"
    checkpoint_kind: ClassVar[str] = "a DSpark drafter"
    takes_draft_vocabulary: ClassVar[bool] = False
    shaped_description: ClassVar[str | None] = None
    architecture: ClassVar[str] = ARCHITECTURE
    read_checkpoint: ClassVar = staticmethod(load_dspark)
    drafts_to_width: ClassVar[bool] = False  # its Markov head drafts in sequence and its confidence reads every draft
    # dspark_draft_topk (vLLM's option): each draft is drawn from the dspark_draft_topk candidates of highest
    # base (backbone) logit, with the Markov bias added to those only (vLLM's gathered bias: k rows of W2 read
    # instead of V); null: the whole vocabulary. The draft probabilities the verifier sees are that restricted
    # distribution, so verification stays lossless. DFlash's dflash_full_block applies too.
    options: ClassVar[dict[str, Any]] = {**DFlashProposer.options, "dspark_draft_topk": (None,)}

    @classmethod
    def check_options(cls, spec: SpecConfig) -> None:
        super().check_options(spec)
        topk = spec.dspark_draft_topk
        require(topk is None or (isinstance(topk, int) and not isinstance(topk, bool) and topk >= 1), "SpecConfig",
                "dspark_draft_topk", topk, "null, or an integer >= 1")

    def check(self, params: Any, target_config) -> None:
        if not isinstance(params, DSparkDrafter):
            raise ValueError(f"method 'dspark' needs a DSparkDrafter as drafter, got {type(params).__name__}")
        self.check_block(params, target_config)
        topk, vocab = self.settings.spec.dspark_draft_topk, target_config.vocab_size
        if topk is not None and topk > vocab:
            raise ValueError(f"SpecConfig.dspark_draft_topk = {topk} is invalid: allowed null or 1..{vocab} "
                             "(the vocabulary size)")

    def extend(self, params: DFlashParams, cache, prompt: Int[Array, "B T1"], lengths: Int[Array, " B"],
               start: Int[Array, " B"], target_out: TargetOutput) -> DSparkState:
        """DFlash's state with the confidences of no draft yet (init, a prefix's prefill and mixed prefill all come
        here: each gives the state a DSpark step carries)."""
        state = super().extend(params, cache, prompt, lengths, start, target_out)
        shape = (lengths.shape[0], self.settings.spec.num_speculative_tokens)
        confidence = None if params.drafter.confidence_w is None else jnp.zeros(shape, jnp.float32)
        return DSparkState(cache=state.cache, pending=state.pending, num_pending=state.num_pending,
                           draft_confidence=confidence)

    def draft_confidence(self, state: DSparkState) -> Float[Array, "B K"] | None:
        return state.draft_confidence

    def propose(self, params: DFlashParams, state: DSparkState, context: Context, keys: PRNGKeyArray):
        drafter, settings = params.drafter, self.settings
        num_draft, topk = settings.spec.num_speculative_tokens, settings.spec.dspark_draft_topk
        hidden, state = self.draft_block(params, state, context)
        base = self.logits(params, hidden)  # [B, K, V]
        if topk is not None:
            base = top_candidates(base, topk)
        rows = jnp.arange(context.lengths.shape[0])
        anchor = context.tokens[rows, context.lengths - 1]
        slot_keys = jax.vmap(lambda key: jax.random.split(key, num_draft))(keys)  # [B, K]

        def draw(previous, slot):  # one draft per row, after `previous`
            logits, slot_key, slot_hidden = slot
            token, probs = draw_draft_tokens(logits + drafter.markov_bias(previous, slot_hidden), slot_key, settings,
                                             context.sampling)
            return token, (token, probs)

        slots = tuple(jnp.swapaxes(x, 0, 1) for x in (base, slot_keys, hidden))  # scanned over the K slots
        _, (drafts, draft_probs) = jax.lax.scan(draw, anchor, slots)
        drafts = jnp.swapaxes(drafts, 0, 1)
        draft_probs = None if draft_probs is None else jnp.swapaxes(draft_probs, 0, 1)
        if state.draft_confidence is not None:
            previous = jnp.concatenate([anchor[:, None], drafts[:, :-1]], axis=1)
            confidence = jax.nn.sigmoid(drafter.confidence_logit(hidden, previous))
            state = dataclasses.replace(state, draft_confidence=confidence)
        return drafts, draft_probs, state
