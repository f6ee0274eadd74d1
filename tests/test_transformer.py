"""The model with its KV cache: ragged prefill plus token-by-token decode equals one full forward,
row by row, and each row of a ragged batch equals that prompt run alone."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import fixture_dir
from support.models import assert_float32_close, forward, positions_like

from specjax.models import hf, transformer
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import DecodingLayer, for_decoding, layer_weight_bytes, to_decoding_layout

PROMPT_LENGTHS = (5, 9, 2)
DECODE_STEPS = 7


@pytest.mark.parametrize("name", ["llama_gqa", "mistral", "llama_head_dim_mqa", "gpt2", "qwen2"])
def test_ragged_prefill_then_decode_equals_full_forward_of_each_row(name):
    model = hf.load(fixture_dir(name))
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, model.config.vocab_size, n + DECODE_STEPS) for n in PROMPT_LENGTHS]
    width = max(PROMPT_LENGTHS)
    prompts = np.zeros((len(sequences), width), np.int32)  # right-padded with token 0
    for row, n in enumerate(PROMPT_LENGTHS):
        prompts[row, :n] = sequences[row][:n]
    lengths = jnp.asarray(PROMPT_LENGTHS)

    cache = KVCache.create(model.config, len(sequences), 32)
    logits, _, cache = forward(model, jnp.asarray(prompts), positions_like(prompts), cache)
    cache = cache.with_lengths(lengths)  # drop the padding: only lengths say what is valid
    incremental = [[np.asarray(logits[row, :n])] for row, n in enumerate(PROMPT_LENGTHS)]
    for step in range(DECODE_STEPS):
        positions = lengths + step
        tokens = jnp.asarray([[seq[n + step]] for seq, n in zip(sequences, PROMPT_LENGTHS)])
        logits, _, cache = forward(model, tokens, positions[:, None], cache)
        for row in range(len(sequences)):
            incremental[row].append(np.asarray(logits[row]))
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + DECODE_STEPS)

    for row, seq in enumerate(sequences):
        alone, _, _ = forward(model, jnp.asarray(seq[None]), positions_like(seq[None]), None)
        assert_float32_close(np.concatenate(incremental[row]), alone[0], err_msg=f"row {row}")


def test_rollback_is_only_resetting_lengths():
    """Write garbage past a row's length, roll back, continue: the result ignores the garbage."""
    model = hf.load(fixture_dir("llama_gqa"))
    seq = jnp.asarray([[3, 14, 15, 92, 65, 35]])
    positions = positions_like(seq)
    full, _, _ = forward(model, seq, positions, None)
    cache = KVCache.create(model.config, 1, 16)
    _, _, cache = forward(model, seq[:, :3], positions[:, :3], cache)
    _, _, cache = forward(model, jnp.asarray([[7, 7, 7, 7]]), jnp.arange(3, 7)[None], cache)  # drafts, rejected
    cache = cache.with_lengths(jnp.asarray([3]))
    logits, _, _ = forward(model, seq[:, 3:], positions[:, 3:], cache)
    assert_float32_close(logits, full[:, 3:])


def test_hidden_layers_out_of_range_is_refused():
    model = hf.load(fixture_dir("llama_gqa"))
    tokens = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match=r"hidden_layers entry 3 is out of range: allowed 0..2"):
        model(tokens, positions_like(tokens), hidden_layers=(3,))


def test_bfloat16_compute_stays_close_to_float32():
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 128, (2, 10)))
    f32, _, _ = forward(hf.load(fixture_dir("llama_gqa")), tokens, positions_like(tokens))
    bf16_model = hf.load(fixture_dir("llama_gqa"), param_dtype="bfloat16")
    bf16, hidden, _ = forward(bf16_model, tokens, positions_like(tokens))
    assert bf16.dtype == jnp.float32 and hidden.final.dtype == jnp.bfloat16
    assert np.abs(np.asarray(bf16) - np.asarray(f32)).max() < 0.15 * np.abs(np.asarray(f32)).max()



def test_low_precision_products_differentiate_in_their_own_precision(monkeypatch):
    """On accelerators einsum_f32 (float32 results of bfloat16 products: logits, the row-parallel projections)
    differentiates as a bfloat16 einsum does, the cotangent rounded to bfloat16 and both backward products
    bfloat16 x bfloat16, not the float32 cotangent against a bfloat16 input (a TF32 product at half the rate)."""
    monkeypatch.setattr("jax.default_backend", lambda: "gpu")
    rng = np.random.default_rng(0)
    x, w = (jnp.asarray(rng.normal(size=shape), jnp.bfloat16) for shape in ((6, 8), (8, 5)))

    def loss(x, w):
        return jnp.sum(transformer.einsum_f32("td,dv->tv", x, w) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w).jaxpr
    products = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert products and all(v.aval.dtype == jnp.bfloat16 for e in products for v in e.invars)
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    assert dx.dtype == dw.dtype == jnp.bfloat16
    y = jnp.einsum("td,dv->tv", x, w, preferred_element_type=jnp.float32)
    cotangent = (2 * y).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(cotangent @ w.T))
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(x.T @ cotangent))
    # remat 'dots' keeps such a product for the backward pass as it keeps a plain one (the policy cannot see it
    # inside its custom_vjp: it is named); 'layer' recomputes it, the control.
    config = hf.load(fixture_dir("llama_gqa")).config
    for remat, forward_products in (("dots", 1), ("layer", 2)):
        step = transformer.checkpointed(lambda x, w: loss(jnp.tanh(x), w), dataclasses.replace(config, remat=remat))
        assert str(jax.make_jaxpr(jax.grad(step, argnums=(0, 1)))(x, w)).count("custom_vjp_call") == forward_products
    # Against float32 products throughout: within bfloat16's rounding.
    fx, fw = jax.grad(lambda x, w: jnp.sum((x @ w) ** 2), argnums=(0, 1))(x.astype(jnp.float32), w.astype(jnp.float32))
    for low, full in ((dx, fx), (dw, fw)):
        np.testing.assert_allclose(np.asarray(low, np.float32), np.asarray(full), rtol=0, atol=0.02 * float(jnp.abs(full).max()))


# The interpreted kernel's cases of gpt2 and qwen2 are long: full tier (`slow`); llama_gqa's stays fast.
@pytest.mark.parametrize("name, model_shards, attention_kernel", [
    *((name, *case) for name in ("llama_gqa", "gpt2", "qwen2") for case in ((1, False), (2, False))),
    ("llama_gqa", 1, True), *(pytest.param(name, 1, True, marks=pytest.mark.slow) for name in ("gpt2", "qwen2"))])
def test_the_decoding_layout_is_the_same_model(name, model_shards, attention_kernel):
    """to_decoding_layout (per-layer arrays, fused q/k/v and gate/up, shard-major for model_shards; cached
    steps attending through the Pallas decode-attention kernel, interpreted here, or XLA) computes
    what the stacked model computes: a full forward with hidden layers, then cached decode steps."""
    stacked = hf.load(fixture_dir(name))
    split = to_decoding_layout(stacked, model_shards, attention_kernel)
    assert isinstance(split.layers[0], DecodingLayer) and len(split.layers) == stacked.config.num_layers
    assert split.layers[0].attention_kernel == attention_kernel
    assert to_decoding_layout(split) is split
    c = stacked.config
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, c.vocab_size, (2, 9)))
    hidden_layers = (0, c.num_layers - 1, c.num_layers)
    (la, ha, _), (lb, hb, _) = (forward(m, tokens, positions_like(tokens), hidden_layers=hidden_layers)
                                for m in (stacked, split))
    assert_float32_close(lb, la)
    # The residual stream grows to ~10 here: float32 rounding of differently blocked products, to scale.
    scale = float(np.abs(np.asarray(ha.layers)).max())
    np.testing.assert_allclose(np.asarray(hb.layers), np.asarray(ha.layers), atol=2e-6 * scale, rtol=0)
    # Each model with the cache it makes: stacked, and one array per layer for the split model.
    caches = [m.create_cache(2, 16) for m in (stacked, split)]
    assert isinstance(caches[1].k, tuple) and len(caches[1].k) == c.num_layers and caches[1].max_length == 16
    for step in range(3):
        chunk = tokens[:, 3 * step:3 * step + 3]
        positions = positions_like(chunk) + 3 * step
        (la, _, caches[0]), (lb, _, caches[1]) = (forward(m, chunk, positions, cache) for m, cache in
                                                   zip((stacked, split), caches))
        assert_float32_close(lb, la, err_msg=f"step {step}")
    assert_float32_close(np.stack(caches[1].k), caches[0].k)
    np.testing.assert_array_equal(caches[1].lengths, caches[0].lengths)


@pytest.mark.parametrize("backend", ["cpu", "tpu", "gpu"])
def test_the_decoding_layout_is_taken_on_gpus_for_large_layers_only(monkeypatch, backend):
    model = hf.load(fixture_dir("llama_gqa"))
    c = model.config
    # A Llama layer: q/k/v, output, gate/up/down, two norms.
    layer_params = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + \
        c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    assert layer_weight_bytes(model) == layer_params * np.dtype(c.param_dtype).itemsize
    monkeypatch.setattr("jax.default_backend", lambda: backend)
    assert for_decoding(model) is model  # too small to gain from it, on any backend
    monkeypatch.setattr(transformer, "DECODING_LAYOUT_MIN_LAYER_BYTES", layer_weight_bytes(model))
    if backend == "gpu":
        assert isinstance(for_decoding(model, 2).layers[0], DecodingLayer)
    else:  # the stacked model as is
        assert for_decoding(model) is model


def test_a_model_in_the_decoding_layout_is_not_saved(tmp_path):
    with pytest.raises(ValueError, match=r"decoding layout .* save the stacked model"):
        hf.save(to_decoding_layout(hf.load(fixture_dir("llama_gqa"))), tmp_path / "out")
