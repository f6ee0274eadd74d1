"""Medusa drafting: K heads read the target's final hidden state and draft K tokens at once.

h_t is the target's final-norm feature at the position whose logits drew the newest committed
token x_{t+1}; head k predicts x_{t+k+1} from it, so the draft is [head_1(h_t), .., head_K(h_t)]
(one chain, top-1 or one sample per head), or, with spec.speculative_token_tree, Medusa's sparse tree:
node (r_1, .., r_d) is head d's r_d-th ranked token (greedy drafting: q one-hot to the verifier) or, with
probabilistic drafting, the r_d-th draw without replacement from head d's distribution in a race of its
own parent's (Gumbel top-k), q being that distribution less the parent's earlier draws. The heads
are conditionally independent given h_t, so head i's distribution is q(x_i | x_<i) for the
verifiers, and the state is h_t alone: it needs no cache and no work but picking h_t in `accept`.
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
from specjax.models.medusa import LMHead, MedusaHeads, load_medusa
from specjax.models.transformer import Transformer
from specjax.proposers.base import (Context, Proposer, TargetOutput, UnsupportedSpeculation, register,
                                    require_target_sizes)
from specjax.proposers.drafting import draw_draft_tokens
from specjax.verify.sampling import SamplingParams, processed_probs


@functools.partial(jax.tree_util.register_dataclass, data_fields=("heads", "lm_head"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class BoundMedusa:
    """What propose needs: the heads and, when they share it, the target's LM head."""

    heads: MedusaHeads
    lm_head: LMHead | None


@functools.partial(jax.tree_util.register_dataclass, data_fields=("feature",), meta_fields=())
@dataclasses.dataclass(frozen=True)
class MedusaState:
    feature: Float[Array, "B D"]  # h_t: the target's final hidden state that drew the newest token


@register("medusa")
@dataclasses.dataclass(frozen=True)
class MedusaProposer(Proposer):
    default_drafter: ClassVar[str | None] = "default:medusa"
    checkpoint_kind: ClassVar[str] = "Medusa heads"
    drafts_trees: ClassVar[bool] = True
    skips_drafting: ClassVar[bool] = True  # propose leaves the state as it is

    @classmethod
    def load(cls, folder: Path, target: Transformer, dtype: str | None, model_shards: int) -> MedusaHeads:
        return load_medusa(folder, dtype=dtype)

    @classmethod
    def recognizes(cls, folder: Path) -> bool:
        return "medusa_num_heads" in hf.config_json_or_empty(folder)

    def check(self, params: MedusaHeads, target_config) -> None:
        if not isinstance(params, MedusaHeads):
            raise ValueError(f"method 'medusa' needs MedusaHeads as drafter, got {type(params).__name__}")
        c, num_draft = params.config, self.settings.spec.num_speculative_tokens
        require_target_sizes("Medusa", target_config, hidden_size=c.hidden_size, vocab_size=c.vocab_size)
        if c.num_heads < num_draft:
            raise UnsupportedSpeculation(f"Medusa has {c.num_heads} heads but num_speculative_tokens is {num_draft}: "
                             f"allowed K <= {c.num_heads}")
        tree = self.settings.spec.speculative_token_tree
        if tree is not None and self.settings.spec.draft_sample_method == "probabilistic":
            for parent in {path[:-1] for path in tree}:  # the verifier tries siblings in the order they were drawn
                ranks = [path[-1] for path in tree if path[:-1] == parent]
                if ranks != list(range(len(ranks))):
                    raise UnsupportedSpeculation(
                        f"speculative_token_tree with draft_sample_method 'probabilistic' needs each node's children "
                        f"to be ranks 0, 1, .. in order (draws without replacement); under {parent} they are {ranks}")

    def bind(self, params: MedusaHeads, target: Transformer) -> BoundMedusa:
        return BoundMedusa(heads=params, lm_head=LMHead.of(target) if params.config.shared_lm_head else None)

    def extend(self, params: BoundMedusa, cache: None, prompt: Int[Array, "B T"], lengths: Int[Array, " B"],
               start: Int[Array, " B"], target_out: TargetOutput) -> MedusaState:
        # The prefill's last prompt position drew the token that ends prompt[b, :lengths[b]].
        rows = jnp.arange(prompt.shape[0])
        return MedusaState(feature=target_out.hidden.final[rows, lengths - 2 - start])

    def propose(self, params: BoundMedusa, state: MedusaState, context: Context, keys: PRNGKeyArray):
        num_draft, tree = self.settings.spec.num_speculative_tokens, self.settings.spec.speculative_token_tree
        logits = params.heads(state.feature, params.lm_head, num_heads=num_draft)  # [B, K, V]
        if tree is not None:
            return (*self.draft_tree(logits, tree, keys, context.sampling), state)
        head_keys = jax.vmap(lambda key: jax.random.split(key, num_draft))(keys)  # [B, K]
        # Each head drafts on its own, as draft_model's steps do one at a time.
        draw = jax.vmap(functools.partial(draw_draft_tokens, settings=self.settings, sampling=context.sampling),
                        in_axes=1, out_axes=1)
        draft_tokens, draft_probs = draw(logits, head_keys)  # [B, K], [B, K, V] or None
        return draft_tokens, draft_probs, state

    def draft_tree(self, logits: Float[Array, "B K V"], tree, keys: PRNGKeyArray, sampling: SamplingParams):
        """Node (r_1 .. r_d) of the tree: head d's r_d-th ranked token, or its r_d-th draw without replacement
        in its parent's race; (tokens [B, N], q [B, N, V] or None)."""
        heads = [len(path) - 1 for path in tree]
        ranks = [path[-1] for path in tree]
        width = 1 + max(ranks)
        if not self.settings.sampling.sampled or self.settings.spec.draft_sample_method == "greedy":
            ranked = jax.lax.top_k(logits, width)[1]  # [B, K, R]
            return ranked[:, jnp.asarray(heads), jnp.asarray(ranks)].astype(jnp.int32), None
        probs = processed_probs(logits, sampling, self.settings.sampling)  # [B, K, V]; greedy rows one-hot
        parents = sorted({path[:-1] for path in tree}, key=len)
        race_of = [parents.index(path[:-1]) for path in tree]
        head_of_race = jnp.asarray([len(parent) for parent in parents])
        gumbels = jax.vmap(lambda key: jax.random.gumbel(key, (len(parents), probs.shape[-1])))(keys)
        order = jax.lax.top_k(jnp.log(probs[:, head_of_race]) + gumbels, width)[1]  # [B, races, R]: the draws
        tokens, qs = [], []
        for head, rank, race in zip(heads, ranks, race_of):
            earlier = jax.nn.one_hot(order[:, race, :rank], probs.shape[-1]).sum(1)  # [B, V]
            q = probs[:, head] * (1 - earlier)
            total = q.sum(-1, keepdims=True)
            token = order[:, race, rank]
            # With fewer tokens of nonzero probability than siblings, the draw is fixed: q one-hot.
            qs.append(jnp.where(total > 0, q / jnp.maximum(total, 1e-30), jax.nn.one_hot(token, q.shape[-1])))
            tokens.append(token)
        return jnp.stack(tokens, 1).astype(jnp.int32), jnp.stack(qs, 1)

    def idle(self, params: BoundMedusa, state: MedusaState, context: Context) -> MedusaState:
        return state

    def accept(self, state: MedusaState, num_accepted: Int[Array, " B"], next_token: Int[Array, " B"],
               target_out: TargetOutput) -> MedusaState:
        # Verify position n (over [last, d_1 .. d_K]) drew next_token after the n accepted drafts.
        rows = jnp.arange(num_accepted.shape[0])
        return MedusaState(feature=target_out.hidden.final[rows, num_accepted])
