"""A smaller LM with its own KV cache drafts K tokens autoregressively inside the loop.

Each propose call first re-reads the last two committed tokens: after a step that accepted all K
drafts the draft cache lacks the K-th draft and the bonus token, otherwise only the next token; a
fixed window of two covers both cases with one shape, and rewriting an entry that was already
right is harmless. So the draft cache needs no work in `accept`: its fill level is reset from the
committed length at the next propose.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from specjax.models import hf
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Transformer, for_decoding
from specjax.proposers.base import Context, Proposer, ProposerSettings, TargetOutput, register
from specjax.proposers.heterogeneous import HeterogeneousDraft
from specjax.verify.sampling import processed_logits, processed_probs


@functools.partial(jax.tree_util.register_dataclass, data_fields=("cache",), meta_fields=())
@dataclasses.dataclass(frozen=True)
class DraftModelState:
    cache: KVCache


def draw_draft_tokens(logits: Float[Array, "B V"], keys: PRNGKeyArray, settings: ProposerSettings):
    """The next draft token per row and, for probabilistic drafting, its processed distribution."""
    if settings.sampling.is_greedy or settings.spec.draft_sample_method == "greedy":
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    probs = processed_probs(logits, settings.sampling)
    tokens = jax.vmap(jax.random.categorical)(keys, processed_logits(logits, settings.sampling))
    return tokens.astype(jnp.int32), probs


@register("draft_model")
@dataclasses.dataclass(frozen=True)
class DraftModelProposer(Proposer):
    default_drafter: ClassVar[str | None] = "default:draft"

    @classmethod
    def load(cls, folder: Path, target: Transformer, dtype: str | None, model_shards: int) -> Transformer:
        return for_decoding(hf.load(folder, dtype=dtype), model_shards)

    def check(self, params, target_config) -> None:
        if self.settings.spec.use_heterogeneous_vocab:
            if not isinstance(params, HeterogeneousDraft):
                raise ValueError("use_heterogeneous_vocab needs a HeterogeneousDraft (draft model + vocabulary "
                                 f"mapping) as drafter, got {type(params).__name__}")
            mapping, draft = params.mapping, params.model
            if mapping.target_to_draft.shape[0] != target_config.vocab_size or \
                    mapping.draft_to_target.shape[0] != draft.config.vocab_size:
                raise ValueError(f"the vocabulary mapping covers {mapping.target_to_draft.shape[0]} target and "
                                 f"{mapping.draft_to_target.shape[0]} draft ids; the models have "
                                 f"{target_config.vocab_size} and {draft.config.vocab_size}")
            return
        if not isinstance(params, Transformer):
            raise ValueError(f"method 'draft_model' needs a draft Transformer as drafter, got {type(params).__name__}")
        if params.config.vocab_size != target_config.vocab_size:
            raise ValueError(
                f"draft vocab_size {params.config.vocab_size} differs from the target's {target_config.vocab_size}: "
                "allowed only equal vocabularies (different tokenizers need use_heterogeneous_vocab)")

    @staticmethod
    def _split(params) -> tuple[Transformer, HeterogeneousDraft | None]:
        """The draft model, and the vocabulary bridge when its ids are not the target's."""
        return (params.model, params) if isinstance(params, HeterogeneousDraft) else (params, None)

    def init(self, params, prompt: Int[Array, "B T"], lengths: Int[Array, " B"],
             target_out: TargetOutput) -> DraftModelState:
        draft, bridge = self._split(params)
        batch, length = prompt.shape
        cache = draft.create_cache(batch, self.settings.cache_size, self.settings.cache_dtype)
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        tokens = prompt if bridge is None else bridge.draft_ids(prompt)
        _, _, cache = draft(tokens, positions, cache, compute_logits=False)
        return DraftModelState(cache=cache.with_lengths(lengths))

    def propose(self, params, state: DraftModelState, context: Context, keys: PRNGKeyArray):
        draft, bridge = self._split(params)
        num_draft = self.settings.spec.num_speculative_tokens
        rows = jnp.arange(context.tokens.shape[0])
        start = context.lengths - 2  # >= 0: every row holds its prompt and the prefill's token
        window = jnp.stack([context.tokens[rows, start], context.tokens[rows, start + 1]], axis=1)
        if bridge is not None:
            window = bridge.draft_ids(window)
        positions = start[:, None] + jnp.arange(2, dtype=jnp.int32)[None, :]
        logits, _, cache = draft(window, positions, state.cache.with_lengths(start))
        step_keys = jax.vmap(lambda key: jax.random.split(key, num_draft))(keys).swapaxes(0, 1)  # [K, B]

        def draw(logits, step_key):  # in the draft's own ids
            return draw_draft_tokens(logits if bridge is None else bridge.mask(logits), step_key, self.settings)

        def draft_step(carry, step_key):
            cache, logits = carry
            token, probs = draw(logits, step_key)
            logits, _, cache = draft(token[:, None], cache.lengths[:, None], cache)
            return (cache, logits[:, 0]), (token, probs)

        (cache, logits), (tokens, probs) = jax.lax.scan(draft_step, (cache, logits[:, -1]), step_keys[:-1])
        last_token, last_probs = draw(logits, step_keys[-1])
        draft_tokens = jnp.concatenate([tokens, last_token[None]], axis=0).swapaxes(0, 1)  # [B, K]
        if bridge is not None:  # greedy drafting only (SpecConfig refuses the rest): no probabilities to map
            draft_tokens = bridge.target_ids(draft_tokens)
        draft_probs = None
        if last_probs is not None:
            draft_probs = jnp.concatenate([probs, last_probs[None]], axis=0).swapaxes(0, 1)  # [B, K, V]
        return draft_tokens, draft_probs, DraftModelState(cache=cache)

    def accept(self, state: DraftModelState, num_accepted, next_token, target_out) -> DraftModelState:
        return state
