"""Pallas kernels, each checked against the jnp code it replaces: block_verify against
specjax.verify.block, decode_attention against KVCache.write and models.transformer.attention.

Kernels build on the jnp modules they replace, never on the registries that choose them:
specjax.verify.verifier_for picks block_verify (importing it when chosen), so imports run one way.
"""
