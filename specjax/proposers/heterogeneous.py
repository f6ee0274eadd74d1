"""Draft and target with different tokenizers (vLLM's token-level intersection, "TLI").

The vocabularies are intersected by normalised token strings once, on the host: byte-level BPE and
SentencePiece mark a leading space differently (Ġ and ▁), so both become a space. The draft reads the
committed (target) tokens through target -> draft ids (a token outside the intersection reads as
draft id 0: only the draft's quality suffers), drafts only inside the intersection (other draft
logits are -inf) and hands its tokens to the verifier as target ids. With greedy drafting the draft
is one-hot, so verification stays lossless however the draft was made.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from specjax.models.transformer import Transformer

SPACE_MARKERS = ("Ġ", "▁")


def normalize_token(token: str) -> str:
    for marker in SPACE_MARKERS:
        token = token.replace(marker, " ")
    return token


@functools.partial(jax.tree_util.register_dataclass, data_fields=("target_to_draft", "draft_to_target"),
                   meta_fields=("size",))
@dataclasses.dataclass(frozen=True)
class VocabMapping:
    target_to_draft: Int[Array, " V"]  # -1 outside the intersection
    draft_to_target: Int[Array, " Vd"]  # -1 outside the intersection
    size: int  # tokens in the intersection

    def __str__(self) -> str:
        return (f"vocabulary intersection: {self.size} tokens (target {self.target_to_draft.shape[0]}, "
                f"draft {self.draft_to_target.shape[0]})")


def intersect_vocabularies(target_vocab: dict[str, int], draft_vocab: dict[str, int],
                           target_size: int | None = None, draft_size: int | None = None) -> VocabMapping:
    """Maps ids of equal normalised strings; vocabularies are token -> id dicts (tokenizer.get_vocab()).
    Sizes default to the largest id + 1 (a model's embedding may be larger than its tokenizer)."""
    target_size = target_size or max(target_vocab.values()) + 1
    draft_size = draft_size or max(draft_vocab.values()) + 1
    draft_by_string = {normalize_token(token): i for token, i in draft_vocab.items()}
    target_to_draft = np.full(target_size, -1, np.int32)
    draft_to_target = np.full(draft_size, -1, np.int32)
    for token, target_id in sorted(target_vocab.items(), key=lambda item: item[1]):
        draft_id = draft_by_string.get(normalize_token(token))
        if draft_id is not None and draft_to_target[draft_id] < 0:
            target_to_draft[target_id], draft_to_target[draft_id] = draft_id, target_id
    return VocabMapping(target_to_draft=jnp.asarray(target_to_draft), draft_to_target=jnp.asarray(draft_to_target),
                        size=int((draft_to_target >= 0).sum()))


@functools.partial(jax.tree_util.register_dataclass, data_fields=("model", "mapping"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class HeterogeneousDraft:
    """The drafter of `use_heterogeneous_vocab`: a draft model and its vocabulary mapping."""

    model: Transformer
    mapping: VocabMapping

    def draft_ids(self, target_ids: Int[Array, "..."]) -> Int[Array, "..."]:
        return jnp.maximum(self.mapping.target_to_draft[target_ids], 0)

    def target_ids(self, draft_ids: Int[Array, "..."]) -> Int[Array, "..."]:
        return self.mapping.draft_to_target[draft_ids]

    def mask(self, logits):
        return jnp.where(self.mapping.draft_to_target >= 0, logits, -jnp.inf)
