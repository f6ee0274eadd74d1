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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from specjax.verify.common import race_sample, token_probs

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
    Needs only the argmax: no work over the vocabulary per node."""
    batch, num_nodes = tokens.shape
    rows = jnp.arange(batch)

    def visit(i, state):
        node, path, length = state
        accepted = (parents[:, i] == node) & (tokens[:, i] == target_argmax[rows, node + 1])
        slot = jnp.minimum(length, num_nodes - 1)
        path = path.at[rows, slot].set(jnp.where(accepted, i, path[rows, slot]))
        return jnp.where(accepted, i, node), path, length + accepted

    init = (jnp.full((batch,), -1, jnp.int32), jnp.full((batch, num_nodes), -1, jnp.int32),
            jnp.zeros((batch,), jnp.int32))
    node, path, length = jax.lax.fori_loop(0, num_nodes, visit, init)
    return path, length, target_argmax[rows, node + 1].astype(jnp.int32)
