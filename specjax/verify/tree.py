"""Verification of draft trees (DESIGN.md, wave 2): one pass over the nodes, parents before children.

A row's tree is `tokens[N]` with `parents[N]` (-1: a child of the last committed token, the root) and,
for probabilistic drafting, `draft_probs[N, V]`: the distribution node i was drawn from given its
earlier siblings (None: deterministic drafts, q = 1 for the drafted token, as EAGLE-2's top-k trees).
The target scores [root, nodes]: `target_probs[:, 0]` is its distribution after the root and
`target_probs[:, i + 1]` after node i.

`verify_tree(...) -> (path[B, N], length[B], next_token[B])`: the row emits the tokens of nodes
path[:length], then next_token; path entries past length are -1.

Recursive rejection sampling (SpecInfer; Recursive Speculative Decoding, arXiv 2402.14160): at the
current node u, with p the target's distribution there, the children c_1, c_2, ... are tried in index
order; c_i with token x is accepted with probability min(1, p(x) / q_i(x)), and on a rejection
p <- norm(max(p - q_i, 0)). An accepted child becomes u (p its target distribution) and its children
are tried next; when u's children are all rejected, or u is a leaf, next_token is drawn from p. Each
try is one step of standard speculative sampling conditioned on the earlier tries, so by induction over
the siblings the token emitted after u is distributed as the target's at u, whatever q_i is, as long as
c_i's token was drawn from q_i given what came before: i.i.d. siblings (q_i = q), siblings drawn without
replacement (q_i = q without the earlier siblings' tokens, renormalised) and deterministic top-k
siblings (q_i = one-hot: accept with p(x), then remove x from p: EAGLE's rule) are all this one rule.
Greedy (target_probs one-hot) is the longest path whose tokens are the target's argmax.

Synthetic (a benchmark mode, not lossless, as specjax.verify.synthetic for chains): the first-ranked path
(each node's first child) accepted to a length drawn from the synthetic rates, whatever the tokens are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from specjax import draft_tree
from specjax.verify.common import leading_true, race_sample, token_probs
from specjax.verify.synthetic import conditional_rates

TINY = jnp.finfo(jnp.float32).tiny


def make_tree_draws(keys: PRNGKeyArray, num_nodes: int, vocab_size: int):
    """(uniforms[B, N], exponentials[B, V]): one acceptance test a node and the final race, row b's from keys[b]."""
    def one_row(key):
        accept_key, race_key = jax.random.split(key)
        return jax.random.uniform(accept_key, (num_nodes,)), jax.random.exponential(race_key, (vocab_size,))

    return jax.vmap(one_row)(keys)


def verify_tree_with_draws(target_probs: Float[Array, "B N1 V"], tokens: Int[Array, "B N"], parents: Int[Array, "B N"],
                           draft_probs: Float[Array, "B N V"] | None, uniforms: Float[Array, "B N"],
                           exponentials: Float[Array, "B V"]):
    """The module docstring's rule with the draws given; (path, length, next_token)."""
    batch, num_nodes = tokens.shape
    rows = jnp.arange(batch)

    def visit(i, state):
        node, p, path, length = state  # current node (-1: root), the target's (residual) distribution there
        token = tokens[:, i]
        q = (jax.nn.one_hot(token, p.shape[-1], dtype=p.dtype) if draft_probs is None
             else draft_probs[:, i].astype(jnp.float32))
        p_x, q_x = token_probs(p[:, None], token[:, None])[:, 0], token_probs(q[:, None], token[:, None])[:, 0]
        tried = parents[:, i] == node
        accepted = tried & (uniforms[:, i] < jnp.minimum(1.0, p_x / jnp.maximum(q_x, TINY)))
        residual = jnp.maximum(p - q, 0.0)
        residual = residual / jnp.maximum(residual.sum(-1, keepdims=True), TINY)
        p = jnp.where(accepted[:, None], target_probs[:, i + 1].astype(jnp.float32),
                      jnp.where(tried[:, None], residual, p))
        path = path.at[rows, jnp.minimum(length, num_nodes - 1)].set(
            jnp.where(accepted, i, path[rows, jnp.minimum(length, num_nodes - 1)]))
        return jnp.where(accepted, i, node), p, path, length + accepted

    init = (jnp.full((batch,), -1, jnp.int32), target_probs[:, 0].astype(jnp.float32),
            jnp.full((batch, num_nodes), -1, jnp.int32), jnp.zeros((batch,), jnp.int32))
    _, p, path, length = jax.lax.fori_loop(0, num_nodes, visit, init)
    return path, length, race_sample(p, exponentials)


def verify_tree(target_probs: Float[Array, "B N1 V"], tokens: Int[Array, "B N"], parents: Int[Array, "B N"],
                draft_probs: Float[Array, "B N V"] | None, keys: PRNGKeyArray):
    """Recursive rejection sampling over the tree (module docstring); row b draws from keys[b]."""
    uniforms, exponentials = make_tree_draws(keys, tokens.shape[1], target_probs.shape[-1])
    return verify_tree_with_draws(target_probs, tokens, parents, draft_probs, uniforms, exponentials)


def verify_tree_greedy(target_argmax: Int[Array, "B N1"], tokens: Int[Array, "B N"], parents: Int[Array, "B N"]):
    """The longest path whose every token is the target's argmax after its parent; (path, length, next_token).
    Needs only the argmax: no work over the vocabulary per node, and no pass over the nodes one by one."""
    rows = jnp.arange(tokens.shape[0])
    matches = tokens == target_argmax[rows[:, None], parents + 1]
    # As recursive rejection sampling on one-hot targets: the first matching child of a node is taken.
    path, length, node = deepest_path(parents, first_among_siblings(parents, matches))
    return path, length, target_argmax[rows, node + 1].astype(jnp.int32)


def first_among_siblings(parents: Int[Array, "B N"], flags: Bool[Array, "B N"]) -> Bool[Array, "B N"]:
    """flags[b, i] where no earlier sibling of node i is flagged."""
    nodes = jnp.arange(parents.shape[1])
    earlier_sibling = (parents[:, :, None] == parents[:, None, :]) & (nodes[None, None, :] < nodes[None, :, None])
    return flags & ~jnp.any(earlier_sibling & flags[:, None, :], axis=-1)


def deepest_path(parents: Int[Array, "B N"], allowed: Bool[Array, "B N"]):
    """The deepest node whose path from the root has only allowed nodes (the earliest of equally deep
    ones; with at most one allowed child a node, the path is the only one), as (path[B, N]: its path's
    nodes by depth, -1 past its length; length[B]; node[B], -1 for none)."""
    batch, num_nodes = parents.shape
    lineage = draft_tree.ancestors(parents)  # [B, N, N]
    depth = lineage.sum(-1)
    reachable = ~jnp.any(lineage & ~allowed[:, None, :], axis=-1)
    rank = jnp.where(reachable, depth * (num_nodes + 1) + num_nodes - jnp.arange(num_nodes), -1)
    best = jnp.argmax(rank, axis=-1)
    length = jnp.where(jnp.any(reachable, axis=-1), depth[jnp.arange(batch), best], 0).astype(jnp.int32)
    on_path = lineage[jnp.arange(batch), best]  # [B, N]: the best node and its ancestors
    at_depth = on_path[:, None, :] & (depth[:, None, :] == jnp.arange(1, num_nodes + 1)[None, :, None])  # [B, j, N]
    path = jnp.where(jnp.arange(num_nodes)[None] < length[:, None], jnp.argmax(at_depth, axis=-1), -1)
    return path.astype(jnp.int32), length, jnp.where(length > 0, best, -1).astype(jnp.int32)


def first_ranked_path(parents: Int[Array, "B N"]):
    """The path through each node's first child, from the root: (path[B, N], length[B])."""
    path, length, _ = deepest_path(parents, first_among_siblings(parents, jnp.ones(parents.shape, bool)))
    return path, length


def verify_tree_synthetic(target_probs: Float[Array, "B N1 V"], tokens: Int[Array, "B N"], parents: Int[Array, "B N"],
                          draft_probs, keys: PRNGKeyArray, *, rates: tuple[float, ...]):
    """The first-ranked path accepted to a synthetic length (module docstring); the next token is the
    target's sample at its end."""
    path, depth = first_ranked_path(parents)
    uniforms, exponentials = make_tree_draws(keys, len(rates), target_probs.shape[-1])
    length = jnp.minimum(leading_true(uniforms < jnp.asarray(conditional_rates(rates), jnp.float32)), depth)
    path = jnp.where(jnp.arange(path.shape[1])[None, :] < length[:, None], path, -1)
    rows = jnp.arange(tokens.shape[0])
    last = jnp.where(length > 0, 1 + path[rows, jnp.maximum(length - 1, 0)], 0)
    return path, length, race_sample(target_probs[rows, last].astype(jnp.float32), exponentials)
