"""Multi-token prediction drafting (`method: mtp`, vLLM's name) with the target's own MTP modules
(specjax.models.mtp: MiMo's layout, DeepSeek-V3's recursion).

Draft j (1-based) of a step comes from module j - 1 while there are modules, and from the last module,
applied to its own output, past them (a checkpoint with one module drafts K tokens by applying it K times,
as vLLM does). With n the index of the last committed token x_n (so the target's hidden states h_s are known
for s <= n - 1), module m drafts x_{n+m+1} at position n - 1 from token x_{n+m} (x_n or an earlier draft) and
the hidden state for n - 1: the target's h_{n-1} or module m - 1's output there (MTPConfig.hidden_state).

Module m's cache entry s holds token x_{s+m+1}, so module m needs entries up to s = n - 1 whose tokens include
the drafts d_1 .. d_m: entries past the committed tokens change whenever drafts are rejected. Each propose
therefore recomputes every module's last W = K + 1 entries, slots n - W .. n - 1 (the window), from the
committed tokens, this step's drafts and the target's hidden states of those slots (kept in the state), one
call per module; every entry before the window reads committed tokens only and was written correctly by an
earlier window (a step commits at most W tokens), so after any rejection the caches equal a fresh prefill of
the modules over the committed tokens (tests/test_mtp.py). vLLM instead re-prefills only the last
num_rejected - 1 tokens; the window costs W entries per module per step instead of one. The last module's
repeated steps write entries n, n + 1, ... that the next window overwrites.
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
from specjax.models import hf
from specjax.models.kv_cache import KVCache
from specjax.models.mtp import MTPConfig, MTPModules, init_mtp, load_mtp, mtp_to_decoding_layout
from specjax.models.transformer import Transformer, for_decoding, unembed
from specjax.proposers.base import Context, Proposer, TargetOutput, register, require_target_sizes
from specjax.proposers.drafting import draw_draft_tokens


@functools.partial(jax.tree_util.register_dataclass, data_fields=("modules", "embed", "lm_head"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class MTPParams:
    """The modules with the target's embedding and LM head (None when tied), which they share."""

    modules: MTPModules
    embed: Float[Array, "V D"]
    lm_head: Float[Array, "D V"] | None


@functools.partial(jax.tree_util.register_dataclass, data_fields=("cache", "hidden"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class MTPState:
    cache: KVCache  # one layer per module, laid out by position (specjax.models.mtp)
    hidden: Float[Array, "B W D"]  # the target's hidden states h_{n-W} .. h_{n-1} of the next window


@register("mtp")
@dataclasses.dataclass(frozen=True)
class MTPProposer(Proposer):
    default_drafter: ClassVar[str | None] = "default:mtp"
    checkpoint_kind: ClassVar[str] = "MTP modules (model.mtp_layers.* with num_nextn_predict_layers, MiMo's layout)"
    # mtp_hidden_state: what feeds module k > 1, 'chained' (the previous module's output, DeepSeek-V3's
    # recursion) or 'target' (the target's hidden state at every module, as MiMo was trained); null: the
    # checkpoint's default (specjax.models.mtp).
    options: ClassVar[dict[str, Any]] = {"mtp_hidden_state": (None,)}

    @classmethod
    def check_options(cls, spec: SpecConfig) -> None:
        require(spec.mtp_hidden_state in (None, "chained", "target"), "SpecConfig", "mtp_hidden_state",
                spec.mtp_hidden_state, "null (the checkpoint's), 'chained' or 'target'")

    shaped_description: ClassVar[str | None] = ("one MTP module (MiMo's layout: a Qwen2 layer as wide as the target's), "
                                                "applied K times")

    @classmethod
    def shaped(cls, target_config: ModelConfig, draft_config: ModelConfig, model_shards: int = 1) -> MTPModules:
        layer = dataclasses.replace(target_config, num_layers=1, architecture="Qwen2ForCausalLM", qkv_bias=True)
        return mtp_to_decoding_layout(benchmarking.on_device(lambda: init_mtp(MTPConfig(layer=layer), seed=4)),
                                      model_shards)

    @classmethod
    def describe(cls, spec: SpecConfig, drafter: MTPModules) -> dict:
        return {"mtp_modules": drafter.config.num_modules}  # one applied K times, or several chained

    @classmethod
    def load(cls, folder: Path, target: Transformer, dtype: str | None, model_shards: int) -> MTPModules:
        """The modules compute in the target's dtype (dtype is not used)."""
        return for_decoding(load_mtp(folder, target.config), model_shards, convert=mtp_to_decoding_layout)

    @classmethod
    def recognizes(cls, folder: Path) -> bool:
        return any(key.startswith(hf.MTP_TENSOR_PREFIX) for key in hf.tensor_names(folder))

    def check(self, params: Any, target_config) -> None:
        if not isinstance(params, MTPModules):
            raise ValueError(f"method 'mtp' needs MTPModules as drafter (a checkpoint with MTP modules), got "
                             f"{type(params).__name__}")
        layer = params.config.layer
        require_target_sizes("MTP modules", target_config, hidden_size=layer.hidden_size, vocab_size=layer.vocab_size)

    def bind(self, params: MTPModules, target: Transformer) -> MTPParams:
        return MTPParams(modules=params, embed=target.embed[...],
                         lm_head=None if target.lm_head is None else target.lm_head[...])

    def hidden_state(self, modules: MTPModules) -> str:
        return self.settings.spec.mtp_hidden_state or modules.config.hidden_state

    def logits(self, params: MTPParams, features: Float[Array, "B D"]) -> Float[Array, "B V"]:
        return unembed(features, params.embed, params.lm_head, params.modules.config.layer.jnp_dtype)

    def init(self, params: MTPParams, prompt: Int[Array, "B T1"], lengths: Int[Array, " B"],
             target_out: TargetOutput) -> MTPState:
        """Every module over the padded prompt (entries past a row's committed tokens are rewritten by the
        first window); the window's target hidden states."""
        modules, width = params.modules, self.settings.spec.num_speculative_tokens + 1
        final = target_out.hidden.final  # [B, T, D]: h_s at s
        batch = final.shape[0]
        cache = modules.create_cache(batch, self.settings.cache_size + 2 * width, self.settings.cache_dtype)
        _, cache = modules.over_sequence(prompt, final, params.embed, self.hidden_state(modules), cache)
        n = lengths - 1
        window = jnp.clip(n[:, None] - width + jnp.arange(width)[None, :], 0, final.shape[1] - 1)
        return MTPState(cache=cache, hidden=jnp.take_along_axis(final, window[..., None], axis=1))

    def propose(self, params: MTPParams, state: MTPState, context: Context, keys: PRNGKeyArray):
        modules, settings = params.modules, self.settings
        num_draft, num_modules = settings.spec.num_speculative_tokens, modules.config.num_modules
        width = num_draft + 1
        rows = jnp.arange(context.lengths.shape[0])
        n = context.lengths - 1  # the last committed token's index
        start = jnp.maximum(n - width, 0)  # short rows: the window runs past n - 1, those entries are rewritten later
        slots = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]  # [B, W], also the positions
        kept = jnp.clip(slots - (n[:, None] - width), 0, width - 1)  # slot s is state.hidden[:, s - (n - W)]
        target_hidden = jnp.take_along_axis(state.hidden, kept[..., None], axis=1)
        query = n - 1 - start  # the window index of slot n - 1
        step_keys = jax.vmap(lambda key: jax.random.split(key, num_draft))(keys).swapaxes(0, 1)  # [K, B]
        chained = self.hidden_state(modules) == "chained"

        cache, previous, drafts, probs = state.cache, target_hidden, [], []
        for module in range(min(num_draft, num_modules)):
            index = slots + module + 1  # the token of module's entry s: x_{s + module + 1}
            tokens = jnp.take_along_axis(context.tokens, jnp.clip(index, 0, context.tokens.shape[1] - 1), axis=1)
            if drafts:  # past the committed tokens: this step's drafts d_1 .. d_module
                drafted = jnp.stack(drafts, axis=1)
                from_drafts = jnp.take_along_axis(drafted, jnp.clip(index - n[:, None] - 1, 0, len(drafts) - 1), 1)
                tokens = jnp.where(index <= n[:, None], tokens, from_drafts)
            fed = previous if chained and module > 0 else target_hidden
            previous, cache = modules(module, tokens, fed, slots, cache.with_lengths(start), params.embed)
            token, token_probs = draw_draft_tokens(self.logits(params, previous[rows, query]), step_keys[module],
                                                   settings, context.sampling)
            drafts.append(token)
            probs.append(token_probs)

        if num_draft > num_modules:  # the last module applied to its own output, at slots n, n + 1, ...
            last = num_modules - 1

            def repeat(carry, step_key):
                cache, feature, token = carry
                out, cache = modules(last, token[:, None], feature[:, None], cache.lengths[:, None], cache,
                                     params.embed)
                token, token_probs = draw_draft_tokens(self.logits(params, out[:, 0]), step_key, settings,
                                                       context.sampling)
                return (cache, out[:, 0], token), (token, token_probs)

            carry = (cache.with_lengths(n), previous[rows, query], drafts[-1])
            (cache, _, _), (tokens, more_probs) = jax.lax.scan(repeat, carry, step_keys[num_modules:])
            drafts.extend(list(tokens))
            if more_probs is not None:
                probs.extend(list(more_probs))
        draft_probs = None if probs[0] is None else jnp.stack(probs, axis=1)  # [B, K, V]
        return jnp.stack(drafts, axis=1), draft_probs, dataclasses.replace(state, cache=cache)

    def accept(self, state: MTPState, num_accepted: Int[Array, " B"], next_token: Int[Array, " B"],
               target_out: TargetOutput) -> MTPState:
        """The next window's target hidden states: the kept ones, then the verify block's h_n .. h_{n+K}, shifted
        by the n + 1 committed tokens."""
        width = state.hidden.shape[1]
        combined = jnp.concatenate([state.hidden, target_out.hidden.final.astype(state.hidden.dtype)], axis=1)
        index = num_accepted[:, None] + 1 + jnp.arange(width)[None, :]
        return dataclasses.replace(state, hidden=jnp.take_along_axis(combined, index[..., None], axis=1))
