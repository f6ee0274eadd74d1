"""Pallas kernels, each checked against the jnp code it replaces: block_verify against
specjax.verify.block, decode_attention against KVCache.write and models.transformer.attention.

Kernels build on the jnp modules they replace, never on the registries that choose them:
specjax.verify.verifier_for picks block_verify (importing it when chosen), so imports run one way.
"""

# The first Pallas lowering in a process imports Pallas's fuser, which registers a setting that is part of every
# jitted function's cache key: imported with the kernels, so that programs traced before that lowering are not
# traced and compiled again after it (speculative_loop with verify_impl 'pallas' compiled twice in a row).
import jax.experimental.pallas.fuser  # noqa: F401
