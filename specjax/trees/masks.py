"""A draft tree run as one block of a forward: its positions, what each of [root, nodes] attends to, and the
accepted path moved in a cache afterwards (the layout is specjax.trees.structure's module docstring)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from specjax.models.kv_cache import KVCache
from specjax.models.transformer import NewTokenMask
from specjax.trees.structure import ancestors, depths


def block_positions(parents: Int[Array, "B N"], root_positions: Int[Array, " B"]) -> Int[Array, "B N1"]:
    """Positions of [root, nodes]: the root's position plus each node's depth."""
    offsets = jnp.concatenate([jnp.zeros_like(parents[:, :1]), depths(parents)], axis=1)
    return root_positions[:, None] + offsets


def tree_mask(parents: Int[Array, "B N"]) -> NewTokenMask:
    """What each of [root, nodes] sees of the block: every committed slot, the root, and its own ancestors
    and itself (the target's verification forward; the decoding layout's attention kernel takes it)."""
    batch, num_nodes = parents.shape
    in_block = jnp.concatenate([jnp.zeros((batch, num_nodes, 1), bool), ancestors(parents)], axis=2)  # [B, N, N1]
    in_block = jnp.concatenate([jnp.eye(1, num_nodes + 1, dtype=bool)[None].repeat(batch, 0), in_block], axis=1)
    return NewTokenMask(in_block.at[:, :, 0].set(True))  # every query sees the root


def attention_mask(parents: Int[Array, "B N"], fill_levels: Int[Array, " B"], cache_size: int) -> Bool[Array, "B N1 S"]:
    """tree_mask as the dense mask over the cache, the block written at slot fill_levels[b]."""
    return tree_mask(parents).dense(fill_levels, cache_size)


def block_mask(in_block: Bool[Array, "B T M"], starts: Int[Array, " B"], cache_size: int) -> Bool[Array, "B T S"]:
    """Cache slots visible to T queries whose block of M slots starts at slot starts[b]: every slot before
    it (committed), and block slot j where in_block[b, t, j]."""
    return NewTokenMask(in_block).dense(starts, cache_size)


def move_path(cache: KVCache, fill_levels: Int[Array, " B"], path: Int[Array, "B N"], length: Int[Array, " B"]):
    """The accepted path's entries (node path[b, j] at slot fill_levels[b] + 1 + path[b, j]) moved to slots
    fill_levels[b] + 1 + j; the root stays at fill_levels[b]. Lengths unchanged. Skipped when every row's
    path is already in place (nodes 0, 1, ...: a preorder tree's first-ranked path), which saves a gather
    and a scatter per cache array (two per layer and per k / v)."""
    index = jnp.arange(path.shape[1])[None, :]
    in_place = jnp.all((path == index) | (index >= length[:, None]))
    return jax.lax.cond(in_place, lambda cache: cache,
                        lambda cache: cache.move(fill_levels + 1, fill_levels[:, None] + 1 + jnp.maximum(path, 0),
                                                 length), cache)
