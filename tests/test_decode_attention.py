"""The Pallas decode-attention kernel (interpreted on the CPU) against transformer.attention."""

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import ModelConfig
from specjax.models.transformer import attention
from specjax.pallas_kernels.decode_attention import decode_attention


def _inputs(seed, batch, num_new, num_heads, num_kv, head_dim, num_slots, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=shape) * scale, dtype) for shape, scale in (
        ((batch, num_new, num_heads, head_dim), 1.0), ((batch, num_slots, num_kv, head_dim), 2.0),
        ((batch, num_slots, num_kv, head_dim), 1.0)))
    return q, k, v, rng


def _config(num_heads, num_kv, head_dim, sliding_window=None):
    return ModelConfig(vocab_size=8, hidden_size=num_heads * head_dim, num_layers=1, num_heads=num_heads,
                       num_kv_heads=num_kv, head_dim=head_dim, intermediate_size=8, sliding_window=sliding_window)


@pytest.mark.parametrize("batch, num_new, num_heads, num_kv, num_slots, sliding_window, num_splits, block", [
    (1, 1, 8, 2, 100, None, None, 64),  # a decode step; the last block moved back to end at slot 99
    (2, 6, 8, 2, 100, None, 3, 64),  # a verification block over three splits
    (3, 3, 4, 4, 37, None, None, 16),  # no grouping, many short blocks
    (2, 6, 8, 2, 200, 20, None, 64),  # sliding window: blocks below it skipped
])
def test_the_kernel_computes_attention(batch, num_new, num_heads, num_kv, num_slots, sliding_window, num_splits,
                                       block):
    q, k, v, rng = _inputs(num_slots, batch, num_new, num_heads, num_kv, 16, num_slots)
    lengths = rng.integers(0, num_slots - num_new + 1, batch)
    lengths[0] = num_slots - num_new  # a full row next to ragged ones
    slots = jnp.asarray(lengths[:, None] + np.arange(num_new)[None], jnp.int32)
    want = attention(q, k, v, slots, _config(num_heads, num_kv, 16, sliding_window))
    got = decode_attention(q, k, v, slots, sliding_window=sliding_window, num_splits=num_splits, block=block)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=0)


def test_a_rows_result_does_not_depend_on_the_tokens_beside_it():
    """The last token of a verification block gets bit for bit what a decode step at its slot gets:
    split boundaries come from the shapes, not from the fill level."""
    q, k, v, _ = _inputs(0, 2, 6, 8, 2, 16, 300)
    slots = jnp.asarray([[100 + t for t in range(6)], [250 + t for t in range(6)]], jnp.int32)
    block = decode_attention(q, k, v, slots)
    step = decode_attention(q[:, -1:], k, v, slots[:, -1:])
    np.testing.assert_array_equal(np.asarray(step[:, 0]), np.asarray(block[:, -1]))


def test_bfloat16_inputs_match_the_reference_to_rounding():
    q, k, v, _ = _inputs(1, 2, 1, 8, 2, 64, 128, jnp.bfloat16)
    slots = jnp.asarray([[5], [127]], jnp.int32)
    want = attention(q, k, v, slots, _config(8, 2, 64)).astype(jnp.float32)
    got = decode_attention(q, k, v, slots)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2, rtol=0)


def test_too_many_query_rows_are_refused():
    q, k, v, _ = _inputs(2, 1, 32, 8, 2, 16, 64)
    with pytest.raises(ValueError, match=r"T \* G <= 64 .* T = 32, G = 4"):
        decode_attention(q, k, v, jnp.zeros((1, 32), jnp.int32))


