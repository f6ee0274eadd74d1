"""The KV cache: one pytree of per-layer keys and values plus a per-row fill level.

Each row of the batch writes at its own offset (`lengths[b]`), so ragged prompts prefill in one call
and rows of a speculative batch may accept different numbers of tokens. Rolling back rejected tokens
is *only* resetting `lengths`: slots at or past a row's length are masked out of attention and are
overwritten by the next write.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from specjax.config import ModelConfig
from specjax.sharding import BATCH, CACHE, constrain


@functools.partial(jax.tree_util.register_dataclass, data_fields=("k", "v", "lengths"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: Float[Array, "L B S Hkv D"]
    v: Float[Array, "L B S Hkv D"]
    lengths: Int[Array, " B"]  # valid slots per row; slots >= lengths[b] are garbage

    @classmethod
    def create(cls, config: ModelConfig, batch_size: int, max_length: int, dtype=None) -> KVCache:
        """An empty cache for `batch_size` rows of up to `max_length` tokens (dtype: model's by default)."""
        shape = (config.num_layers, batch_size, max_length, config.num_kv_heads, config.head_dim)
        dtype = dtype or config.jnp_dtype
        # On a mesh: rows over the data axis, KV heads over the model axis (see specjax.sharding).
        return cls(k=constrain(jnp.zeros(shape, dtype), CACHE), v=constrain(jnp.zeros(shape, dtype), CACHE),
                   lengths=constrain(jnp.zeros((batch_size,), jnp.int32), BATCH))

    @property
    def max_length(self) -> int:
        return self.k.shape[2]

    def with_lengths(self, lengths: Int[Array, " B"]) -> KVCache:
        """The same cache with new fill levels: this is how tokens are committed and rolled back."""
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))

    def write(self, layer: Int[Array, ""], k_new: Float[Array, "B T Hkv D"],
              v_new: Float[Array, "B T Hkv D"]) -> KVCache:
        """Writes T new entries of one layer at each row's own offset `lengths[b]`.

        `lengths` is left unchanged (the model advances it once after all layers). The caller
        guarantees lengths[b] + T <= max_length; `generate` checks this before tracing.
        """
        batch, num_new = k_new.shape[:2]
        rows = jnp.arange(batch)[:, None]
        slots = self.lengths[:, None] + jnp.arange(num_new)[None, :]  # [B, T]
        k = self.k.at[layer, rows, slots].set(k_new.astype(self.k.dtype))
        v = self.v.at[layer, rows, slots].set(v_new.astype(self.v.dtype))
        return dataclasses.replace(self, k=k, v=v)
