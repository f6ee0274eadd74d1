"""A draft tree's structure and growth, pure jnp (the verifiers read it; specjax.trees.masks runs it through a
forward).

A row's tree is `parents[N]`: node i's parent index, -1 for a child of the root (the last committed
token), parents before children. The target scores [root, nodes] as one block written at the row's
cache fill level L (the root at slot L, node i at slot L + 1 + i), each query seeing the committed
cache, and within the block only its ancestors and itself; its position is L + depth (the root's
depth is 0). After verification the accepted path's entries move to the contiguous slots after the
root (`KVCache.move`), so that rolling back by lengths holds as for a chain. A chain is the tree
parents = [-1, 0, 1, ...]: its mask is the causal one and its path needs no move.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def chain_parents(batch: int, num_nodes: int) -> Int[Array, "B N"]:
    return jnp.broadcast_to(jnp.arange(-1, num_nodes - 1, dtype=jnp.int32), (batch, num_nodes))


def ancestors(parents: Int[Array, "B N"]) -> Bool[Array, "B N N"]:
    """[b, i, a]: node a is node i or one of its ancestors. The closure of "is the parent of" by repeated
    squaring: log2(N) small products, not a sequential pass over the nodes (a few microseconds a node on a
    GPU: docs/performance.md has the figures)."""
    num_nodes = parents.shape[1]
    nodes = jnp.arange(num_nodes)
    reach = (parents[:, :, None] == nodes[None, None, :]) | (nodes[:, None] == nodes[None, :])[None]
    for _ in range(max(1, (num_nodes - 1).bit_length())):  # paths of up to 2, 4, 8, ... edges
        reach = jnp.einsum("bij,bjk->bik", reach.astype(jnp.float32), reach.astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST) > 0
    return reach


def depths(parents: Int[Array, "B N"]) -> Int[Array, "B N"]:
    """Node i's depth: 1 for a child of the root."""
    return ancestors(parents).sum(-1).astype(jnp.int32)


def preorder(parents: Int[Array, "B N"], ranks: Int[Array, "B N"], max_depth: int) -> Int[Array, "B N"]:
    """The nodes in depth-first preorder, each node's children by rank (ranks[b, i]: node i's rank among
    its siblings, from 0), as a permutation: order[b, j] is the node that goes to index j. Parents stay
    before children, siblings keep their order, and the path through every node's first child takes
    indices 0, 1, 2, ...; max_depth bounds the tree's depth."""
    lineage = ancestors(parents)
    depth = lineage.sum(-1)
    # Node i's key at depth d: 1 + the rank of its ancestor there, 0 past its own depth (prefixes first).
    keys = [jnp.sum(jnp.where(lineage & (depth[:, None, :] == d + 1), ranks[:, None, :] + 1, 0), axis=-1)
            for d in range(max_depth)]
    nodes = jnp.broadcast_to(jnp.arange(parents.shape[1], dtype=jnp.int32), parents.shape)
    return jax.lax.sort((*keys, nodes), dimension=1, num_keys=max_depth)[-1]


def permute(tokens: Int[Array, "B N"], parents: Int[Array, "B N"], order: Int[Array, "B N"]):
    """(tokens, parents) of the tree with node order[b, j] moved to index j."""
    rows = jnp.arange(parents.shape[0])[:, None]
    new_index = jnp.zeros_like(order).at[rows, order].set(jnp.arange(order.shape[1], dtype=order.dtype))
    old_parents = parents[rows, order]
    return tokens[rows, order], jnp.where(old_parents >= 0, new_index[rows, jnp.maximum(old_parents, 0)], -1)


def token_tree_parents(tree: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """Parent indices of a speculative_token_tree (SpecConfig): node i's path less its last rank."""
    index = {path: i for i, path in enumerate(tree)}
    return tuple(index[path[:-1]] if len(path) > 1 else -1 for path in tree)


def along_path(tree, path: Int[Array, "B N"]):
    """Every leaf [..., B, N + 1, X] (the forward over [root, nodes]: logits, hidden states) taken at
    [root, path...]: position j of the result is the j-th token of the accepted path, as after a chain.
    Entries past a row's path length repeat the root's and are not read."""
    order = jnp.concatenate([jnp.zeros_like(path[:, :1]), 1 + jnp.maximum(path, 0)], axis=1)  # [B, N + 1]

    def take(x):
        index = order.reshape((1,) * (x.ndim - 3) + order.shape + (1,))
        return jnp.take_along_axis(x, index, axis=x.ndim - 2)

    return jax.tree.map(take, tree)


def top_k_log_probs(logits: Float[Array, "... V"], k: int, ids: Int[Array, " V"] | None = None):
    """(log-probabilities, ids) of the k most likely tokens, best first; ids maps a draft vocabulary's
    indices to token ids (None: the index is the id)."""
    scores, index = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32)), k)
    return scores, (index if ids is None else ids[index]).astype(jnp.int32)


def grow(root_scores: Float[Array, "B K"], root_tokens: Int[Array, "B K"], expand, carry, *, depth: int,
         total_tokens: int):
    """A dynamic draft tree (EAGLE-2) of `depth` levels from the root's top-k children (their log-probabilities
    and ids): at each level the k frontier nodes are run through the drafter together and each ranks its k
    best children; the k children of highest path log-probability (the sum along the path) are the next
    frontier. Of every candidate, the total_tokens of highest path log-probability are kept: a child's is
    never above its parent's and ties keep the earlier candidate, so every kept node's parent is kept.

    expand(carry, level, tokens[B, k], parent[B, k] | None, sees[B, k, M]) -> (carry, scores[B, k, k],
    tokens[B, k, k]) runs the frontier of depth `level` (parent: each node's index in the previous frontier,
    None for the root's children) at the drafter's draft slots (level - 1) * k + [0, k), where node j sees
    the draft slots marked in sees[:, j] (its ancestors and itself; M = (depth - 1) * k), and returns its
    children's log-probabilities and ids, best first.

    Returns (tokens[B, N], parents[B, N], slots[B, N], log_probs[B, N], carry): the first three in depth-first
    preorder, children by rank (the most likely path at nodes 0, 1, ...), slots[b, i] node i's draft slot (-1
    for a node never run); log_probs the kept nodes' path log-probabilities, highest first, so that
    log_probs[:, :n] are those of the tree of n nodes (specjax.trees.sizing estimates acceptance from them)."""
    batch, top_k = root_tokens.shape
    rows = jnp.arange(batch)[:, None]
    frontier_slots = jnp.arange(top_k, dtype=jnp.int32)
    scores, tokens, parent = root_scores, root_tokens, None
    candidate_tokens, candidate_scores = [root_tokens], [root_scores]
    candidate_parents = [jnp.full((batch, top_k), -1, jnp.int32)]
    candidate_slots = [jnp.broadcast_to(frontier_slots, (batch, top_k))]  # the root's children all run
    frontier = jnp.broadcast_to(frontier_slots, (batch, top_k))  # candidate indices of the frontier
    sees = jnp.zeros((batch, top_k, (depth - 1) * top_k), bool)
    for level in range(1, depth):
        first_slot = (level - 1) * top_k
        sees = sees.at[:, :, first_slot:first_slot + top_k].set(jnp.eye(top_k, dtype=bool))
        carry, child_scores, child_tokens = expand(carry, level, tokens, parent, sees)
        child_scores = (scores[:, :, None] + child_scores).reshape(batch, top_k * top_k)
        child_tokens = child_tokens.reshape(batch, top_k * top_k)
        scores, best = jax.lax.top_k(child_scores, top_k)  # the next frontier, among the k^2 children
        parent = best // top_k
        candidate_parents.append(jnp.repeat(frontier, top_k, axis=1))
        candidate_tokens.append(child_tokens)
        candidate_scores.append(child_scores)
        slots = jnp.full((batch, top_k * top_k), -1, jnp.int32)
        if level < depth - 1:  # the next frontier runs at the next level's slots; the last level never runs
            slots = slots.at[rows, best].set(level * top_k + frontier_slots)
        candidate_slots.append(slots)
        frontier = top_k + (level - 1) * top_k * top_k + best
        tokens, sees = child_tokens[rows, best], sees[rows, parent]
    candidate_tokens, candidate_scores, candidate_parents, candidate_slots = (
        jnp.concatenate(c, axis=1) for c in (candidate_tokens, candidate_scores, candidate_parents, candidate_slots))
    log_probs, kept = jax.lax.top_k(candidate_scores, total_tokens)  # preorder below sorts the nodes
    parent_candidate = candidate_parents[rows, kept]  # [B, N]
    is_parent = kept[:, None, :] == parent_candidate[:, :, None]  # [B, N, N]: node j is node i's parent
    parents = jnp.where(parent_candidate >= 0, jnp.argmax(is_parent, axis=2), -1).astype(jnp.int32)
    # Each candidate's rank among its parent's children: in preorder the most likely path comes first, and,
    # when it is the one accepted, the target's cache needs no move (move_path).
    ranks = jnp.concatenate([jnp.arange(top_k)] + [jnp.tile(jnp.arange(top_k), top_k)] * (depth - 1))
    order = preorder(parents, ranks[kept], depth)
    tokens, parents = permute(candidate_tokens[rows, kept], parents, order)
    return tokens, parents, candidate_slots[rows, kept][rows, order], log_probs, carry
