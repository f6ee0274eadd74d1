"""Verification of draft trees: one pass over the nodes, parents before children.

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
With one-hot drafts every try's probability is known up front (a_i / k_i below), so the accepted path
is found without a pass over the nodes. Greedy (target_probs one-hot) is the longest path whose tokens
are the target's argmax.

Traversal verification (Weng et al., "Traversal Verification for Speculative Tree Decoding", arXiv
2505.12398; `rejection_sample_method: block` with a tree) is block verification (specjax.verify.block)
generalised to trees. Each node i carries block verification's weight w_i and a (residual) target
distribution P_i: the root starts with w = 1 and its target distribution. A node i with parent u enters
with w_i = min(1, w_u P_u(x_i) / q_i(x_i)) and P_i its target distribution; when i is rejected, u is
updated as block verification's stop rule updates a prefix:
  Z = sum_x max(w_u P_u(x) - q_i(x), 0),  P_u <- max(w_u P_u - q_i, 0) / Z,  w_u <- Z / (Z + 1 - w_u).
The nodes are tested leaves first, in post-order (children in index order): node i is accepted with
probability w_i (its weight once its children are all rejected), which accepts the path from the root
to i, and the next token is drawn from P_i; a rejected node is removed. The root (w = 1) ends it.
Rejections change a parent only through its children's q_i, never through their subtrees, so every
node's weight at its test is known before any test: one pass over the nodes in index order computes
them all (with one-hot drafts a closed form, no pass), and the accepted node is the first node in
post-order whose uniform is below its weight.
On a chain this is block verification, draw for draw; on the siblings of one node with w_u = 1 it is
recursive rejection sampling. The paper proves it lossless for i.i.d. siblings; the rule above conditions
on each sibling's own q_i, as recursive rejection sampling does, and tests/test_tree_verify.py checks the
emitted tokens' distribution for deterministic top-k, i.i.d. and without-replacement siblings.

Synthetic (a benchmark mode, not lossless, as specjax.verify.synthetic for chains): the first-ranked path
(each node's first child) accepted to a length drawn from the synthetic rates, whatever the tokens are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from specjax.trees import structure
from specjax.verify.common import leading_true, race_sample, token_probs
from specjax.verify.synthetic import conditional_rates, stopping_token

TINY = jnp.finfo(jnp.float32).tiny
HIGHEST = jax.lax.Precision.HIGHEST


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
    if draft_probs is None:  # a node passes its try with probability a_i / k_i: no pass over the nodes
        a, k = one_hot_sibling_probs(target_probs, tokens, parents)
        passes = uniforms < jnp.minimum(1.0, a / jnp.maximum(k, TINY))
        path, length, node = deepest_path(parents, first_among_siblings(parents, passes))
        return path, length, race_sample(bonus_weights(target_probs, tokens, parents, None, node),
                                         exponentials)
    batch, num_nodes = tokens.shape
    rows = jnp.arange(batch)

    def visit(i, state):
        node, p, path, length = state  # current node (-1: root), the target's (residual) distribution there
        token = tokens[:, i]
        q = draft_probs[:, i].astype(jnp.float32)
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


def traversal_weights(target_probs: Float[Array, "B N1 V"], tokens: Int[Array, "B N"], parents: Int[Array, "B N"],
                      draft_probs: Float[Array, "B N V"] | None):
    """(weights[B, N + 1], residuals[B, N + 1, V] | None): each slot's (0: root, i + 1: node i) weight and
    unnormalised target distribution at its test in traversal verification (module docstring). With
    one-hot drafts a residual is the target's distribution without the rejected children's tokens, so
    only scalars are carried (residuals None: `bonus_weights` rebuilds the one needed)."""
    if draft_probs is None:
        return one_hot_traversal_weights(target_probs, tokens, parents), None
    batch, num_nodes = tokens.shape
    rows = jnp.arange(batch)

    def enter(i, state):
        weights, residuals, masses = state
        slot, token = parents[:, i] + 1, tokens[:, i]
        q = draft_probs[:, i].astype(jnp.float32)
        weight, residual, mass = weights[rows, slot], residuals[rows, slot], masses[rows, slot]
        # The slot's row is read once, before the write below: fused into several consumers, XLA read
        # [B, N + 1, V] there and copied it whole each step at B = 1 (docs/performance.md).
        residual = jax.lax.optimization_barrier(residual)
        p = residual / mass[:, None]
        p_x, q_x = token_probs(p[:, None], token[:, None])[:, 0], token_probs(q[:, None], token[:, None])[:, 0]
        node_weight = jnp.minimum(1.0, weight * p_x / jnp.maximum(q_x, TINY))
        excess = jnp.maximum(weight[:, None] * p - q, 0.0)  # the parent's residual should node i be rejected
        excess_mass = excess.sum(-1)
        weights = weights.at[:, i + 1].set(node_weight).at[rows, slot].set(rejected_parent_weight(weight, excess_mass))
        residuals = residuals.at[rows, slot].set(excess)
        masses = masses.at[rows, slot].set(jnp.maximum(excess_mass, TINY))
        return weights, residuals, masses

    init = (jnp.ones((batch, num_nodes + 1), jnp.float32), target_probs.astype(jnp.float32),
            jnp.ones((batch, num_nodes + 1), jnp.float32))
    weights, residuals, _ = jax.lax.fori_loop(0, num_nodes, enter, init)
    return weights, residuals


def rejected_parent_weight(weight: Float[Array, " B"], excess_mass: Float[Array, " B"]) -> Float[Array, " B"]:
    """Z / (Z + 1 - w), block verification's stop probability. 0 / 0 only where w = 1 and the target equals
    the rejected child's q: that child's weight is then 1 at its test, so the parent is never tested (as
    in block.stopping_from_masses)."""
    denominator = excess_mass + 1.0 - weight
    return jnp.where(denominator > 0, excess_mass / jnp.where(denominator > 0, denominator, 1.0), 0.0)


def one_hot_sibling_probs(target_probs: Float[Array, "B N1 V"], tokens: Int[Array, "B N"], parents: Int[Array, "B N"]):
    """For one-hot drafts: (a[B, N], k[B, N]): a_i = P_u(x_i), the target's probability of node i's token
    after its parent u (0 when an earlier sibling has the token: its mass is gone), and k_i = 1 - the
    earlier siblings' a: the mass left when i is tried, so that its residual probability is a_i / k_i."""
    rows, nodes = jnp.arange(tokens.shape[0]), jnp.arange(tokens.shape[1])
    a = target_probs[rows[:, None], parents + 1, tokens].astype(jnp.float32)
    earlier_sibling = (parents[:, :, None] == parents[:, None, :]) & (nodes[None, None, :] < nodes[None, :, None])
    a = jnp.where(jnp.any(earlier_sibling & (tokens[:, :, None] == tokens[:, None, :]), axis=-1), 0.0, a)
    return a, 1.0 - jnp.einsum("bij,bj->bi", earlier_sibling.astype(jnp.float32), a, precision=HIGHEST)


def one_hot_traversal_weights(target_probs: Float[Array, "B N1 V"], tokens: Int[Array, "B N"],
                              parents: Int[Array, "B N"]) -> Float[Array, "B N1"]:
    """traversal_weights for one-hot drafts, in closed form: no pass over the nodes one by one.

    With q_i the indicator of x_i, Z = w (1 - P_u(x_i)), so a rejection multiplies the parent's odds
    w / (1 - w) by 1 - a_i / k_i: over its earlier siblings that telescopes to k_i. Node i enters with
    w_i = a_i / (k_i + s_u), where s = (1 - w) / w at entry, hence s_i = (s_u + k_i - a_i) / a_i from
    s_root = 0: summed along the path, log s_i = -L_i + logsumexp over its path's nodes j of
    log(k_j - a_j) + L_parent(j), with L the path's summed log a. Once its children are all rejected,
    node i's odds are its entry odds times K_i = 1 - the sum of its children's a."""
    a, k = one_hot_sibling_probs(target_probs, tokens, parents)
    lineage = structure.ancestors(parents)  # [B, i, j]: j is i or an ancestor of i
    log_a = jnp.log(jnp.maximum(a, TINY))
    path_log_a = jnp.einsum("bij,bj->bi", lineage.astype(jnp.float32), log_a, precision=HIGHEST)
    terms = jnp.log(jnp.maximum(k - a, 0.0)) + path_log_a - log_a
    log_s = -path_log_a + jax.nn.logsumexp(jnp.where(lineage, terms[:, None, :], -jnp.inf), axis=-1)
    children_mass = jnp.sum(jnp.where(parents[:, None, :] == jnp.arange(tokens.shape[1])[None, :, None], a[:, None, :],
                                      0.0), axis=-1)
    log_s = log_s - jnp.log(jnp.maximum(1.0 - children_mass, TINY))
    weights = jnp.where(jnp.any(lineage & (a == 0)[:, None, :], axis=-1), 0.0, jax.nn.sigmoid(-log_s))
    return jnp.concatenate([jnp.ones_like(weights[:, :1]), weights], axis=1)


def bonus_weights(target_probs: Float[Array, "B N1 V"], tokens: Int[Array, "B N"], parents: Int[Array, "B N"],
                  residuals: Float[Array, "B N1 V"] | None, node: Int[Array, " B"]) -> Float[Array, "B V"]:
    """The unnormalised distribution the next token is drawn from after the accepted node (-1: the root):
    its residual, which for one-hot drafts is its target distribution without its children's tokens (all
    rejected before it was tested)."""
    rows = jnp.arange(tokens.shape[0])
    if residuals is not None:
        return residuals[rows, node + 1]
    children = parents == node[:, None]  # [B, N]
    rejected = jnp.zeros(target_probs.shape[::2], bool).at[rows[:, None], tokens].max(children)
    return jnp.where(rejected, 0.0, target_probs[rows, node + 1].astype(jnp.float32))


def verify_tree_traversal_with_draws(target_probs: Float[Array, "B N1 V"], tokens: Int[Array, "B N"],
                                     parents: Int[Array, "B N"], draft_probs: Float[Array, "B N V"] | None,
                                     uniforms: Float[Array, "B N"], exponentials: Float[Array, "B V"]):
    """Traversal verification with the draws given (module docstring); (path, length, next_token)."""
    weights, residuals = traversal_weights(target_probs, tokens, parents, draft_probs)
    passes = uniforms < weights[:, 1:]
    # The first passing node in post-order: from the root, into the first child whose subtree has one.
    subtree_passes = jnp.any(structure.ancestors(parents) & passes[:, :, None], axis=1)  # [B, N]
    path, length, node = deepest_path(parents, first_among_siblings(parents, subtree_passes))
    bonus = bonus_weights(target_probs, tokens, parents, residuals, node)
    return path, length, race_sample(bonus, exponentials)


def verify_tree_traversal(target_probs: Float[Array, "B N1 V"], tokens: Int[Array, "B N"], parents: Int[Array, "B N"],
                          draft_probs: Float[Array, "B N V"] | None, keys: PRNGKeyArray):
    """Traversal verification of the tree (module docstring); row b draws from keys[b]."""
    uniforms, exponentials = make_tree_draws(keys, tokens.shape[1], target_probs.shape[-1])
    return verify_tree_traversal_with_draws(target_probs, tokens, parents, draft_probs, uniforms, exponentials)


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
    lineage = structure.ancestors(parents)  # [B, N, N]
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


def verify_tree_synthetic(target: Array, tokens: Int[Array, "B N"], parents: Int[Array, "B N"], draft_probs,
                          keys: PRNGKeyArray, *, rates: tuple[float, ...]):
    """The first-ranked path accepted to a synthetic length (module docstring); the next token is the
    target's at its end (target: distributions [B, N + 1, V], or argmaxes [B, N + 1]: synthetic's docstring)."""
    path, depth = first_ranked_path(parents)
    uniforms, exponentials = make_tree_draws(keys, len(rates), target.shape[-1])
    length = jnp.minimum(leading_true(uniforms < jnp.asarray(conditional_rates(rates), jnp.float32)), depth)
    path = jnp.where(jnp.arange(path.shape[1])[None, :] < length[:, None], path, -1)
    rows = jnp.arange(tokens.shape[0])
    last = jnp.where(length > 0, 1 + path[rows, jnp.maximum(length - 1, 0)], 0)
    return path, length, stopping_token(target[rows, last], exponentials)
