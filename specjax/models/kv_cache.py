"""The KV cache: one pytree of per-layer keys and values plus a per-row fill level.

Each row of the batch writes at its own offset (`lengths[b]`), so ragged prompts prefill in one call
and rows of a speculative batch may accept different numbers of tokens. Rolling back rejected tokens
is *only* resetting `lengths`: slots at or past a row's length are masked out of attention and are
overwritten by the next write.

Keys and values are stacked on a layer axis for models whose layers run as one scan, or held as one
array per layer for models in the decoding layout (transformer.to_decoding_layout), whose Python loop over
layers would otherwise slice each layer out of the stacked cache: on the GPU that slice is a copy
(what it cost: docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from specjax.config import ModelConfig
from specjax.sharding import BATCH, CACHE, LAYER_CACHE, constrain

LayerKV = Float[Array, "B S Hkv D"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=("k", "v", "lengths"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: Float[Array, "L B S Hkv D"] | tuple[LayerKV, ...]  # stacked, or one array per layer
    v: Float[Array, "L B S Hkv D"] | tuple[LayerKV, ...]
    lengths: Int[Array, " B"]  # valid slots per row; slots >= lengths[b] are garbage

    @classmethod
    def create(cls, config: ModelConfig, batch_size: int, max_length: int, dtype=None, *,
               per_layer: bool = False) -> KVCache:
        """An empty cache for `batch_size` rows of up to `max_length` tokens (dtype: model's by default),
        stacked on a layer axis or (per_layer) one array per layer; models make theirs with
        `create_cache`, which picks the one their layout wants."""
        shape = (batch_size, max_length, config.num_kv_heads, config.head_dim)
        dtype = dtype or config.jnp_dtype
        # On a mesh: rows over the data axis, KV heads over the model axis (see specjax.sharding).
        if per_layer:
            k, v = (tuple(constrain(jnp.zeros(shape, dtype), LAYER_CACHE) for _ in range(config.num_layers))
                    for _ in range(2))
        else:
            k, v = (constrain(jnp.zeros((config.num_layers, *shape), dtype), CACHE) for _ in range(2))
        return cls(k=k, v=v, lengths=constrain(jnp.zeros((batch_size,), jnp.int32), BATCH))

    @property
    def max_length(self) -> int:
        return self.layer(0)[0].shape[1]

    @property
    def dtype(self):
        return self.layer(0)[0].dtype

    def layer(self, index: int | Int[Array, ""]) -> tuple[LayerKV, LayerKV]:
        """One layer's keys and values (a per-layer cache takes a Python int)."""
        return self.k[index], self.v[index]

    def with_lengths(self, lengths: Int[Array, " B"]) -> KVCache:
        """The same cache with new fill levels: this is how tokens are committed and rolled back."""
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))

    def with_layer(self, layer: int | Int[Array, ""], k: LayerKV, v: LayerKV) -> KVCache:
        """The same cache with one layer's keys and values replaced (a per-layer cache takes a Python int)."""
        if isinstance(self.k, tuple):
            return dataclasses.replace(self, k=self.k[:layer] + (k,) + self.k[layer + 1:],
                                       v=self.v[:layer] + (v,) + self.v[layer + 1:])
        return dataclasses.replace(self, k=self.k.at[layer].set(k), v=self.v.at[layer].set(v))

    def write(self, layer: int | Int[Array, ""], k_new: Float[Array, "B T Hkv D"],
              v_new: Float[Array, "B T Hkv D"]) -> KVCache:
        """Writes T new entries of one layer at each row's own offset `lengths[b]`.

        `layer` is a Python int for a per-layer cache. `lengths` is left unchanged (the model advances
        it once after all layers). The caller guarantees lengths[b] + T <= max_length; `generate`
        checks this before tracing.
        """
        batch, num_new = k_new.shape[:2]
        rows = jnp.arange(batch)[:, None]
        slots = self.lengths[:, None] + jnp.arange(num_new)[None, :]  # [B, T]
        if isinstance(self.k, tuple):
            k, v = self.layer(layer)
            return self.with_layer(layer, k.at[rows, slots].set(k_new.astype(self.dtype)),
                                   v.at[rows, slots].set(v_new.astype(self.dtype)))
        return dataclasses.replace(self, k=self.k.at[layer, rows, slots].set(k_new.astype(self.dtype)),
                                   v=self.v.at[layer, rows, slots].set(v_new.astype(self.dtype)))

    def write_rows(self, layer: int | Int[Array, ""], rows: Int[Array, " R"], starts: Int[Array, " R"],
                   k_new: Float[Array, "R C Hkv D"], v_new: Float[Array, "R C Hkv D"]) -> KVCache:
        """Writes C entries of one layer into cache row rows[r] from slot starts[r] (prompt chunks); a row past the
        batch or a slot past the cache is dropped. `lengths` is left unchanged."""
        slots = starts[:, None] + jnp.arange(k_new.shape[1])[None, :]
        rows = rows[:, None]
        if isinstance(self.k, tuple):
            k, v = self.layer(layer)
            return self.with_layer(layer, k.at[rows, slots].set(k_new.astype(self.dtype), mode="drop"),
                                   v.at[rows, slots].set(v_new.astype(self.dtype), mode="drop"))
        return dataclasses.replace(
            self, k=self.k.at[layer, rows, slots].set(k_new.astype(self.dtype), mode="drop"),
            v=self.v.at[layer, rows, slots].set(v_new.astype(self.dtype), mode="drop"))

    def move(self, start: Int[Array, " B"], sources: Int[Array, "B P"], count: Int[Array, " B"]) -> KVCache:
        """Every layer's entries at slots sources[b, j] moved to slot start[b] + j, for j < count[b]
        (a tree's accepted path into contiguous slots); lengths unchanged. Needs sources[b, j] >= start[b] + j,
        which a path of a tree whose parents come before their children has: all reads precede the writes."""
        rows = jnp.arange(sources.shape[0])[:, None]
        index = jnp.arange(sources.shape[1])[None, :]
        targets = jnp.where(index < count[:, None], start[:, None] + index, self.max_length)  # past the end: dropped
        sources = jnp.clip(sources, 0, self.max_length - 1)
        if isinstance(self.k, tuple):
            move = lambda x: x.at[rows, targets].set(x[rows, sources])  # noqa: E731
            return dataclasses.replace(self, k=tuple(map(move, self.k)), v=tuple(map(move, self.v)))
        move = lambda x: x.at[:, rows, targets].set(x[:, rows, sources])  # noqa: E731
        return dataclasses.replace(self, k=move(self.k), v=move(self.v))
