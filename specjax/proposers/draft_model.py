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
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from specjax import benchmarking
from specjax.config import ConfigError, ModelConfig, SpecConfig
from specjax.models import hf
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Transformer, for_decoding, init_model, to_decoding_layout
from specjax.proposers.base import Context, Proposer, TargetOutput, UnsupportedSpeculation, register
from specjax.proposers.drafting import draft_chain, draw_draft_tokens
from specjax.proposers.heterogeneous import HeterogeneousDraft
from specjax.trees import masks, structure


@functools.partial(jax.tree_util.register_dataclass, data_fields=("cache", "parents", "slots", "tree_log_probs"),
                   meta_fields=())
@dataclasses.dataclass(frozen=True)
class DraftModelState:
    cache: KVCache
    # A dynamic tree's: each node's parent, and its draft-cache slot after the root's (-1: never run).
    parents: Int[Array, "B N"] | None = None
    slots: Int[Array, "B N"] | None = None
    tree_log_probs: Float[Array, "B N"] | None = None  # its path log-probabilities, highest first (grow)


@register("draft_model")
@dataclasses.dataclass(frozen=True)
class DraftModelProposer(Proposer):
    default_drafter: ClassVar[str | None] = "default:draft"
    checkpoint_kind: ClassVar[str] = "a draft model (a Hugging Face LM)"
    drafts_trees: ClassVar[bool] = True
    drafts_dynamic_trees: ClassVar[bool] = True
    skips_drafting: ClassVar[bool] = True  # idle: the two-token window, a fraction of a propose
    # use_heterogeneous_vocab: draft and target with different tokenizers (vLLM's TLI; a HeterogeneousDraft):
    # greedy drafting only.
    options: ClassVar[dict[str, Any]] = {"use_heterogeneous_vocab": (False,)}

    @classmethod
    def check_options(cls, spec: SpecConfig) -> None:
        if spec.use_heterogeneous_vocab and spec.draft_sample_method != "greedy":
            raise ConfigError(
                f"SpecConfig.use_heterogeneous_vocab = True with method {spec.method!r} and draft_sample_method "
                f"{spec.draft_sample_method!r} is invalid: allowed only with method 'draft_model' and "
                "draft_sample_method 'greedy'")

    shaped_description: ClassVar[str | None] = "Llama-3.2-1B-shaped draft LM"

    @classmethod
    def shaped(cls, target_config: ModelConfig, draft_config: ModelConfig, model_shards: int = 1) -> Transformer:
        return to_decoding_layout(benchmarking.on_device(lambda: init_model(draft_config, seed=1)), model_shards)

    @classmethod
    def load(cls, folder: Path, target: Transformer, dtype: str | None, model_shards: int) -> Transformer:
        return for_decoding(hf.load(folder, dtype=dtype), model_shards)

    @classmethod
    def recognizes(cls, folder: Path) -> bool:
        """An LM of a supported architecture: its embedding among the tensors (EAGLE heads say
        LlamaForCausalLM too, but carry no `model.` embedding), without MTP modules (method mtp's)."""
        raw = hf.config_json_or_empty(folder)
        names = hf.tensor_names(folder)
        return (raw.get("architectures") or [None])[0] in hf.SUPPORTED_ARCHITECTURES and any(
            name.endswith(("model.embed_tokens.weight", "wte.weight")) for name in names) and not hf.mtp_tensor_names(
            names, raw)

    def check(self, params, target_config) -> None:
        tree, spec = self.settings.spec.speculative_token_tree, self.settings.spec
        if spec.total_tokens is not None and spec.use_heterogeneous_vocab:
            raise UnsupportedSpeculation("a draft model drafts dynamic trees (total_tokens) with one vocabulary: "
                                         "use_heterogeneous_vocab is allowed with chains only")
        if tree is not None:
            if spec.use_heterogeneous_vocab or spec.draft_sample_method != "greedy":
                raise UnsupportedSpeculation("a draft model drafts speculative_token_tree with draft_sample_method "
                                             "'greedy' and one vocabulary")
            if [len(path) for path in tree] != sorted(len(path) for path in tree):
                raise UnsupportedSpeculation(f"speculative_token_tree = {tree} for a draft model must list its paths by "
                                             "depth (each depth's nodes run as one block)")
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

    def new_cache(self, params, batch: int) -> KVCache:
        return self._split(params)[0].create_cache(batch, self.settings.cache_size, self.settings.cache_dtype)

    def extend(self, params, cache: KVCache, prompt: Int[Array, "B T"], lengths: Int[Array, " B"],
               start: Int[Array, " B"], target_out: TargetOutput) -> DraftModelState:
        """The draft runs the committed tokens from start[b] on: the window's width and one more (the
        prefill's token; propose re-reads the last two anyway)."""
        draft, bridge = self._split(params)
        batch = prompt.shape[0]
        width = min(target_out.hidden.final.shape[1] + 1, prompt.shape[1])
        positions = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        tokens = jnp.take_along_axis(prompt, jnp.minimum(positions, prompt.shape[1] - 1), axis=1)
        tokens = tokens if bridge is None else bridge.draft_ids(tokens)
        _, _, cache = draft(tokens, positions, cache.with_lengths(start), compute_logits=False)
        nodes = self.settings.spec.num_draft_nodes
        dynamic = self.settings.spec.total_tokens is not None  # the loop's state keeps one structure throughout
        return DraftModelState(cache=cache.with_lengths(lengths),
                               parents=structure.chain_parents(batch, nodes) if dynamic else None,
                               slots=jnp.zeros((batch, nodes), jnp.int32) if dynamic else None,
                               tree_log_probs=jnp.zeros((batch, nodes), jnp.float32) if dynamic else None)

    def prefix_cache(self, state: DraftModelState) -> KVCache:
        return state.cache

    def propose(self, params, state: DraftModelState, context: Context, keys: PRNGKeyArray):
        if self.settings.spec.speculative_token_tree is not None:
            return self.propose_tree(params, state, context)
        if self.settings.spec.total_tokens is not None:
            return self.propose_dynamic_tree(params, state, context)
        draft, bridge = self._split(params)
        num_draft = self.settings.spec.num_speculative_tokens
        logits, cache = self.run_window(params, state, context)

        def draw(carry, step_key):  # in the draft's own ids
            logits = carry[1]
            return draw_draft_tokens(logits if bridge is None else bridge.mask(logits), step_key, self.settings,
                                     context.sampling)

        def step(carry, token):
            logits, _, cache = draft(token[:, None], carry[0].lengths[:, None], carry[0])
            return cache, logits[:, 0]

        draft_tokens, draft_probs, (cache, _) = draft_chain(draw, step, (cache, logits[:, -1]), keys, num_draft)
        if bridge is not None:  # greedy drafting only (check_options refuses the rest): no probabilities to map
            draft_tokens = bridge.target_ids(draft_tokens)
        return draft_tokens, draft_probs, DraftModelState(cache=cache)

    def run_window(self, params, state: DraftModelState, context: Context):
        """The draft over the last two committed tokens, the last of which its cache never holds and the one before
        it may not (an accepted last draft it never ran): (its logits [B, 2, V], the cache holding every committed
        token)."""
        draft, bridge = self._split(params)
        rows = jnp.arange(context.tokens.shape[0])
        start = context.lengths - 2  # >= 0: every row holds its prompt and the prefill's token
        window = jnp.stack([context.tokens[rows, start], context.tokens[rows, start + 1]], axis=1)
        if bridge is not None:
            window = bridge.draft_ids(window)
        positions = start[:, None] + jnp.arange(2, dtype=jnp.int32)[None, :]
        logits, _, cache = draft(window, positions, state.cache.with_lengths(start))
        return logits, cache

    def idle(self, params, state: DraftModelState, context: Context) -> DraftModelState:
        """The window run (a two-token forward of the draft), nothing drafted: each committed token stays cached."""
        return dataclasses.replace(state, cache=self.run_window(params, state, context)[1])

    def propose_tree(self, params, state: DraftModelState, context: Context):
        """The static tree, depth by depth: the root's logits rank its children; each depth's nodes then
        run as one block over the draft's cache, at their tree slots (the root's + 1 + index) and under the
        tree's mask, and their logits rank their children. Greedy drafting: node (.., r) is its parent's
        r-th ranked token."""
        tree = self.settings.spec.speculative_token_tree
        parents = structure.token_tree_parents(tree)
        rows = jnp.arange(context.tokens.shape[0])
        start = context.lengths - 2
        window = jnp.stack([context.tokens[rows, start], context.tokens[rows, start + 1]], axis=1)
        logits, _, cache = params(window, start[:, None] + jnp.arange(2, dtype=jnp.int32)[None, :],
                                  state.cache.with_lengths(start))
        root = start + 1  # the last committed token's slot; node i goes to root + 1 + i
        row_parents = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (rows.shape[0], len(tree)))
        mask = masks.attention_mask(row_parents, root, cache.max_length)
        positions = masks.block_positions(row_parents, root)
        width = 1 + max(path[-1] for path in tree)
        ranked = {-1: jax.lax.top_k(logits[:, -1], width)[1]}  # node -> its children's candidates [B, R]
        tokens = [None] * len(tree)
        for depth in range(1, max(map(len, tree)) + 1):
            nodes = [i for i, path in enumerate(tree) if len(path) == depth]
            for i in nodes:
                tokens[i] = ranked[parents[i]][:, tree[i][-1]]
            if depth == max(map(len, tree)):
                break
            first, last = nodes[0], nodes[-1] + 1  # contiguous: the tree is ordered by depth (check)
            block = jnp.stack(tokens[first:last], axis=1)
            logits, _, cache = params(block, positions[:, 1 + first:1 + last], cache.with_lengths(root + 1 + first),
                                      attention_mask=mask[:, 1 + first:1 + last])
            for j, i in enumerate(nodes):
                ranked[i] = jax.lax.top_k(logits[:, j], width)[1]
        return jnp.stack(tokens, axis=1).astype(jnp.int32), None, DraftModelState(cache=cache.with_lengths(root))

    def propose_dynamic_tree(self, params, state: DraftModelState, context: Context):
        """An EAGLE-2 tree (structure.grow): the root's top-k children, then each level's frontier as one
        block over the draft's cache at its draft slots (after the root's), under the tree's mask."""
        spec, rows = self.settings.spec, jnp.arange(context.tokens.shape[0])
        start = context.lengths - 2
        window = jnp.stack([context.tokens[rows, start], context.tokens[rows, start + 1]], axis=1)
        logits, _, cache = params(window, start[:, None] + jnp.arange(2, dtype=jnp.int32)[None, :],
                                  state.cache.with_lengths(start))
        root = start + 1  # the last committed token's slot; draft slot j is root + 1 + j

        def expand(cache, level, tokens, parent, sees):
            positions = jnp.broadcast_to((root + level)[:, None], tokens.shape)
            logits, _, cache = params(tokens, positions, cache.with_lengths(root + 1 + (level - 1) * spec.tree_top_k),
                                      attention_mask=masks.block_mask(sees, root + 1, cache.max_length))
            return cache, *structure.top_k_log_probs(logits, spec.tree_top_k)

        tokens, parents, slots, log_probs, cache = structure.grow(
            *structure.top_k_log_probs(logits[:, -1], spec.tree_top_k), expand, cache, depth=spec.num_speculative_tokens,
            total_tokens=spec.total_tokens)
        return tokens, None, DraftModelState(cache=cache.with_lengths(root), parents=parents, slots=slots,
                                             tree_log_probs=log_probs)

    def tree_parents(self, state: DraftModelState, batch: int):
        return state.parents if state.parents is not None else super().tree_parents(state, batch)

    def tree_log_probs(self, state: DraftModelState) -> Float[Array, "B N"] | None:
        return state.tree_log_probs

    def accept(self, state: DraftModelState, num_accepted, next_token, target_out) -> DraftModelState:
        if target_out.path is None:
            return state
        # The proposal left the cache's lengths at the root's slot: the accepted nodes move in after it, from
        # their tree slots (a static tree's node i) or draft slots (a dynamic tree's; the last accepted node,
        # which may never have run, is written again by the next proposal's window, as for a chain).
        path = target_out.path
        if state.slots is not None:
            path = jnp.where(path >= 0, jnp.take_along_axis(state.slots, jnp.maximum(path, 0), axis=1), -1)
        return dataclasses.replace(state, cache=masks.move_path(state.cache, state.cache.lengths, path,
                                                                     num_accepted))
