"""Medusa drafting: K heads read the target's final hidden state and draft K tokens at once.

h_t is the target's final-norm feature at the position whose logits drew the newest committed
token x_{t+1}; head k predicts x_{t+k+1} from it, so the draft is [head_1(h_t), .., head_K(h_t)]
(one chain, top-1 or one sample per head), or, with spec.speculative_token_tree, Medusa's sparse tree:
node (r_1, .., r_d) is head d's r_d-th ranked token (deterministic: q one-hot to the verifier). The heads
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

from specjax.models.medusa import LMHead, MedusaHeads, load_medusa
from specjax.models.transformer import Transformer
from specjax.proposers.base import (Context, Proposer, TargetOutput, UnsupportedSpeculation, register,
                                    require_target_sizes)
from specjax.proposers.draft_model import draw_draft_tokens


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
    drafts_trees: ClassVar[bool] = True

    @classmethod
    def load(cls, folder: Path, target: Transformer, dtype: str | None, model_shards: int) -> MedusaHeads:
        return load_medusa(folder, dtype=dtype)

    def check(self, params: MedusaHeads, target_config) -> None:
        if not isinstance(params, MedusaHeads):
            raise ValueError(f"method 'medusa' needs MedusaHeads as drafter, got {type(params).__name__}")
        c, num_draft = params.config, self.settings.spec.num_speculative_tokens
        require_target_sizes("Medusa", target_config, hidden_size=c.hidden_size, vocab_size=c.vocab_size)
        if c.num_heads < num_draft:
            raise UnsupportedSpeculation(f"Medusa has {c.num_heads} heads but num_speculative_tokens is {num_draft}: "
                             f"allowed K <= {c.num_heads}")
        if self.settings.spec.speculative_token_tree is not None and self.settings.spec.draft_sample_method != "greedy":
            raise UnsupportedSpeculation("Medusa drafts its tree of top-k candidates deterministically: "
                                         "speculative_token_tree is allowed with draft_sample_method 'greedy'")

    def bind(self, params: MedusaHeads, target: Transformer) -> BoundMedusa:
        return BoundMedusa(heads=params, lm_head=LMHead.of(target) if params.config.shared_lm_head else None)

    def init(self, params: BoundMedusa, prompt: Int[Array, "B T"], lengths: Int[Array, " B"],
             target_out: TargetOutput) -> MedusaState:
        # The prefill's last prompt position drew the token that ends prompt[b, :lengths[b]].
        rows = jnp.arange(prompt.shape[0])
        return MedusaState(feature=target_out.hidden.final[rows, lengths - 2])

    def propose(self, params: BoundMedusa, state: MedusaState, context: Context, keys: PRNGKeyArray):
        num_draft, tree = self.settings.spec.num_speculative_tokens, self.settings.spec.speculative_token_tree
        logits = params.heads(state.feature, params.lm_head, num_heads=num_draft)  # [B, K, V]
        if tree is not None:  # node (r_1 .. r_d): head d's r_d-th ranked token
            ranked = jax.lax.top_k(logits, 1 + max(path[-1] for path in tree))[1]  # [B, K, R]
            heads, ranks = (jnp.asarray([len(p) - 1 for p in tree]), jnp.asarray([p[-1] for p in tree]))
            return ranked[:, heads, ranks].astype(jnp.int32), None, state
        head_keys = jax.vmap(lambda key: jax.random.split(key, num_draft))(keys)  # [B, K]
        # Each head drafts on its own, as draft_model's steps do one at a time.
        draw = jax.vmap(functools.partial(draw_draft_tokens, settings=self.settings), in_axes=1, out_axes=1)
        draft_tokens, draft_probs = draw(logits, head_keys)  # [B, K], [B, K, V] or None
        return draft_tokens, draft_probs, state

    def accept(self, state: MedusaState, num_accepted: Int[Array, " B"], next_token: Int[Array, " B"],
               target_out: TargetOutput) -> MedusaState:
        # Verify position n (over [last, d_1 .. d_K]) drew next_token after the n accepted drafts.
        rows = jnp.arange(num_accepted.shape[0])
        return MedusaState(feature=target_out.hidden.final[rows, num_accepted])
