"""Pallas kernels, each checked against the jnp code it replaces: block_verify against
specjax.verify.block, decode_attention against KVCache.write and models.transformer.attention."""
