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

Dynamic trees (EAGLE-2; SpecConfig.total_tokens, tree_top_k; specjax.trees.structure.grow): a node at depth d (its
token a candidate for x_{n+d}) ranks its children with module m = min(d, M - 1) (M modules), along its own
path p_1 .. p_d. While d < M, module d runs at the path's d slots n - d .. n - 1 (its entry s reads
x_{s+d+1}: the path's tokens), fed the target's hidden states there or, chained, module d - 1's outputs
along the same path (the window's at slot n - d, whose token x_n is committed, then the parent's own
run); past the modules the last one runs at slot n + d - M on the node's token, fed its parent's output,
as the chain repeats it. Each module writes its nodes' entries after its committed ones (slot n - m on), in
a region of its own cache layer, each entry seeing the committed entries, its own path's entries and, in
the last module, its ancestors': with tree_top_k 1 the tree is the chain (tests/test_mtp_layouts.py). The
region overwrites slots up to n - m + (K - 1) * tree_top_k, so the window is W = K + min(K, M) entries (the
next one reaches back past every slot a tree wrote), and accept needs only the path's hidden states.
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
from specjax.models.mtp import MTPConfig, MTPModules, init_mtp, layout_of, load_mtp, mtp_to_decoding_layout
from specjax.models.transformer import Transformer, for_decoding, unembed
from specjax.proposers.base import Context, Proposer, TargetOutput, register, require_target_sizes
from specjax.proposers.drafting import draw_draft_tokens
from specjax.trees import masks, structure


@functools.partial(jax.tree_util.register_dataclass, data_fields=("modules", "embed", "lm_head"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class MTPParams:
    """The modules with the target's embedding and LM head (None when tied), which they share."""

    modules: MTPModules
    embed: Float[Array, "V D"]
    lm_head: Float[Array, "D V"] | None


@functools.partial(jax.tree_util.register_dataclass, data_fields=("cache", "hidden", "parents", "tree_log_probs"),
                   meta_fields=())
@dataclasses.dataclass(frozen=True)
class MTPState:
    cache: KVCache  # one layer per module, laid out by position (specjax.models.mtp)
    hidden: Float[Array, "B W D"]  # the target's hidden states h_{n-W} .. h_{n-1} of the next window
    parents: Int[Array, "B N"] | None = None  # the last dynamic tree's parents; None for chains
    tree_log_probs: Float[Array, "B N"] | None = None  # its path log-probabilities, highest first (grow)


@register("mtp")
@dataclasses.dataclass(frozen=True)
class MTPProposer(Proposer):
    default_drafter: ClassVar[str | None] = "default:mtp"
    checkpoint_kind: ClassVar[str] = ("MTP modules (num_nextn_predict_layers with model.mtp_layers.*, MiMo's layout, "
                                      "or model.layers.{num_hidden_layers + k}.eh_proj etc., DeepSeek-V3's)")
    drafts_dynamic_trees: ClassVar[bool] = True
    skips_drafting: ClassVar[bool] = True  # idle: the modules over the window, without the drafts' LM heads
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
        shared = (target.embed[...], None if target.lm_head is None else target.lm_head[...])
        return for_decoding(load_mtp(folder, target.config, shared), model_shards, convert=mtp_to_decoding_layout)

    @classmethod
    def recognizes(cls, folder: Path) -> bool:
        return layout_of(folder, hf.config_json_or_empty(folder)) is not None

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
        modules, spec, width = params.modules, self.settings.spec, self.window(params.modules)
        final = target_out.hidden.final  # [B, T, D]: h_s at s
        batch = final.shape[0]
        tree = spec.total_tokens is not None
        tree_slots = (spec.num_speculative_tokens - 1) * spec.tree_top_k if tree else 0
        cache = modules.create_cache(batch, self.settings.cache_size + 2 * width + tree_slots, self.settings.cache_dtype)
        _, cache = modules.over_sequence(prompt, final, params.embed, self.hidden_state(modules), cache)
        n = lengths - 1
        window = jnp.clip(n[:, None] - width + jnp.arange(width)[None, :], 0, final.shape[1] - 1)
        nodes = jnp.zeros((batch, spec.num_draft_nodes), jnp.int32)
        return MTPState(cache=cache, hidden=jnp.take_along_axis(final, window[..., None], axis=1),
                        parents=structure.chain_parents(batch, spec.num_draft_nodes) if tree else None,
                        tree_log_probs=nodes.astype(jnp.float32) if tree else None)

    def window(self, modules: MTPModules) -> int:
        """W, the entries each propose recomputes per module: K + 1 for chains, K + min(K, M) for trees
        (module docstring)."""
        num_draft = self.settings.spec.num_speculative_tokens
        extra = min(num_draft, modules.config.num_modules) - 1 if self.settings.spec.total_tokens is not None else 0
        return num_draft + 1 + extra

    def window_slots(self, state: MTPState, context: Context):
        """(n, the last committed token's index; start; the window's slots [B, W], also its positions; the target
        hidden state of each slot) of the entries a propose recomputes."""
        width = state.hidden.shape[1]
        n = context.lengths - 1
        start = jnp.maximum(n - width, 0)  # short rows: the window runs past n - 1, those entries are rewritten later
        slots = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        kept = jnp.clip(slots - (n[:, None] - width), 0, width - 1)  # slot s is state.hidden[:, s - (n - W)]
        return n, start, slots, jnp.take_along_axis(state.hidden, kept[..., None], axis=1)

    def idle(self, params: MTPParams, state: MTPState, context: Context) -> MTPState:
        """The window's entries recomputed by every module a propose runs, nothing drafted: each entry is computed
        again, from committed tokens, while it is in the window (an entry whose token is not committed yet holds
        whatever the context has there until then, as after a propose it holds a draft's)."""
        modules = params.modules
        n, start, slots, target_hidden = self.window_slots(state, context)
        cache, previous = state.cache, target_hidden
        chained = self.hidden_state(modules) == "chained"
        for module in range(min(self.settings.spec.num_speculative_tokens, modules.config.num_modules)):
            index = jnp.clip(slots + module + 1, 0, context.tokens.shape[1] - 1)
            tokens = jnp.take_along_axis(context.tokens, index, axis=1)
            fed = previous if chained and module > 0 else target_hidden
            _, previous, cache = modules(module, tokens, fed, slots, cache.with_lengths(start), params.embed)
        return dataclasses.replace(state, cache=cache)

    def propose(self, params: MTPParams, state: MTPState, context: Context, keys: PRNGKeyArray):
        modules, settings = params.modules, self.settings
        num_draft, num_modules = settings.spec.num_speculative_tokens, modules.config.num_modules
        tree = settings.spec.total_tokens is not None
        rows = jnp.arange(context.lengths.shape[0])
        n, start, slots, target_hidden = self.window_slots(state, context)
        query = n - 1 - start  # the window index of slot n - 1
        step_keys = jax.vmap(lambda key: jax.random.split(key, num_draft))(keys).swapaxes(0, 1)  # [K, B]
        chained = self.hidden_state(modules) == "chained"

        cache, previous, drafts, probs, window_feeds = state.cache, target_hidden, [], [], []
        for module in range(min(num_draft, num_modules)):
            index = slots + module + 1  # the token of module's entry s: x_{s + module + 1}
            tokens = jnp.take_along_axis(context.tokens, jnp.clip(index, 0, context.tokens.shape[1] - 1), axis=1)
            if drafts:  # past the committed tokens: this step's drafts d_1 .. d_module
                drafted = jnp.stack(drafts, axis=1)
                from_drafts = jnp.take_along_axis(drafted, jnp.clip(index - n[:, None] - 1, 0, len(drafts) - 1), 1)
                tokens = jnp.where(index <= n[:, None], tokens, from_drafts)
            fed = previous if chained and module > 0 else target_hidden
            out, previous, cache = modules(module, tokens, fed, slots, cache.with_lengths(start), params.embed)
            window_feeds.append(previous)
            if tree:  # the tree reads the window's committed entries only; the root's children come from module 0
                root = out[rows, query] if module == 0 else root
                continue
            token, token_probs = draw_draft_tokens(self.logits(params, out[rows, query]), step_keys[module],
                                                   settings, context.sampling)
            drafts.append(token)
            probs.append(token_probs)
        if tree:
            drafts, parents, log_probs = self.draft_tree(params, root, window_feeds, target_hidden, cache, n, start)
            return drafts, None, dataclasses.replace(state, cache=cache, parents=parents, tree_log_probs=log_probs)

        if num_draft > num_modules:  # the last module applied to its own output, at slots n, n + 1, ...
            last = num_modules - 1

            def repeat(carry, step_key):
                cache, feature, token = carry
                out, feature, cache = modules(last, token[:, None], feature[:, None], cache.lengths[:, None], cache,
                                              params.embed)
                token, token_probs = draw_draft_tokens(self.logits(params, out[:, 0]), step_key, settings,
                                                       context.sampling)
                return (cache, feature[:, 0], token), (token, token_probs)

            carry = (cache.with_lengths(n), previous[rows, query], drafts[-1])
            (cache, _, _), (tokens, more_probs) = jax.lax.scan(repeat, carry, step_keys[num_modules:])
            drafts.extend(list(tokens))
            if more_probs is not None:
                probs.extend(list(more_probs))
        draft_probs = None if probs[0] is None else jnp.stack(probs, axis=1)  # [B, K, V]
        return jnp.stack(drafts, axis=1), draft_probs, dataclasses.replace(state, cache=cache)

    def top_k_children(self, params: MTPParams, features: Float[Array, "... D"]):
        return structure.top_k_log_probs(self.logits(params, features), self.settings.spec.tree_top_k)

    def draft_tree(self, params: MTPParams, root: Float[Array, "B D"], window_feeds: list, target_hidden, cache: KVCache,
                   n: Int[Array, " B"], start: Int[Array, " B"]):
        """A dynamic tree (module docstring; structure.grow) from module 0's output at slot n - 1 (root), with
        the window's chained outputs of each module (window_feeds[m], [B, W, D], slot s at s - start) and the
        target's hidden states there: (node tokens [B, N], parents [B, N], path log-probabilities [B, N])."""
        modules, spec = params.modules, self.settings.spec
        num_modules, top_k, last = modules.config.num_modules, spec.tree_top_k, modules.config.num_modules - 1
        chained = self.hidden_state(modules) == "chained"
        batch = n.shape[0]
        rows = jnp.arange(batch)[:, None]

        def at_slots(window, slots):  # window [B, W, D] at slots [B, T] -> [B, T, D]
            return jnp.take_along_axis(window, jnp.clip(slots - start[:, None], 0, window.shape[1] - 1)[..., None], 1)

        def expand(carry, level, tokens, parent, sees):
            cache, paths, feeds = carry  # the previous frontier's path tokens [B, k', d-1] and outputs [B, k', E, D]
            if parent is not None:
                paths, feeds = paths[rows, parent], feeds[rows, parent]
            paths = jnp.concatenate([jnp.broadcast_to(paths, (*tokens.shape, level - 1)), tokens[..., None]], -1)
            feeds = jnp.broadcast_to(feeds, (*tokens.shape, *feeds.shape[2:]))
            if level < num_modules:  # module `level` over the path's slots n - level .. n - 1, one group per node
                module, region = level, jnp.maximum(n - level, 0)
                slots = n[:, None] - level + jnp.arange(level)[None, :]  # [B, level]
                if chained:  # module level - 1's outputs there: the window's at n - level, then the parent's
                    fed = jnp.concatenate([jnp.broadcast_to(at_slots(window_feeds[level - 1], slots[:, :1])[:, None],
                                                            (*tokens.shape, 1, root.shape[-1])), feeds], axis=2)
                else:
                    fed = jnp.broadcast_to(at_slots(target_hidden, slots)[:, None], (*tokens.shape, level, root.shape[-1]))
                valid = slots >= 0  # a short row's path reaches before slot 0: those entries are seen by none
                own = jnp.tril(jnp.ones((level, level), bool))[None] & (valid[:, None, :] | jnp.eye(level, dtype=bool))
                mask = jnp.einsum("jk,bts->bjtks", jnp.eye(top_k), own.astype(jnp.float32)) > 0
                mask = mask.reshape(batch, top_k * level, top_k * level)
                positions = jnp.broadcast_to(jnp.maximum(slots, 0)[:, None], (*tokens.shape, level))
                entry_tokens = paths
            else:  # the last module at slot n + level - M on the node's token, fed its parent's output
                module, region = last, jnp.maximum(n - last, 0)
                fed = feeds[:, :, -1:] if feeds.shape[2] else jnp.broadcast_to(root_feed[:, None, None],
                                                                               (*tokens.shape, 1, root.shape[-1]))
                mask = sees  # the tree's draft slots, as grow lays them out: level l's node j at (l - 1) k + j
                if last > 0:  # ... less the modules before the last: the depth M - 1 ancestor's group is there
                    group = jnp.repeat(sees[:, :, (last - 1) * top_k:last * top_k], last, axis=-1)
                    group_valid = jnp.tile(n[:, None] - last + jnp.arange(last)[None, :] >= 0, (1, top_k))
                    mask = jnp.concatenate([group & group_valid[:, None, :], sees[:, :, last * top_k:]], axis=-1)
                region_offset = (level - 1) * top_k
                positions = jnp.broadcast_to((n + level - num_modules)[:, None, None], (*tokens.shape, 1))
                entry_tokens = tokens[..., None]
            entries = entry_tokens.shape[-1]
            write_at = region + (0 if level < num_modules else region_offset)
            out, chain_out, cache = modules(
                module, entry_tokens.reshape(batch, -1), fed.reshape(batch, -1, fed.shape[-1]),
                positions.reshape(batch, -1), cache.with_lengths(write_at), params.embed,
                attention_mask=masks.block_mask(mask, region, cache.max_length))
            out = out.reshape(batch, top_k, entries, -1)
            carry = (cache, paths, chain_out.reshape(batch, top_k, entries, -1))
            return carry, *self.top_k_children(params, out[:, :, -1])

        root_feed = at_slots(window_feeds[0], (n - 1)[:, None])[:, 0]  # module 0's chained output at slot n - 1
        carry = (cache, jnp.zeros((batch, 1, 0), jnp.int32), jnp.zeros((batch, 1, 0, root.shape[-1]), root.dtype))
        tokens, parents, _, log_probs, _ = structure.grow(*self.top_k_children(params, root), expand, carry,
                                                           depth=spec.num_speculative_tokens,
                                                           total_tokens=spec.total_tokens)
        return tokens, parents, log_probs

    def tree_parents(self, state: MTPState, batch: int) -> Int[Array, "B N"] | None:
        return state.parents

    def tree_log_probs(self, state: MTPState) -> Float[Array, "B N"] | None:
        return state.tree_log_probs

    def accept(self, state: MTPState, num_accepted: Int[Array, " B"], next_token: Int[Array, " B"],
               target_out: TargetOutput) -> MTPState:
        """The next window's target hidden states: the kept ones, then the verify block's h_n .. h_{n+K}, shifted
        by the n + 1 committed tokens."""
        width = state.hidden.shape[1]
        combined = jnp.concatenate([state.hidden, target_out.hidden.final.astype(state.hidden.dtype)], axis=1)
        index = num_accepted[:, None] + 1 + jnp.arange(width)[None, :]
        return dataclasses.replace(state, hidden=jnp.take_along_axis(combined, index[..., None], axis=1))
