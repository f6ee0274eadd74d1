"""Training at scale, on tiny models: the full forward's attention through jax.nn.dot_product_attention,
rematerialisation, gradient accumulation, mixed precision, the out-of-memory message, and the matmul
precision setting reaching the compiled program."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.jaxpr import primitives
from support.models import dflash_config, eagle_config, forward, positions_like, target_and_drafts
from flax import nnx

from specjax.config import ConfigError, DataConfig, ModelConfig, OptimizerConfig, TrainConfig, TrainingRun
from specjax.models.transformer import init_model
from specjax.training import loop
from specjax.training.lm import (TrainingOutOfMemory, activation_bytes, execution_config, fit, next_token_loss,
                                 out_of_memory_message)

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                     intermediate_size=64, init_std=0.3)


def tokens(batch=4, length=17, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (batch, length)), jnp.int32)


@pytest.mark.parametrize("changes", [{}, {"sliding_window": 5}, {"num_kv_heads": 1}, {"qk_norm": True}])
def test_dot_product_attention_equals_the_einsum_attention(changes):
    config = dataclasses.replace(CONFIG, **changes)
    batch = tokens()
    logits, hidden, _ = forward(init_model(config, seed=1), batch, positions_like(batch), hidden_layers=(1,))
    reference, ref_hidden, _ = forward(init_model(dataclasses.replace(config, attention_impl="einsum"), seed=1),
                                       batch, positions_like(batch), hidden_layers=(1,))
    # On the H200 (float32 at 'highest') the two softmax orders differ by up to 1.06e-5 on a logit of 0.23.
    tolerance = dict(atol=1e-5) if jax.default_backend() == "cpu" else dict(atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(logits, reference, **tolerance)
    np.testing.assert_allclose(hidden.layers, ref_hidden.layers, **tolerance)


def test_bfloat16_dot_product_attention_is_as_close_to_float32_as_the_einsum_attention():
    batch = tokens()

    def logits(**changes):
        return np.asarray(forward(init_model(dataclasses.replace(CONFIG, **changes), seed=1), batch,
                                  positions_like(batch))[0])

    exact = logits()
    error = np.abs(logits(dtype="bfloat16") - exact).max()
    einsum_error = np.abs(logits(dtype="bfloat16", attention_impl="einsum") - exact).max()
    assert 0 < error <= 1.5 * einsum_error, (error, einsum_error)  # bfloat16 rounding, no worse than before


def loss_and_grads(config):
    model = init_model(config, seed=2)
    batch = tokens(length=17, seed=3)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss = lambda p: next_token_loss(nnx.merge(graphdef, p, rest), batch)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss))(params), jax.make_jaxpr(jax.grad(loss))(params)


@pytest.mark.train
def test_remat_policies_give_the_same_loss_and_gradients():
    def products(jaxpr):
        return sum(name == "dot_general" for name, _ in primitives(jaxpr.jaxpr))

    (loss, grads), jaxpr = loss_and_grads(CONFIG)
    recomputed = {}
    for policy in ("layer", "dots"):
        (remat_loss, remat_grads), remat_jaxpr = loss_and_grads(dataclasses.replace(CONFIG, remat=policy))
        recomputed[policy] = products(remat_jaxpr) - products(jaxpr)
        np.testing.assert_allclose(remat_loss, loss, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(remat_grads), jax.tree.leaves(grads), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
    # The backward pass recomputes the layer's products: all of them under 'layer', under 'dots' only the
    # attention's two (batched, so not saveable).
    assert recomputed["layer"] > recomputed["dots"] == 2, recomputed


def head_loss_and_grads(kind: str, remat: str):
    """A draft module's training loss and gradients on target_and_drafts()'s target, its layers under remat."""
    from specjax.models.dflash import init_dflash
    from specjax.models.eagle import init_eagle
    from specjax.training.dflash import dflash_loss, sample_anchors
    from specjax.training.eagle import eagle1_loss, eagle3_loss

    target, _ = target_and_drafts()
    batch = jnp.asarray(np.random.default_rng(5).integers(0, 100, (2, 17)), jnp.int32)
    if kind == "dflash":
        module = init_dflash(dflash_config(target.config, (0, 1), 8, remat=remat), seed=0)
        anchors = jnp.asarray(sample_anchors(np.random.default_rng(0), 2, 16, 8, 2), jnp.int32)
        loss = lambda m: dflash_loss(m, target, batch[:, :16], anchors, 7.0, 0.5)[0]  # noqa: E731
    else:
        version = 1 if kind == "eagle1" else 3
        config = eagle_config(target.config, version, **({} if version == 1 else {"draft_vocab_size": 100}))
        module = init_eagle(dataclasses.replace(config, layer=dataclasses.replace(config.layer, remat=remat)), seed=3)
        noise = jnp.zeros((2, 16, target.config.hidden_size))
        loss = ((lambda m: eagle1_loss(m, target, batch, noise)[0]) if version == 1  # noqa: E731
                else (lambda m: eagle3_loss(m, target, batch, 3, 0.8)[0]))
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    value_and_grad = jax.value_and_grad(lambda p: loss(nnx.merge(graphdef, p, rest)))
    products = sum(name == "dot_general" for name, _ in primitives(jax.make_jaxpr(value_and_grad)(params).jaxpr))
    return jax.jit(value_and_grad)(params), products


@pytest.mark.train
@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "dflash"])
def test_remat_of_draft_heads_gives_the_same_loss_and_gradients(kind):
    (loss, grads), products = head_loss_and_grads(kind, "none")
    for policy in ("layer", "dots"):
        (remat_loss, remat_grads), remat_products = head_loss_and_grads(kind, policy)
        assert remat_products > products, policy  # the head's layers are recomputed in the backward pass
        np.testing.assert_allclose(remat_loss, loss, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(remat_grads), jax.tree.leaves(grads), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)


def run_config(tmp_path, data_devices: int = 1, **changes) -> TrainingRun:
    return TrainingRun(data=DataConfig(seq_len=16, batch_size=8), optimizer=OptimizerConfig(
        lr=1e-3, warmup_steps=0, total_steps=3), output_dir=str(tmp_path), checkpoint_every=100, log_every=1,
        mesh=dataclasses.replace(TrainingRun().mesh, data=data_devices), **changes)


def train_three_steps(tmp_path, **changes):
    run = run_config(tmp_path, **changes)
    model = init_model(execution_config(CONFIG, run), seed=4)

    def batch_fn(step):
        return np.random.default_rng(step).integers(0, CONFIG.vocab_size, (8, 17)).astype(np.int32)

    def loss_fn(model, batch, frozen):
        loss = next_token_loss(model, batch)
        return loss, {"loss": loss}

    fit(model, loss_fn, batch_fn, run, tmp_path, description="test")
    return loop.read_metrics(tmp_path / "metrics.jsonl")


@pytest.mark.train
def test_gradient_accumulation_equals_the_whole_batch(tmp_path):
    whole = train_three_steps(tmp_path / "whole")
    accumulated = train_three_steps(tmp_path / "accumulated", grad_accum_steps=4)
    # data parallel: each of 4 devices holds a share of each of the 2 micro-batches (tests/conftest.py's
    # eight host devices)
    parallel = train_three_steps(tmp_path / "parallel", data_devices=4, grad_accum_steps=2)
    # Sums in another order: 4e-6 apart on this CPU, 3x that allowed for others' (CI's rounded logits 3x further).
    for name in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[name] for r in accumulated], [r[name] for r in whole], rtol=5e-5)
        np.testing.assert_allclose([r[name] for r in parallel], [r[name] for r in whole], rtol=5e-5)


@pytest.mark.train
def test_bfloat16_compute_keeps_float32_master_weights(tmp_path):
    run = run_config(tmp_path, compute_dtype="bfloat16", remat="layer")
    config = execution_config(dataclasses.replace(CONFIG, param_dtype="bfloat16"), run)
    assert (config.param_dtype, config.dtype, config.remat) == ("float32", "bfloat16", "layer")
    records = train_three_steps(tmp_path, compute_dtype="bfloat16", remat="dots")
    reference = train_three_steps(tmp_path / "float32")
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in reference], rtol=0.02)


@pytest.mark.parametrize("changes, message", [
    (dict(remat="all"), r"TrainingRun.remat = 'all' is invalid: allowed one of \['none', 'layer', 'dots'\]"),
    (dict(grad_accum_steps=3),
     r"TrainingRun.grad_accum_steps = 3 is invalid: allowed a divisor of data.batch_size \(8\)"),
    (dict(grad_accum_steps=0), r"TrainingRun.grad_accum_steps = 0 is invalid: allowed an integer >= 1"),
    (dict(compute_dtype="float8"), r"TrainingRun.compute_dtype = 'float8' is invalid: allowed None or one of"),
])
def test_bad_training_settings_name_the_field(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        run_config(tmp_path, **changes)


@pytest.mark.parametrize("changes, message", [
    (dict(remat="yes"), r"ModelConfig.remat = 'yes' is invalid: allowed one of"),
    (dict(attention_impl="flash"), r"ModelConfig.attention_impl = 'flash' is invalid: allowed one of \['auto', "),
    (dict(matmul_precision="tf32"), r"ModelConfig.matmul_precision = 'tf32' is invalid: allowed one of"),
])
def test_bad_model_execution_settings_name_the_field(changes, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(CONFIG, **changes)


def test_an_lm_run_takes_its_remat_from_the_run_only():
    with pytest.raises(ConfigError, match=r"TrainConfig.model.remat = 'layer' is invalid: allowed 'none'"):
        TrainConfig(model=dataclasses.replace(CONFIG, remat="layer"))


def test_out_of_memory_names_the_settings_and_the_estimate(tmp_path):
    run = run_config(tmp_path, remat="layer", grad_accum_steps=2)
    model = init_model(CONFIG, seed=0)

    def loss_fn(model, batch, frozen):  # what XLA raises when the step does not fit
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 125.00GiB.")

    with pytest.raises(TrainingOutOfMemory) as error:
        fit(model, loss_fn, lambda step: np.zeros((8, 17), np.int32), run, tmp_path, description="test",
            model_config=execution_config(CONFIG, run))
    text = str(error.value)
    for part in ("data.batch_size=8", "data.seq_len=16", "remat='layer'", "grad_accum_steps=2",
                 "micro-batches of 4 rows", "estimated activation memory", "GiB", "remat: layer",
                 "XLA said: RESOURCE_EXHAUSTED"):
        assert part in text, part


def test_the_activation_estimate_matches_the_h200_measurements():
    # 12 x 768, seq 1024, batch 64, bfloat16 (docs/performance.md, "Training at scale"): XLA attention
    # without remat ran out of memory asking for 125 GiB; cuDNN attention with per-layer remat peaked at
    # 8.8 GiB with weights and AdamW state (about 1.3 GiB for 110M float32 parameters); the goal is 16 GiB.
    shape = ModelConfig(vocab_size=16384, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12,
                        head_dim=64, intermediate_size=3072, dtype="bfloat16")
    einsum = activation_bytes(dataclasses.replace(shape, attention_impl="einsum"), 64, 1024)
    flash = activation_bytes(dataclasses.replace(shape, attention_impl="cudnn", remat="layer"), 64, 1024)
    def total(estimate):  # attention_scores are part of layers
        return (estimate["layers"] + estimate["logits"]) / 2 ** 30

    assert 100 < total(einsum) < 160
    assert 2 < total(flash) < 16
    assert flash["attention_scores"] == 0
    message = out_of_memory_message(RuntimeError("RESOURCE_EXHAUSTED"), TrainingRun(), shape)
    assert "estimated activation memory of one micro-batch" in message


def dot_precisions(model, batch) -> list[str]:
    text = jax.jit(lambda m, t: m(t, positions_like(t))[0]).lower(model, batch).as_text()
    return [line for line in text.splitlines() if "dot_general" in line]


def test_the_matmul_precision_setting_reaches_the_compiled_program():
    batch = tokens(batch=2, length=8)
    # An outer TF32 request (a GPU's default) must not reach a float32 model's products.
    with jax.default_matmul_precision("tensorfloat32"):
        float32 = dot_precisions(init_model(CONFIG), batch)
        allowed = dot_precisions(init_model(dataclasses.replace(CONFIG, matmul_precision="default")), batch)
        bfloat16 = dot_precisions(init_model(dataclasses.replace(CONFIG, dtype="bfloat16")), batch)
    assert float32 and all("precision = [HIGHEST, HIGHEST]" in line for line in float32)
    assert allowed and not any("HIGHEST" in line for line in allowed)
    assert bfloat16 and not any("HIGHEST" in line for line in bfloat16)
