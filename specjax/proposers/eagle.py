"""EAGLE-1 and EAGLE-3 drafting (`method` "eagle" and "eagle3") with the head's own KV cache.

A head with a draft vocabulary (EAGLE-3's own LM head, or an EAGLE-1 head under FR-Spec) drafts only
ids of it: the draft logits are -inf at every other target id, so greedy drafts and sampled drafts
(and their probabilities) stay inside it; verification is over the target's whole vocabulary.

The head consumes pairs (f_j, x_{j+1}): the target's feature at position j and the token after it.
Pairs whose feature came from the target are committed to the head's cache; pairs built from the
head's own predicted features (while drafting) sit after them and are dropped at the next step by
resetting the fill level. After a verify step the next pairs are the verify block's features at
positions 0..n with the tokens d_1..d_n, next_token: n + 1 pairs, fed as a fixed window of K + 1
whose output at index n starts the next draft. Under adaptive verification the step's accept_verified
feeds them at once, as a window of the chosen width W + 1, and keeps that output (EagleState.feature).

Dynamic trees (EAGLE-2; SpecConfig.total_tokens, top_k; the algorithm is specjax.structure.grow): the
head runs each level's frontier as pairs (the parent's output, the node's token) at position
committed + depth - 1, under the tree's mask over its own cache; those entries are dropped like a chain's
drafts (the fill level is reset at the next step), so accept needs only the path's tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from specjax import benchmarking
from specjax.config import ModelConfig
from specjax.models import hf
from specjax.models.eagle import (EagleConfig, EagleHead, checkpoint_version, default_fuse_layers,
                                  head_to_decoding_layout, init_eagle, load_eagle, with_draft_vocabulary)
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Hidden, Transformer, for_decoding
from specjax.models.vocabulary import to_target_vocabulary
from specjax.proposers.base import (SHAPED_DRAFT_VOCAB, Context, Proposer, ProposerSettings, TargetOutput, register,
                                    require_target_sizes)
from specjax.proposers.drafting import TargetHeadParams, draft_chain, draw_draft_tokens
from specjax.trees import masks, structure


@functools.partial(jax.tree_util.register_dataclass, data_fields=("head", "embed", "lm_head", "draft_lm_head"),
                   meta_fields=())
@dataclasses.dataclass(frozen=True, kw_only=True)
class EagleParams(TargetHeadParams):
    """The head with the target's embedding and LM head it shares (TargetHeadParams; an EAGLE-1 head with a
    draft vocabulary drafts through the target's rows of it, FR-Spec)."""

    head: EagleHead


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("cache", "committed", "tokens", "hidden", "num_pending", "drafts", "parents",
                                "tree_log_probs", "feature"),
                   meta_fields=())
@dataclasses.dataclass(frozen=True)
class EagleState:
    cache: KVCache
    committed: Int[Array, " B"]  # pairs with target features in the cache
    tokens: Int[Array, "B W"]  # pending pairs (W = K + 1), the first num_pending of them valid
    hidden: Hidden  # the target's hidden states of the pending pairs; the head fuses them in propose
    num_pending: Int[Array, " B"]
    drafts: Int[Array, "B N"]  # the last proposal (K chain drafts or N tree nodes), to rebuild the pairs
    parents: Int[Array, "B N"] | None = None  # the last dynamic tree's parents; None for chains
    tree_log_probs: Float[Array, "B N"] | None = None  # its path log-probabilities, highest first (grow)
    # Under adaptive verification: the head's output at the last committed pair, where the next draft starts
    # (accept_verified commits the pairs; nothing is pending). None otherwise.
    feature: Float[Array, "B D"] | None = None


@dataclasses.dataclass(frozen=True)
class EagleProposer(Proposer):
    """Shared by both registrations; `version` says which head the method expects."""

    version: ClassVar[int] = 1
    drafts_dynamic_trees: ClassVar[bool] = True
    skips_drafting: ClassVar[bool] = True  # idle: the head over the pending pairs (none under adaptive verification)
    draft_kv_reads_next_token: ClassVar[bool] = True  # pair j is (f_j, x_{j+1})

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # What tells the two registrations apart follows from the head's version.
        cls.default_drafter = f"default:eagle{cls.version}"
        cls.checkpoint_kind = f"an EAGLE-{cls.version} head"
        cls.shaped_description = f"EAGLE-{cls.version} head"

    @classmethod
    def build(cls, settings: ProposerSettings, params: Any) -> EagleProposer:
        # EAGLE-3: hidden_layers are the target layers the head fuses.
        return cls(settings, tuple(params.config.fuse_layers) if isinstance(params, EagleHead) else ())

    @classmethod
    def shaped(cls, target_config: ModelConfig, draft_config: ModelConfig, model_shards: int = 1) -> EagleHead:
        """One layer as wide as the target's; EAGLE-3 with its own LM head over SHAPED_DRAFT_VOCAB ids."""
        own_vocabulary = {} if cls.version == 1 else dict(
            draft_vocab_size=min(SHAPED_DRAFT_VOCAB, target_config.vocab_size),
            fuse_layers=default_fuse_layers(target_config.num_layers))
        config = EagleConfig(layer=dataclasses.replace(target_config, num_layers=1), version=cls.version,
                             **own_vocabulary)
        return head_to_decoding_layout(benchmarking.on_device(lambda: init_eagle(config, seed=2)), model_shards)

    @classmethod
    def load(cls, folder: Path, target: Transformer, dtype: str | None, model_shards: int) -> EagleHead:
        """The head computes in the target's dtype (dtype is not used)."""
        head = load_eagle(folder, target.config, version=cls.version)
        return for_decoding(head, model_shards, convert=head_to_decoding_layout)

    @classmethod
    def recognizes(cls, folder: Path) -> bool:
        return checkpoint_version(hf.tensor_names(folder)) == cls.version

    def check(self, params: Any, target_config) -> None:
        method = self.settings.spec.method
        if not isinstance(params, EagleHead):
            raise ValueError(f"method {method!r} needs an EagleHead as drafter, got {type(params).__name__}")
        if params.config.version != self.version:
            raise ValueError(f"method {method!r} needs an EAGLE-{self.version} head, got EAGLE-{params.config.version}")
        layer = params.config.layer
        require_target_sizes("EAGLE head", target_config, hidden_size=layer.hidden_size, vocab_size=layer.vocab_size)
        bad = [i for i in params.config.fuse_layers if not 0 <= i <= target_config.num_layers]
        if bad:
            raise ValueError(f"EAGLE-3 fuse_layers {params.config.fuse_layers} name layers outside the target's "
                             f"0..{target_config.num_layers}")

    def bind(self, params: EagleHead, target: Transformer) -> EagleParams:
        ids = params.draft_to_target if params.config.version == 1 else None  # EAGLE-3's LM head is its own
        return EagleParams.bound(target, None if ids is None else ids[...], head=params)

    def logits(self, params: EagleParams, features):
        """Float32 logits over the target's vocabulary (-inf outside a draft vocabulary)."""
        logits, ids = self.draft_logits(params, features)
        return logits if ids is None else to_target_vocabulary(logits, ids, params.head.config.layer.vocab_size)

    def draft_logits(self, params: EagleParams, features):
        """(logits over the draft vocabulary, its target ids), or (logits over the target's, None) for a head
        without one: what ranks drafts, before any scatter to the target's vocabulary."""
        head = params.head
        if params.draft_lm_head is not None:  # EAGLE-1 with a draft vocabulary: the target's rows (FR-Spec)
            return params.draft_logits(features, head.config.layer.jnp_dtype), head.draft_to_target[...]
        return head.draft_logits(features, lambda f: params.target_logits(f, head.config.layer.jnp_dtype))

    def top_k_children(self, params: EagleParams, features, k: int):
        """(log-probabilities, target ids) of the head's k most likely tokens at each feature, ranked over
        the draft vocabulary where the head has one (no scatter to the target's vocabulary)."""
        logits, ids = self.draft_logits(params, features)
        return structure.top_k_log_probs(logits, k, ids)

    def new_cache(self, params: EagleParams, batch: int) -> KVCache:
        # Past the committed pairs: the pending ones, then the chain's drafts or a tree's frontier nodes.
        spec = self.settings.spec
        width = spec.num_speculative_tokens + 1
        draft_slots = width if spec.total_tokens is None else (spec.num_speculative_tokens - 1) * spec.tree_top_k
        return params.head.create_cache(batch, self.settings.cache_size + width + draft_slots, self.settings.cache_dtype)

    def extend(self, params: EagleParams, cache: KVCache, prompt: Int[Array, "B T1"], lengths: Int[Array, " B"],
               start: Int[Array, " B"], target_out: TargetOutput) -> EagleState:
        """Pairs start .. L-2 of the window go to the cache (pair j: the feature at j with token j + 1, which the
        prompt holds); pair L-1 (with the prefill's token) waits for propose."""
        head, num_draft = params.head, self.settings.spec.num_speculative_tokens
        batch, width = prompt.shape[0], num_draft + 1
        features = head.fuse(target_out.hidden)  # [B, W, D] over the window
        positions = start[:, None] + jnp.arange(features.shape[1], dtype=jnp.int32)[None, :]
        # Window pairs past a row's prompt read a clipped token: their entries lie past the fill level set below.
        next_tokens = jnp.take_along_axis(prompt, jnp.minimum(positions + 1, prompt.shape[1] - 1), axis=1)
        out, cache = head(next_tokens, features, positions, cache.with_lengths(start), params.embed)
        prompt_len = lengths - 1
        rows = jnp.arange(batch)
        pending_tokens = jnp.zeros((batch, width), jnp.int32).at[:, 0].set(prompt[rows, prompt_len])
        last = jax.tree.map(lambda x: _at_position(x, prompt_len - 1 - start, width), target_out.hidden)
        spec = self.settings.spec
        committed, pending, feature = prompt_len - 1, jnp.ones_like(lengths), None
        if spec.enable_adaptive_verification:  # the last pair (with the prefill's token) ran in the window: committed
            committed, pending = prompt_len, jnp.zeros_like(lengths)
            feature = out[rows, jnp.clip(prompt_len - 1 - start, 0, out.shape[1] - 1)]
        return EagleState(cache=cache.with_lengths(committed), committed=committed, tokens=pending_tokens,
                          hidden=last, num_pending=pending, feature=feature,
                          drafts=jnp.zeros((batch, spec.num_draft_nodes), jnp.int32),
                          parents=None if spec.total_tokens is None
                          else structure.chain_parents(batch, spec.num_draft_nodes),
                          tree_log_probs=None if spec.total_tokens is None
                          else jnp.zeros((batch, spec.num_draft_nodes), jnp.float32))

    def prefix_cache(self, state: EagleState) -> KVCache:
        return state.cache

    def commit_pending(self, params: EagleParams, state: EagleState):
        """The head over the pending pairs: (its outputs [B, W, D], the cache with them written, pairs committed)."""
        head, width = params.head, state.tokens.shape[1]
        positions = state.committed[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        out, cache = head(state.tokens, head.fuse(state.hidden), positions, state.cache.with_lengths(state.committed),
                          params.embed)
        return out, cache, state.committed + state.num_pending

    def idle(self, params: EagleParams, state: EagleState, context: Context) -> EagleState:
        """The pending pairs committed to the head's cache (one head forward over them), nothing drafted; under
        adaptive verification none are pending (accept_verified committed them)."""
        if self.settings.spec.enable_adaptive_verification:
            return state
        _, cache, committed = self.commit_pending(params, state)
        return dataclasses.replace(state, cache=cache.with_lengths(committed), committed=committed)

    def propose(self, params: EagleParams, state: EagleState, context: Context, keys: PRNGKeyArray):
        head, num_draft = params.head, self.settings.spec.num_speculative_tokens
        rows = jnp.arange(state.tokens.shape[0])
        if self.settings.spec.enable_adaptive_verification:  # accept_verified committed the pairs
            feature, cache, committed = state.feature, state.cache, state.committed
        else:
            out, cache, committed = self.commit_pending(params, state)
            feature = out[rows, state.num_pending - 1]
        if self.settings.spec.total_tokens is not None:
            drafts, parents, log_probs = self.draft_tree(params, feature, cache.with_lengths(committed))
            return drafts, None, dataclasses.replace(state, cache=cache, committed=committed, drafts=drafts,
                                                     parents=parents, tree_log_probs=log_probs)

        def draw(carry, step_key):
            return draw_draft_tokens(self.logits(params, carry[1]), step_key, self.settings, context.sampling)

        def step(carry, token):
            cache, feature = carry
            out, cache = head(token[:, None], feature[:, None], cache.lengths[:, None], cache, params.embed)
            return cache, out[:, 0]

        drafts, draft_probs, (cache, _) = draft_chain(draw, step, (cache.with_lengths(committed), feature), keys,
                                                      num_draft)
        state = dataclasses.replace(state, cache=cache, committed=committed, drafts=drafts)
        return drafts, draft_probs, state

    def draft_tree(self, params: EagleParams, feature: Float[Array, "B D"], cache):
        """A dynamic tree (module docstring; structure.grow) from the head's feature at the last committed
        pair, with the head's cache filled to the committed pairs: (node tokens [B, N], parents [B, N], path
        log-probabilities [B, N], highest first)."""
        head, spec = params.head, self.settings.spec
        committed = cache.lengths
        rows = jnp.arange(feature.shape[0])[:, None]

        def expand(carry, level, tokens, parent, sees):  # the frontier's pairs: (its parents' outputs, tokens)
            cache, outputs = carry
            features = outputs[:, None] if parent is None else outputs[rows, parent]
            features = jnp.broadcast_to(features, (*tokens.shape, features.shape[-1]))
            positions = jnp.broadcast_to((committed + level - 1)[:, None], tokens.shape)
            out, cache = head(tokens, features, positions, cache.with_lengths(committed + (level - 1) * spec.tree_top_k),
                              params.embed, attention_mask=masks.block_mask(sees, committed, cache.max_length))
            return (cache, out), *self.top_k_children(params, out, spec.tree_top_k)

        tokens, parents, _, log_probs, _ = structure.grow(*self.top_k_children(params, feature, spec.tree_top_k),
                                                           expand, (cache, feature), depth=spec.num_speculative_tokens,
                                                           total_tokens=spec.total_tokens)
        return tokens, parents, log_probs

    def tree_parents(self, state: EagleState, batch: int) -> Int[Array, "B N"] | None:
        return state.parents

    def tree_log_probs(self, state: EagleState) -> Float[Array, "B N"] | None:
        return state.tree_log_probs

    def accept(self, state: EagleState, num_accepted: Int[Array, " B"], next_token: Int[Array, " B"],
               target_out: TargetOutput) -> EagleState:
        """The verify block's positions 0..n become the pending pairs, with tokens d_1..d_n, next_token
        (after a tree, along its accepted path: the loop took the target's positions along it)."""
        rows = jnp.arange(next_token.shape[0])
        drafts, hidden = state.drafts, target_out.hidden
        if state.parents is not None:  # the path's K nodes; the loop took the target's K + 1 positions along it
            drafts = jnp.take_along_axis(drafts, jnp.maximum(target_out.path, 0), axis=1)
        tokens = jnp.concatenate([drafts, jnp.zeros_like(next_token)[:, None]], axis=1)
        tokens = tokens.at[rows, num_accepted].set(next_token)
        return dataclasses.replace(state, tokens=tokens, hidden=hidden, num_pending=num_accepted + 1)

    def accept_verified(self, params: EagleParams, state: EagleState, num_accepted: Int[Array, " B"],
                        next_token: Int[Array, " B"], target_out: TargetOutput, context: Context) -> EagleState:
        """The verify block's n + 1 pairs committed now, through one head forward over the W + 1 the branch scored
        (a window of the chosen width, not K + 1 at the next propose); its output at pair n starts the next draft."""
        head, hidden = params.head, target_out.hidden
        rows, width = jnp.arange(next_token.shape[0]), hidden.final.shape[-2]
        tokens = jnp.concatenate([state.drafts[:, :width - 1], jnp.zeros_like(next_token)[:, None]], axis=1)
        tokens = tokens.at[rows, num_accepted].set(next_token)
        positions = state.committed[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        out, cache = head(tokens, head.fuse(hidden), positions, state.cache.with_lengths(state.committed),
                          params.embed)
        committed = state.committed + num_accepted + 1
        return dataclasses.replace(state, cache=cache.with_lengths(committed), committed=committed,
                                   num_pending=jnp.zeros_like(num_accepted), feature=out[rows, num_accepted])


def _at_position(x: Array, position: Int[Array, " B"], width: int) -> Array:
    """x[..., b, position[b], :] placed at index 0 of a zero window of `width` positions, for x of
    shape [B, T, D] (final) or [N, B, T, D] (fused layers)."""
    rows = jnp.arange(position.shape[0])
    picked = x[..., rows, position, :]  # [..., B, D]
    window = jnp.zeros((*x.shape[:-2], width, x.shape[-1]), x.dtype)
    return window.at[..., 0, :].set(picked)


@register("eagle")
@dataclasses.dataclass(frozen=True)
class Eagle1Proposer(EagleProposer):
    version: ClassVar[int] = 1
    takes_draft_vocabulary: ClassVar[bool] = True

    @classmethod
    def with_draft_vocabulary(cls, drafter: EagleHead, ids) -> EagleHead:
        return with_draft_vocabulary(drafter, ids)


@register("eagle3")
@dataclasses.dataclass(frozen=True)
class Eagle3Proposer(EagleProposer):
    version: ClassVar[int] = 3
