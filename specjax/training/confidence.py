"""How well a DSpark drafter's confidence head predicts acceptance, against the margin estimator, on held-out
steps (scripts/dspark_eval.py reports it for the default models).

The held-out steps are greedy draft steps teacher forced over the target's own greedy continuation of
held-out prompts: at every anchor a of the continuation (the last committed token) one block is drafted from
the committed tokens' features, as the decoding loop drafts it (specjax.training.dflash.block_outputs).
Draft k is accepted if it equals the target's argmax there; the population of draft k is the steps where
drafts 1..k-1 were accepted (the event the confidence c_k is conditioned on). The steps are split in two
halves at random (by block); the margin estimator is a logistic regression of acceptance on the draft's
top-1 minus top-2 logit, fitted on the first half; both it and the confidence head are scored by AUC on
the second.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decoding import generate
from specjax.training.dflash import block_outputs, observed_acceptance


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve: the probability that a positive scores above a negative (ties half)."""
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    # average ranks over ties
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    ranks[order] = np.repeat(first + (counts + 1) / 2, counts)
    positives = labels.astype(bool)
    n_pos, n_neg = positives.sum(), (~positives).sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def fit_logistic(x: np.ndarray, y: np.ndarray, steps: int = 50) -> tuple[float, float]:
    """(w, b) of P(y = 1) = sigmoid(w x + b) by Newton's method (a small ridge keeps it finite on separable data)."""
    features = np.stack([x, np.ones_like(x)], axis=1)
    theta = np.zeros(2)
    for _ in range(steps):
        p = 1 / (1 + np.exp(-features @ theta))
        gradient = features.T @ (p - y) + 1e-6 * theta
        hessian = (features * (p * (1 - p))[:, None]).T @ features + 1e-6 * np.eye(2)
        theta -= np.linalg.solve(hessian, gradient)
    return float(theta[0]), float(theta[1])


def held_out_steps(target, drafter, prompts, new_tokens: int, batch: int) -> dict:
    """Per draft of every teacher-forced block (module docstring): confidence, margin, accepted, conditioned
    (each [steps, K]) and the block's index."""
    continued = np.asarray(generate(target, prompts, max_new_tokens=new_tokens).tokens)  # greedy
    sequences = np.concatenate([np.asarray(prompts), continued], axis=1)
    prompt_len, seq_len = len(prompts[0]), sequences.shape[1]
    span = drafter.config.block_size + 1 - drafter.config.first_draft_slot
    anchors = np.arange(prompt_len - 1, seq_len - span + 1, dtype=np.int32)
    first = drafter.config.first_draft_slot

    @jax.jit
    def steps(tokens, anchors):
        outputs = block_outputs(drafter, target, tokens, anchors, compute_target_logits=True)
        accepted, conditioned = observed_acceptance(outputs)
        logits = outputs["logits"][..., first:, :]
        top2 = jax.lax.top_k(logits, 2)[0]
        confidence = jax.nn.sigmoid(drafter.confidence_logit(outputs["hidden"][..., first:, :],
                                                             outputs["previous"][..., first:]))
        return confidence, top2[..., 0] - top2[..., 1], accepted, conditioned

    parts = []
    for start in range(0, len(sequences), batch):
        rows = sequences[start:start + batch]
        block_anchors = np.broadcast_to(anchors, (len(rows), len(anchors)))
        parts.append([np.asarray(x) for x in steps(jnp.asarray(rows), jnp.asarray(block_anchors))])
    arrays = [np.concatenate([part[i] for part in parts]) for i in range(4)]  # [prompts, anchors, K] each
    confidence, margin, accepted, conditioned = (a.reshape(-1, a.shape[-1]) for a in arrays)
    return {"confidence": confidence, "margin": margin, "accepted": accepted, "conditioned": conditioned}


def confidence_against_margin(steps: dict, seed: int = 0) -> dict:
    blocks = len(steps["accepted"])
    second_half = np.random.default_rng(seed).permutation(blocks) >= blocks // 2  # per block
    fit_rows, score_rows = ~second_half, second_half
    pick = lambda name, rows: steps[name][rows][steps["conditioned"][rows] > 0]  # noqa: E731
    w, b = fit_logistic(pick("margin", fit_rows), pick("accepted", fit_rows))
    margin_scores = 1 / (1 + np.exp(-(w * pick("margin", score_rows) + b)))
    labels = pick("accepted", score_rows)
    return {"auc_confidence_head": auc(pick("confidence", score_rows), labels),
            "auc_margin_logistic": auc(margin_scores, labels), "margin_fit": {"w": w, "b": b},
            "scored_drafts": int(len(labels)), "accepted_fraction": float(labels.mean()) if len(labels) else None,
            "fitted_drafts": int(len(pick("accepted", fit_rows))), "blocks": blocks}
