"""The Pallas decode-attention kernel (interpreted on the CPU) against KVCache.write then
transformer.attention."""

import functools
import importlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import fixture_dir
from support.models import assert_float32_close, forward, positions_like

from specjax.config import ModelConfig
from specjax.models import hf
from specjax.models.transformer import NewTokenMask, attention, to_decoding_layout
from specjax.pallas_kernels import decode_attention as attention_kernel
from specjax.pallas_kernels.decode_attention import decode_attention


def _inputs(seed, batch, num_new, num_heads, num_kv, head_dim, num_slots, dtype=jnp.float32):
    """Queries, new keys and values, and caches of random (stale) entries."""
    rng = np.random.default_rng(seed)
    q, k_new, v_new, k_cache, v_cache = (jnp.asarray(rng.normal(size=shape) * scale, dtype) for shape, scale in (
        ((batch, num_new, num_heads, head_dim), 1.0), ((batch, num_new, num_kv, head_dim), 2.0),
        ((batch, num_new, num_kv, head_dim), 1.0), ((batch, num_slots, num_kv, head_dim), 2.0),
        ((batch, num_slots, num_kv, head_dim), 1.0)))
    return q, k_new, v_new, k_cache, v_cache, rng


def _config(num_heads, num_kv, head_dim, sliding_window=None):
    return ModelConfig(vocab_size=8, hidden_size=num_heads * head_dim, num_layers=1, num_heads=num_heads,
                       num_kv_heads=num_kv, head_dim=head_dim, intermediate_size=8, sliding_window=sliding_window)


# Each a program (eagerly, each operation of the kernel's wrapper and of the reference compiles apart).
kernel = jax.jit(decode_attention, static_argnames=("sliding_window", "causal", "num_splits", "block", "interpret"))


@functools.partial(jax.jit, static_argnames=("config", "causal"))
def _reference(q, k_new, v_new, k_cache, v_cache, slots, config, causal=True, visible=None):
    rows = jnp.arange(q.shape[0])[:, None]
    k_cache, v_cache = k_cache.at[rows, slots].set(k_new), v_cache.at[rows, slots].set(v_new)
    return attention(q, k_cache, v_cache, slots, config, causal=causal, visible=visible), k_cache, v_cache


@pytest.mark.parametrize("batch, num_new, num_heads, num_kv, num_slots, sliding_window, num_splits, block, causal", [
    (1, 1, 8, 2, 100, None, None, 64, True),  # a decode step; the last block moved back to end at slot 99
    (2, 6, 8, 2, 100, None, 3, 64, True),  # a verification block over three splits
    (3, 3, 4, 4, 37, None, None, 16, True),  # no grouping, many short blocks
    (2, 6, 8, 2, 200, 20, None, 64, True),  # sliding window: blocks below it skipped
    (2, 6, 4, 2, 128, None, 1, 16, True),  # one split: the normalised output written by the kernel
    (2, 8, 8, 2, 100, None, 3, 16, False),  # a DFlash block: the new tokens see one another
])
def test_the_kernel_writes_the_cache_and_computes_attention(batch, num_new, num_heads, num_kv, num_slots,
                                                            sliding_window, num_splits, block, causal):
    q, k_new, v_new, k_cache, v_cache, rng = _inputs(num_slots, batch, num_new, num_heads, num_kv, 16, num_slots)
    lengths = rng.integers(0, num_slots - num_new + 1, batch)
    lengths[0] = num_slots - num_new  # a full row next to ragged ones
    if batch > 1:
        lengths[1] = block - num_new // 2  # new tokens across a block boundary
    slots = jnp.asarray(lengths[:, None] + np.arange(num_new)[None], jnp.int32)
    want = _reference(q, k_new, v_new, k_cache, v_cache, slots, _config(num_heads, num_kv, 16, sliding_window), causal)
    got = kernel(q, k_new, v_new, k_cache, v_cache, slots, sliding_window=sliding_window,
                 num_splits=num_splits, block=block, causal=causal)
    assert_float32_close(got[0], want[0])
    for got_cache, want_cache in zip(got[1:], want[1:]):  # every other slot kept
        np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(want_cache))


@pytest.mark.parametrize("batch, num_new, num_heads, num_kv, num_slots, num_splits, block", [
    (2, 7, 8, 2, 100, None, 16),  # one tile of 28 rows
    (2, 20, 8, 2, 100, 3, 16),  # 80 rows: two tiles, three splits
    (1, 61, 32, 8, 256, None, 64),  # a 60-node tree at Llama-3.1-8B's grouping: 244 rows in four tiles
])
def test_a_trees_mask_gives_the_dense_masked_attention(batch, num_new, num_heads, num_kv, num_slots, num_splits, block):
    """sees (transformer.NewTokenMask): every committed slot, and among the new tokens a random tree's
    ancestors and itself, against transformer.attention with the same mask as a dense [B, T, S] array."""
    q, k_new, v_new, k_cache, v_cache, rng = _inputs(num_new, batch, num_new, num_heads, num_kv, 16, num_slots)
    parents = [[-1] + [int(rng.integers(-1, t)) for t in range(1, num_new)] for _ in range(batch)]
    sees = np.eye(num_new, dtype=bool)[None].repeat(batch, 0)
    for b, row in enumerate(parents):
        for t, parent in enumerate(row):
            if parent >= 0:
                sees[b, t] |= sees[b, parent]
    lengths = np.asarray([num_slots - num_new, block - num_new // 2][:batch])  # full; across a block boundary
    slots = jnp.asarray(lengths[:, None] + np.arange(num_new)[None], jnp.int32)
    mask = NewTokenMask(jnp.asarray(sees))
    want, *written = _reference(q, k_new, v_new, k_cache, v_cache, slots, _config(num_heads, num_kv, 16),
                                visible=mask.dense(slots[:, 0], num_slots))
    got = kernel(q, k_new, v_new, k_cache, v_cache, slots, sees=mask.sees, num_splits=num_splits, block=block)
    assert_float32_close(got[0], want)
    for got_cache, want_cache in zip(got[1:], written):
        np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(want_cache))


@pytest.mark.parametrize("batch, num_heads, num_kv, head_dim, num_slots, fills", [
    (2, 8, 2, 16, 300, (100, 250)),
    pytest.param(4, 32, 8, 128, 512, (200, 63, 0, 505),  # Llama-3.1-8B's heads over four splits of two blocks
                 marks=pytest.mark.slow),  # long, interpreted: full tier
])
def test_a_rows_result_does_not_depend_on_the_tokens_beside_it(batch, num_heads, num_kv, head_dim, num_slots, fills):
    """The last token of a verification block gets what a decode step at its slot gets once the block's
    other tokens are in the cache, to rounding: split boundaries come from the shapes, not from the
    fill level, and a new token's key and value are the ones the cache holds. Not bit for bit: the
    16- and 32-row blocks' products and combine may round differently (benchmarks/probes/decode_attention_rounding.py
    shows one float32 ulp at the 8B shape, interpreted on the CPU and compiled on the GPU)."""
    q, k_new, v_new, k_cache, v_cache, _ = _inputs(0, batch, 6, num_heads, num_kv, head_dim, num_slots)
    slots = jnp.asarray([[fill + t for t in range(6)] for fill in fills], jnp.int32)
    block, k_written, v_written = kernel(q, k_new, v_new, k_cache, v_cache, slots, interpret=True)
    step, k_again, v_again = kernel(q[:, -1:], k_new[:, -1:], v_new[:, -1:], k_written, v_written,
                                    slots[:, -1:], interpret=True)
    np.testing.assert_allclose(np.asarray(step[:, 0]), np.asarray(block[:, -1]), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(np.asarray(k_again), np.asarray(k_written))
    np.testing.assert_array_equal(np.asarray(v_again), np.asarray(v_written))


def test_bfloat16_inputs_match_the_reference_to_rounding():
    q, k_new, v_new, k_cache, v_cache, _ = _inputs(1, 2, 1, 8, 2, 64, 128, jnp.bfloat16)
    slots = jnp.asarray([[5], [127]], jnp.int32)
    want, want_k, want_v = _reference(q, k_new, v_new, k_cache, v_cache, slots, _config(8, 2, 64))
    got, got_k, got_v = kernel(q, k_new, v_new, k_cache, v_cache, slots)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2, rtol=0)
    np.testing.assert_array_equal(np.asarray(got_k, np.float32), np.asarray(want_k, np.float32))
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), np.asarray(want_v, np.float32))


def test_bad_inputs_are_refused():
    q, k_new, v_new, k_cache, v_cache, _ = _inputs(2, 1, 32, 8, 2, 16, 64)
    with pytest.raises(ValueError, match=r"T \* G <= 64 .* T = 32, G = 4"):
        decode_attention(q, k_new, v_new, k_cache, v_cache, jnp.zeros((1, 32), jnp.int32))
    q, k_new, v_new, k_cache, v_cache, _ = _inputs(2, 1, 1, 8, 2, 16, 64)
    with pytest.raises(ValueError, match=r"caches in the queries' dtype float32, got k_cache bfloat16"):
        decode_attention(q, k_new, v_new, k_cache.astype(jnp.bfloat16), v_cache, jnp.zeros((1, 1), jnp.int32))


@pytest.mark.parametrize("num_new, num_splits, causal, tree", [(1, None, True, False), (6, None, True, False),
                                                               (6, 1, True, False), (16, None, False, False),
                                                               (61, None, True, True)])
def test_the_kernel_lowers_through_triton_for_cuda(lower_for_cuda, num_new, num_splits, causal, tree):
    batch, heads, kv, head_dim, slots = 2, 32, 8, 128, 512
    shapes = [(batch, num_new, heads, head_dim), (batch, num_new, kv, head_dim), (batch, num_new, kv, head_dim),
              (batch, slots, kv, head_dim), (batch, slots, kv, head_dim)]
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in shapes]
    kernel = functools.partial(decode_attention, interpret=False, num_splits=num_splits, causal=causal)
    if tree:
        kernel = lambda *a, kernel=kernel: kernel(*a[:-1], sees=a[-1])  # noqa: E731
    module = lower_for_cuda(kernel, *args, jax.ShapeDtypeStruct((batch, num_new), jnp.int32),
                            *([jax.ShapeDtypeStruct((batch, num_new, num_new), jnp.bool_)] if tree else []))
    assert "__gpu$xla.gpu.triton" in module


@pytest.fixture
def fresh_availability():
    """decode_attention.available() checked anew: its answer and its probe's compiled kernel are cached."""
    attention_kernel.available.cache_clear()
    jax.clear_caches()
    yield
    attention_kernel.available.cache_clear()


def test_the_kernel_is_available_where_its_lowering_is(fresh_availability):
    assert attention_kernel.available()  # interpreted on the CPU, through the Triton lowering's store


@pytest.mark.parametrize("missing", ["lowering", pytest.param("compile", marks=pytest.mark.slow)])  # one case fast
def test_without_the_kernel_a_gpu_attends_through_xla_with_one_warning(monkeypatch, fresh_availability, missing):
    """The GPU's default layout (built here on any backend): with Pallas' Triton lowering hidden (its
    import fails) or its compile failing, every layer attends through XLA, one warning says why, and the
    model computes what the XLA attention path computes."""
    stacked = hf.load(fixture_dir("llama_gqa"))

    def broken_compile(**options):
        raise RuntimeError("triton compile failed")

    with monkeypatch.context() as patch, pytest.warns(RuntimeWarning) as records:
        patch.setattr(jax, "default_backend", lambda: "gpu")
        if missing == "lowering":
            patch.setitem(sys.modules, attention_kernel.TRITON, None)
        else:
            patch.setattr(importlib.import_module(attention_kernel.TRITON), "CompilerParams", broken_compile)
        models = [to_decoding_layout(stacked), to_decoding_layout(stacked)]  # the check runs once
    fallbacks = [str(r.message) for r in records if "attend through XLA" in str(r.message)]
    assert len(fallbacks) == 1, [str(r.message) for r in records]
    assert ("ModuleNotFoundError" if missing == "lowering" else "triton compile failed") in fallbacks[0]
    assert not any(layer.attention_kernel for model in models for layer in model.layers)
    xla = to_decoding_layout(stacked, attention_kernel=False)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, stacked.config.vocab_size, (2, 5)))
    outputs = []
    for model in (models[0], xla):
        cache, logits = model.create_cache(2, 16), []
        for start in range(0, 5, 2):  # a prefill, then cached steps of T = 2 and 1
            chunk = tokens[:, start:start + 2]
            out, _, cache = forward(model, chunk, positions_like(chunk) + start, cache)
            logits.append(np.asarray(out))
        outputs.append(np.concatenate(logits, axis=1))
    np.testing.assert_array_equal(outputs[0], outputs[1])


@pytest.mark.slow
def test_a_trees_verification_forward_attends_through_the_kernel_and_computes_xlas_logits():
    """The loop's verification forward over a tree (sizing.tree_verify_forward, as decoding runs it)
    takes the kernel in the decoding layout, not a silent fallback to XLA, with the logits XLA computes."""
    from support.jaxpr import primitives

    from specjax.trees.sizing import tree_verify_forward

    stacked = hf.load(fixture_dir("llama_gqa"))
    parents = jnp.asarray([[-1, -1, 0, 0, 1], [-1, 0, 1, 2, 3]], jnp.int32)  # a tree and a chain
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, stacked.config.vocab_size, (2, 6)), jnp.int32)
    logits = []
    for attention_kernel in (True, False):
        model = to_decoding_layout(stacked, attention_kernel=attention_kernel)
        cache = model.create_cache(2, 32)
        _, _, cache = model(tokens, positions_like(tokens), cache)  # a committed prefix of 6 tokens a row
        jaxpr = jax.make_jaxpr(tree_verify_forward)(model, cache, tokens, parents)
        assert (("pallas_call" in {name for name, _ in primitives(jaxpr.jaxpr)}) == attention_kernel)
        logits.append(np.asarray(tree_verify_forward(model, cache, tokens, parents)))
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-4, rtol=0)
