"""Draft vocabularies (FR-Spec, Zhao et al. 2025): a drafter that drafts only some of the target's ids
ranks them with the target's unembedding restricted to them; every other id gets -inf, so drafts and
their probabilities stay inside it while the target verifies over its whole vocabulary (lossless)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int


def draft_vocabulary(train_tokens: np.ndarray, vocab_size: int, draft_vocab_size: int) -> np.ndarray:
    """The draft_vocab_size most frequent ids of train_tokens (ties to the lower id), sorted."""
    counts = np.bincount(np.asarray(train_tokens, np.int64), minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id ascending
    return np.sort(order[:draft_vocab_size]).astype(np.int32)


def validated_draft_ids(ids, vocab_size: int, caller: str) -> np.ndarray:
    """ids as a 1-D integer array, or a ValueError naming what is wrong: non-empty, inside the target's
    vocabulary, sorted without repeats."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{caller}: ids of shape {ids.shape} and dtype {ids.dtype}: allowed a "
                         "non-empty 1-D array of integer token ids")
    outside = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if outside.size:
        i = int(outside[0])
        raise ValueError(f"{caller}: ids[{i}] = {ids[i]} is outside the target vocabulary: allowed "
                         f"ids in 0..{vocab_size - 1}")
    unordered = np.flatnonzero(np.diff(ids) <= 0)
    if unordered.size:
        i = int(unordered[0])
        raise ValueError(f"{caller}: ids[{i + 1}] = {ids[i + 1]} follows ids[{i}] = {ids[i]}: allowed "
                         "only sorted ids without repeats (strictly increasing)")
    return ids


def with_draft_ids(drafter: nnx.Module, ids, vocab_size: int) -> nnx.Module:
    """A new drafter over the same weights whose draft_to_target is ids (validated against vocab_size, the
    target's): the drafter given is unchanged."""
    ids = validated_draft_ids(ids, vocab_size, "with_draft_vocabulary")
    reduced = jax.tree.map(lambda w: w, drafter)  # a new module over the same arrays
    # nnx.data: a drafter without a draft vocabulary holds None there, a static attribute
    reduced.draft_to_target = nnx.data(nnx.Variable(jnp.asarray(ids, jnp.int32)))
    return reduced


def restricted_unembedding(embed: Float[Array, "V D"], lm_head: Float[Array, "D V"] | None,
                           ids: Int[Array, " Vd"]) -> Float[Array, "D Vd"]:
    """The target's unembedding (lm_head, or the tied embedding when it is None) restricted to ids."""
    return embed[ids].T if lm_head is None else lm_head[:, ids]


def to_target_vocabulary(draft_logits: Float[Array, "... Vd"], ids: Int[Array, " Vd"],
                         vocab_size: int) -> Float[Array, "... V"]:
    """Logits over the draft ids placed at their target ids; -inf at every other id."""
    full = jnp.full((*draft_logits.shape[:-1], vocab_size), -jnp.inf, jnp.float32)
    return full.at[..., ids].set(draft_logits.astype(jnp.float32))
