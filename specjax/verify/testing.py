"""Random verifier inputs, shared by the tests and the benchmark scripts."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.verify.common import make_draws

KINDS = ("peaked", "flat", "sparse_draft")


def random_verify_inputs(batch: int, num_draft: int, vocab: int, *, kind: str = "peaked", seed: int = 0):
    """(target_probs, draft_tokens, draft_probs, draws) with correlated target and draft
    distributions and draft tokens sampled from the draft. kind: 'peaked' (sharp), 'flat'
    (near-uniform) or 'sparse_draft' (the draft is zero on ~95% of the vocabulary)."""
    if kind not in KINDS:
        raise ValueError(f"kind = {kind!r} is invalid: allowed {KINDS}")
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    scale = {"peaked": 4.0, "flat": 0.05, "sparse_draft": 2.0}[kind]
    target_logits = scale * jax.random.normal(k1, (batch, num_draft + 1, vocab))
    draft_logits = target_logits[:, :-1] + 0.5 * scale * jax.random.normal(k2, (batch, num_draft, vocab))
    if kind == "sparse_draft":
        keep = jax.random.uniform(k3, draft_logits.shape) < 0.05
        draft_logits = jnp.where(keep, draft_logits, -jnp.inf)
    target, draft = jax.nn.softmax(target_logits, -1), jax.nn.softmax(draft_logits, -1)
    tokens = jax.random.categorical(k4, jnp.log(draft)).astype(jnp.int32)
    draws = make_draws(jax.random.split(jax.random.key(seed + 1), batch), num_draft, vocab)
    return target, tokens, draft, draws
