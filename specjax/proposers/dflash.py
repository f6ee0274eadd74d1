"""DFlash block drafting (`method: dflash`): one drafter forward drafts all K tokens.

The drafter's cache holds one context feature per committed token but the last (its keys and values
in every layer: specjax.models.dflash). After a verify step the features of the verify block's
positions 0..n (the last committed token and the n accepted drafts) are pending; the next propose
writes them as a fixed window of K + 1 at the row's fill level, of which the first n + 1 count (under
adaptive verification the step's accept writes the W + 1 it scored instead, W its chosen width), then
runs the block [last committed token, M mask tokens] at the slots after them, non-causally, which
also overwrites the window's unused part (M = K, or block_size - 1 with SpecConfig.dflash_full_block, by
default where K + 1 < block_size, of which the first K drafts are proposed). The block's own keys and
values are dropped by resetting the fill level. The block's slot i (i >= 1) gives draft i; the drafts are
drawn independently, each from its slot's distribution, which is what the verifier's draft_probs are.
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
from specjax.config import ModelConfig, SpecConfig, require
from specjax.models.dflash import (ARCHITECTURE, DFlashConfig, DFlashDrafter, check_target, default_target_layer_ids,
                                   drafter_to_decoding_layout, init_dflash, load_dflash, with_draft_vocabulary)
from specjax.models import hf
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Hidden, Transformer, for_decoding
from specjax.proposers.base import (Context, Proposer, ProposerSettings, TargetOutput, UnsupportedSpeculation,
                                    register)
from specjax.proposers.drafting import TargetHeadParams, draw_draft_tokens


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("drafter", "embed", "lm_head", "draft_lm_head"), meta_fields=())
@dataclasses.dataclass(frozen=True, kw_only=True)
class DFlashParams(TargetHeadParams):
    """The drafter with the target's unembedding it drafts through (TargetHeadParams: FR-Spec's rows too)."""

    drafter: DFlashDrafter


@functools.partial(jax.tree_util.register_dataclass, data_fields=("cache", "pending", "num_pending"),
                   meta_fields=())
@dataclasses.dataclass(frozen=True)
class DFlashState:
    cache: KVCache  # context features' keys and values of the committed tokens but the pending ones
    pending: Hidden  # the target's hidden states of the pending window of W = K + 1 positions
    num_pending: Int[Array, " B"]  # how many of the window's positions are committed tokens


def drafts_full_block(spec: SpecConfig, block_size: int, first_draft_slot: int = 1) -> bool:
    """Whether a block drafter of block_size drafts its whole block: spec.dflash_full_block, or where None
    (auto) where the slots K drafts need (K + first_draft_slot) are fewer than the block (DFlashProposer.options
    says why)."""
    if spec.dflash_full_block is not None:
        return spec.dflash_full_block
    return spec.num_speculative_tokens + first_draft_slot < block_size


@register("dflash")
@dataclasses.dataclass(frozen=True)
class DFlashProposer(Proposer):
    default_drafter: ClassVar[str | None] = "default:dflash"
    checkpoint_kind: ClassVar[str] = "a DFlash drafter"
    takes_draft_vocabulary: ClassVar[bool] = True
    skips_drafting: ClassVar[bool] = True  # idle writes the pending features, the block's first act
    drafts_to_width: ClassVar[bool] = True  # the block is drafted whole, its LM head only over the verified drafts
    # dflash_full_block: whether the drafter drafts its whole trained block (null: auto, the whole block where
    # K + 1 is smaller than it). True: it runs its whole trained block (block_size - 1 mask positions) and
    # proposes the first K drafts. False: the anchor and K mask positions (vLLM's meaning of
    # num_speculative_tokens for DFlash). A drafter trained on full blocks attends over a shorter block it
    # never saw and drafts worse there (docs/performance.md, "Acceptance: DFlash on the default models",
    # measures what each costs and accepts); set False where a step's cost grows with the block (large batches).
    options: ClassVar[dict[str, Any]] = {"dflash_full_block": (None, False)}

    @classmethod
    def check_options(cls, spec: SpecConfig) -> None:
        require(spec.dflash_full_block is None or isinstance(spec.dflash_full_block, bool), "SpecConfig",
                "dflash_full_block", spec.dflash_full_block, "null (auto), true or false")

    # The shaped drafter (speed tables): z-lab's for 8B targets, layers as wide as the target's.
    shaped_description: ClassVar[str | None] = "DFlash drafter (5 layers, block 16, as z-lab's for 8B targets)"
    SHAPED_LAYERS, SHAPED_BLOCK = 5, 16

    @classmethod
    def shaped(cls, target_config: ModelConfig, draft_config: ModelConfig, model_shards: int = 1) -> DFlashDrafter:
        layers = min(cls.SHAPED_LAYERS, target_config.num_layers)
        config = DFlashConfig(
            layer=dataclasses.replace(target_config, num_layers=layers, qk_norm=True, architecture="Qwen3ForCausalLM"),
            target_layer_ids=default_target_layer_ids(target_config.num_layers, layers),
            mask_token_id=target_config.vocab_size - 1, block_size=cls.SHAPED_BLOCK,
            num_target_layers=target_config.num_layers)
        return drafter_to_decoding_layout(benchmarking.on_device(lambda: init_dflash(config, seed=3)), model_shards)

    @classmethod
    def describe(cls, spec: SpecConfig, drafter: DFlashDrafter) -> dict:
        return {"dflash_full_block": drafts_full_block(spec, drafter.config.block_size, drafter.config.first_draft_slot)}

    @classmethod
    def build(cls, settings: ProposerSettings, params: Any) -> DFlashProposer:
        # hidden_layers: the target layers whose outputs make the context features.
        return cls(settings, params.config.hidden_layers if isinstance(params, DFlashDrafter) else ())

    # The config.json architecture of its checkpoints, and their reader (a subclass's drafter reads its own).
    architecture: ClassVar[str] = ARCHITECTURE
    read_checkpoint: ClassVar = staticmethod(load_dflash)

    @classmethod
    def load(cls, folder: Path, target: Transformer, dtype: str | None, model_shards: int) -> DFlashDrafter:
        """The drafter computes in the target's dtype (dtype is not used)."""
        drafter = cls.read_checkpoint(folder, target.config, target.config.dtype)
        return for_decoding(drafter, model_shards, convert=drafter_to_decoding_layout)

    @classmethod
    def recognizes(cls, folder: Path) -> bool:
        return hf.config_json_or_empty(folder).get("architectures") == [cls.architecture]

    def check(self, params: Any, target_config) -> None:
        if not isinstance(params, DFlashDrafter):
            raise ValueError(f"method 'dflash' needs a DFlashDrafter as drafter, got {type(params).__name__}")
        self.check_block(params, target_config)

    def check_block(self, drafter: DFlashDrafter, target_config) -> None:
        """The target's sizes, and K inside the block."""
        check_target(drafter.config, target_config)
        num_draft, block_size = self.settings.spec.num_speculative_tokens, drafter.config.block_size
        most = block_size - drafter.config.first_draft_slot
        if num_draft > most:
            raise UnsupportedSpeculation(
                f"SpecConfig.num_speculative_tokens = {num_draft} is more than this drafter's block holds: "
                f"allowed 1..{most} (block_size{' - 1' if most < block_size else ''})")

    def num_masks(self, drafter: DFlashDrafter) -> int:
        """Mask positions of the drafted block: those K drafts need, or the drafter's whole block
        (dflash_full_block True, or None where K drafts need fewer slots: DFlashProposer.options says why)."""
        spec, block_size, first = self.settings.spec, drafter.config.block_size, drafter.config.first_draft_slot
        full = drafts_full_block(spec, block_size, first)
        return block_size - 1 if full else spec.num_speculative_tokens + first - 1

    def bind(self, params: DFlashDrafter, target: Transformer) -> DFlashParams:
        ids = params.draft_to_target
        return DFlashParams.bound(target, None if ids is None else ids[...], drafter=params)

    @classmethod
    def with_draft_vocabulary(cls, drafter: DFlashDrafter, ids) -> DFlashDrafter:
        return with_draft_vocabulary(drafter, ids)

    def new_cache(self, params: DFlashParams, batch: int) -> KVCache:
        width = self.settings.spec.num_speculative_tokens + 1
        room = max(width, self.num_masks(params.drafter) + 1)  # for the pending window and for the block
        return params.drafter.create_cache(batch, self.settings.cache_size + room, self.settings.cache_dtype)

    def extend(self, params: DFlashParams, cache: KVCache, prompt: Int[Array, "B T1"], lengths: Int[Array, " B"],
               start: Int[Array, " B"], target_out: TargetOutput) -> DFlashState:
        """The window's features go to the cache (position j's depends on the target's hidden state at j
        only); the prompt's lengths - 1 of them count (the prefill's token is the first anchor); nothing is
        pending."""
        drafter, width = params.drafter, self.settings.spec.num_speculative_tokens + 1
        hidden = target_out.hidden  # over the window
        positions = start[:, None] + jnp.arange(hidden.final.shape[1], dtype=jnp.int32)[None, :]
        cache = drafter.write_context(drafter.context(hidden), positions, cache.with_lengths(start))
        pending = jax.tree.map(lambda x: jnp.zeros((*x.shape[:-2], width, x.shape[-1]), x.dtype), hidden)
        return DFlashState(cache=cache.with_lengths(lengths - 1), pending=pending, num_pending=jnp.zeros_like(lengths))

    def prefix_cache(self, state: DFlashState) -> KVCache:
        return state.cache

    def propose(self, params: DFlashParams, state: DFlashState, context: Context, keys: PRNGKeyArray):
        hidden, state = self.draft_block(params, state, context)
        num_draft, settings = self.settings.spec.num_speculative_tokens, self.settings
        slot_keys = jax.vmap(lambda key: jax.random.split(key, num_draft))(keys)  # [B, K]
        # The LM head over the drafts the step verifies only (at a large batch it is most of a narrow width's step);
        # zeros past them.
        count = num_draft if context.verified is None else max(context.verified, 1)
        logits = self.logits(params, hidden[:, :count])  # [B, count, V]
        drawn = jax.vmap(lambda lg, k: draw_draft_tokens(lg, k, settings, context.sampling), in_axes=(1, 1),
                         out_axes=(1, 1))(logits, slot_keys[:, :count])
        drafts, draft_probs = jax.tree.map(
            lambda x: jnp.pad(x, [(0, num_draft - count if a == 1 else 0) for a in range(x.ndim)]), drawn)
        return drafts, draft_probs, state

    def draft_block(self, params: DFlashParams, state: DFlashState,
                    context: Context) -> tuple[Float[Array, "B K D"], DFlashState]:
        """One drafter forward over the block: the final hidden states of the K slots that draft (from
        config.first_draft_slot on), and the state with the pending features written, none pending."""
        drafter = params.drafter
        num_draft = self.settings.spec.num_speculative_tokens
        rows = jnp.arange(context.lengths.shape[0])
        anchor_slot = context.lengths - 1  # the last committed token's position; its feature is not known yet
        cache = self.idle(params, state, context).cache  # the window's unused part is overwritten by the block
        block_offsets = jnp.arange(self.num_masks(drafter) + 1, dtype=jnp.int32)[None, :]
        block = jnp.full((rows.shape[0], block_offsets.shape[1]), drafter.config.mask_token_id, jnp.int32)
        block = block.at[:, 0].set(context.tokens[rows, anchor_slot])
        hidden, cache = drafter(block, anchor_slot[:, None] + block_offsets, cache, params.embed)
        first = drafter.config.first_draft_slot
        state = dataclasses.replace(state, cache=cache.with_lengths(anchor_slot),  # the block's entries dropped
                                    num_pending=jnp.zeros_like(state.num_pending))
        return hidden[:, first:first + num_draft], state

    def idle(self, params: DFlashParams, state: DFlashState, context: Context) -> DFlashState:
        """The pending features (the last step's committed positions) written to the cache, none pending."""
        drafter, width = params.drafter, self.settings.spec.num_speculative_tokens + 1
        anchor_slot = context.lengths - 1
        done = dataclasses.replace(state, num_pending=jnp.zeros_like(state.num_pending))
        if self.settings.spec.enable_adaptive_verification:  # accept_verified wrote them: nothing is pending
            return dataclasses.replace(done, cache=state.cache.with_lengths(anchor_slot))
        # Rows that finished keep their committed length, so their cache stays inside its slots.
        cache = state.cache.with_lengths(anchor_slot - state.num_pending)
        positions = cache.lengths[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        cache = drafter.write_context(drafter.context(state.pending), positions, cache)
        return dataclasses.replace(done, cache=cache.with_lengths(anchor_slot))

    def logits(self, params: DFlashParams, hidden: Float[Array, "B K D"]) -> Float[Array, "B K V"]:
        """The drafts' logits through the target's LM head; with a draft vocabulary (FR-Spec), through its
        rows only, -inf at every other id."""
        layer, ids = params.drafter.config.layer, params.drafter.draft_to_target
        return params.logits(hidden, layer.jnp_dtype, None if ids is None else ids[...], layer.vocab_size)

    def accept(self, state: DFlashState, num_accepted: Int[Array, " B"], next_token: Int[Array, " B"],
               target_out: TargetOutput) -> DFlashState:
        """The verify block's positions 0..n (the last committed token and the accepted drafts) are pending."""
        return dataclasses.replace(state, pending=target_out.hidden, num_pending=num_accepted + 1)

    def accept_verified(self, params: DFlashParams, state: DFlashState, num_accepted: Int[Array, " B"],
                        next_token: Int[Array, " B"], target_out: TargetOutput, context: Context) -> DFlashState:
        """The verify block's positions 0..n written now, from the W + 1 the branch scored: a window of the chosen
        width rather than K + 1 at the next propose, and no conditional for the steps of width 0 (one position)."""
        drafter, start = params.drafter, context.lengths - 1  # the block's first position: the last committed token
        hidden = target_out.hidden
        positions = start[:, None] + jnp.arange(hidden.final.shape[-2], dtype=jnp.int32)[None, :]
        cache = drafter.write_context(drafter.context(hidden), positions, state.cache.with_lengths(start))
        return dataclasses.replace(state, cache=cache.with_lengths(start + num_accepted + 1),
                                   num_pending=jnp.zeros_like(state.num_pending))
