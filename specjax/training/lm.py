"""Language-model pretraining (a target or a draft LM) from a TrainConfig.

Writes under output_dir: tokenizer/ and token files (data), checkpoints/ (orbax, resumable),
metrics.jsonl, and model/ (a Hugging Face folder with the tokenizer, loadable by specjax.models.hf
and by transformers) with eval.json (held-out loss and perplexity).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from specjax import sharding
from specjax.config import OptimizerConfig, TrainConfig, TrainingRun
from specjax.data.dataset import batch_at, eval_batches, prepare
from specjax.models import hf
from specjax.models.transformer import Transformer, num_parameters
from specjax.training import loop


def optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.lr, warmup_steps=config.warmup_steps,
        decay_steps=config.total_steps, end_value=config.lr * config.min_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(config.clip_norm),
                       optax.adamw(schedule, b1=config.b1, b2=config.b2, weight_decay=config.weight_decay))


def next_token_loss(model: Transformer, batch) -> jax.Array:
    """Mean cross-entropy of predicting batch[:, 1:] from batch[:, :-1]."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
    logits, _, _ = model(inputs, positions)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def fit(module: nnx.Module, loss_fn, batch_fn, run: TrainingRun, output_dir: Path, *, description: str,
        frozen=None) -> nnx.Module:
    """Trains the module's nnx.Param (other variables stay fixed) to minimise
    loss_fn(module, batch, frozen) -> (loss, metrics) over batch_fn(step) with run's optimizer, on
    run's mesh (batches over the data axis; weights and optimizer state split by specjax.sharding's
    rules, and over the data axis too with run.fsdp), resumable; returns the trained module.
    `frozen` (e.g. the target a head learns from) is passed to the compiled step as an argument, not
    baked into it as constants."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    tx = optimizer(run.optimizer)
    mesh = sharding.make_mesh(run.mesh.data, run.mesh.model)
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    state_shardings = sharding.shardings(state, mesh, run.fsdp)
    state = jax.device_put(state, state_shardings)
    rest, frozen = sharding.shard(rest, mesh), sharding.shard(frozen, mesh)

    def loss_of(params, batch, frozen):
        return loss_fn(nnx.merge(graphdef, params, rest), batch, frozen)

    @functools.partial(jax.jit, out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())))
    def train_step(state, batch, frozen):
        (_, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(state["params"], batch, frozen)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    with jax.set_mesh(mesh):
        state = loop.run(state, lambda state, batch: train_step(state, batch, frozen),
                         lambda step: sharding.put(batch_fn(step), mesh),
                         total_steps=run.optimizer.total_steps, output_dir=output_dir,
                         checkpoint_every=run.checkpoint_every, log_every=run.log_every, description=description)
    return nnx.merge(graphdef, state["params"], rest)


def train_lm(config: TrainConfig) -> dict:
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    data = config.data
    tokenizer, train_tokens, held_out_tokens = prepare(data, Path(data.cache_dir or output_dir))
    model_config = dataclasses.replace(config.model, vocab_size=len(tokenizer))
    model = Transformer(model_config, rngs=nnx.Rngs(params=config.seed))

    def batch_fn(step):
        return batch_at(train_tokens, step, data.batch_size, data.seq_len, config.seed)

    def loss_fn(model, batch, frozen):
        loss = next_token_loss(model, batch)
        return loss, {"loss": loss}

    trained = fit(model, loss_fn, batch_fn, config, output_dir, description="train-lm")
    held_out = evaluate(trained, eval_batches(held_out_tokens, config.eval_batches, data.batch_size, data.seq_len))
    model_dir = output_dir / "model"
    hf.save(trained, model_dir, extra_config={"bos_token_id": tokenizer.bos_token_id,
                                              "eos_token_id": tokenizer.eos_token_id,
                                              "pad_token_id": tokenizer.pad_token_id})
    tokenizer.save_pretrained(model_dir)
    summary = {"held_out_loss": held_out, "held_out_perplexity": math.exp(held_out),
               "parameters": num_parameters(trained),
               "train_tokens": int(len(train_tokens)), "held_out_tokens": int(len(held_out_tokens)),
               "steps": config.optimizer.total_steps}
    (model_dir / "eval.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def evaluate(model: Transformer, batches: list[np.ndarray]) -> float:
    """Mean next-token cross-entropy over fixed held-out batches."""
    loss = jax.jit(next_token_loss)
    return float(np.mean([float(loss(model, jnp.asarray(batch))) for batch in batches]))
