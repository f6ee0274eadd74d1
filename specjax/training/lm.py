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
from specjax.config import ModelConfig, OptimizerConfig, TrainConfig, TrainingRun
from specjax.data.dataset import batch_at, eval_batches, prepare
from specjax.models import hf
from specjax.models.transformer import Transformer, full_attention_impl, num_parameters
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


def execution_config(config: ModelConfig, run: TrainingRun) -> ModelConfig:
    """config as run trains it: run's remat policy and, with run.compute_dtype, float32 weights (the
    master copy the optimizer updates) computed in that dtype."""
    config = dataclasses.replace(config, remat=run.remat)
    if run.compute_dtype is None:
        return config
    return dataclasses.replace(config, param_dtype="float32", dtype=run.compute_dtype)


class TrainingOutOfMemory(RuntimeError):
    """A training step did not fit in device memory; the message names the settings that decide it."""


def is_out_of_memory(error: Exception) -> bool:
    """XLA's resource-exhausted error (raised by the step call or by reading its results)."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def activation_bytes(config: ModelConfig, batch_size: int, seq_len: int) -> dict[str, int]:
    """An estimate of what one full forward of config over [batch_size, seq_len] keeps for the backward
    pass, in bytes: 'layers' (every layer's activations under config.remat and attention), of which
    'attention_scores' (the [T, T] scores and probabilities an XLA or einsum attention keeps), and 'logits'
    (float32 logits and their gradient)."""
    c = config
    tokens = batch_size * seq_len
    width = jnp.dtype(c.jnp_dtype).itemsize
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    # Per layer and token: norms' inputs and float32 statistics, q/k/v, attention output, residuals, MLP.
    per_token = width * (4 * c.hidden_size + qkv + c.num_heads * c.head_dim + 3 * c.intermediate_size) \
        + 8 * c.hidden_size
    flash = full_attention_impl(c) == "cudnn"
    # float32 scores and probabilities plus the probabilities in the compute dtype, per head and query.
    scores = 0 if flash else batch_size * c.num_heads * seq_len * seq_len * (8 + width)
    per_layer = {"none": tokens * per_token + scores,
                 "layer": tokens * width * c.hidden_size,  # each layer's input
                 "dots": tokens * width * (qkv + 2 * c.hidden_size + 2 * c.intermediate_size)}[c.remat]
    # The layer being recomputed holds its whole activation set once.
    recomputed = 0 if c.remat == "none" else tokens * per_token + scores
    return {"layers": c.num_layers * per_layer + recomputed,
            "attention_scores": scores * (c.num_layers if c.remat == "none" else 1),
            "logits": tokens * c.vocab_size * 8}


def out_of_memory_message(error: Exception, run: TrainingRun, config: ModelConfig | None) -> str:
    """What a training step that ran out of memory asked for, with an estimate and what to change."""
    data = run.data
    micro = data.batch_size // run.grad_accum_steps
    text = (f"the training step ran out of device memory at data.batch_size={data.batch_size}, "
            f"data.seq_len={data.seq_len}, remat={run.remat!r}, grad_accum_steps={run.grad_accum_steps} "
            f"(micro-batches of {micro} rows), compute_dtype={run.compute_dtype!r}")
    if config is not None:
        estimate = activation_bytes(config, micro, data.seq_len)
        gib = {name: value / 2 ** 30 for name, value in estimate.items()}
        text += (f"; estimated activation memory of one micro-batch: {gib['layers'] + gib['logits']:.1f} GiB "
                 f"(layers {gib['layers']:.1f} GiB, of which attention scores {gib['attention_scores']:.1f} GiB; "
                 f"logits {gib['logits']:.1f} GiB) with attention {full_attention_impl(config)!r}")
    text += (". Lower it with remat: layer (or dots), a larger grad_accum_steps, compute_dtype: bfloat16 (on GPUs "
             "cuDNN's flash attention keeps no [T, T] scores), or a smaller data.batch_size / data.seq_len. "
             f"XLA said: {str(error).splitlines()[0][:300]}")
    return text


def micro_batches(batch, count: int):
    """Every [B, ...] leaf of batch as [count, B / count, ...]: micro-batch i takes rows i, i + count, ...,
    so that each device's rows of the data axis hold a share of every micro-batch."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // count, count, *x.shape[1:]).swapaxes(0, 1), batch)


def fit(module: nnx.Module, loss_fn, batch_fn, run: TrainingRun, output_dir: Path, *, description: str,
        frozen=None, model_config: ModelConfig | None = None) -> nnx.Module:
    """Trains the module's nnx.Param (other variables stay fixed) to minimise
    loss_fn(module, batch, frozen) -> (loss, metrics) over batch_fn(step) with run's optimizer, on
    run's mesh (batches over the data axis; weights and optimizer state split by specjax.sharding's
    rules, and over the data axis too with run.fsdp), resumable; returns the trained module.
    `frozen` (e.g. the target a head learns from) is passed to the compiled step as an argument, not
    baked into it as constants. With run.grad_accum_steps > 1 each step averages the gradients (and
    metrics) of that many micro-batches, as the whole batch's mean loss would give. A step that runs out
    of device memory raises TrainingOutOfMemory naming the settings and estimating the activation memory
    of model_config (the model whose activations dominate)."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    tx = optimizer(run.optimizer)
    mesh = sharding.make_mesh(run.mesh.data, run.mesh.model)
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    state_shardings = sharding.shardings(state, mesh, run.fsdp)
    state = jax.device_put(state, state_shardings)
    rest, frozen = sharding.shard(rest, mesh), sharding.shard(frozen, mesh)

    def loss_of(params, batch, frozen):
        return loss_fn(nnx.merge(graphdef, params, rest), batch, frozen)

    grad_of = jax.value_and_grad(loss_of, has_aux=True)

    def accumulated_grads(params, batch, frozen):
        """The mean gradients and metrics over run.grad_accum_steps micro-batches (one lax.scan)."""
        def add(total, micro):
            (_, metrics), grads = grad_of(params, micro, frozen)
            return jax.tree.map(jnp.add, total, (grads, metrics)), None

        micro = micro_batches(batch, run.grad_accum_steps)
        shapes = jax.eval_shape(lambda: grad_of(params, jax.tree.map(lambda x: x[0], micro), frozen))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (shapes[1], shapes[0][1]))
        total, _ = jax.lax.scan(add, zeros, micro)
        return jax.tree.map(lambda x: x / run.grad_accum_steps, total)

    @functools.partial(jax.jit, out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())))
    def train_step(state, batch, frozen):
        if run.grad_accum_steps == 1:
            (_, metrics), grads = grad_of(state["params"], batch, frozen)
        else:
            grads, metrics = accumulated_grads(state["params"], batch, frozen)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    first = [True]

    def step(state, batch):
        try:
            state, metrics = train_step(state, batch, frozen)
            if first[0]:  # the first step's memory errors surface here, not at a later read of its results
                jax.block_until_ready(state)
                first[0] = False
            return state, metrics
        except Exception as error:  # XLA raises its runtime error type, which JAX does not export by name
            if is_out_of_memory(error):
                raise TrainingOutOfMemory(out_of_memory_message(error, run, model_config)) from error
            raise

    # The run's resolved config beside its metrics: what the figures were trained with, after every --set.
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / "run_config.json").write_text(
        json.dumps({"class": type(run).__name__, **dataclasses.asdict(run)}, indent=2, default=str) + "\n")
    with jax.set_mesh(mesh):
        state = loop.run(state, step,
                         lambda step: sharding.put(batch_fn(step), mesh),
                         total_steps=run.optimizer.total_steps, output_dir=output_dir,
                         checkpoint_every=run.checkpoint_every, log_every=run.log_every, description=description,
                         profile_steps=run.profile_steps)
    return nnx.merge(graphdef, state["params"], rest)


def train_lm(config: TrainConfig) -> dict:
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    data = config.data
    tokenizer, train_tokens, held_out_tokens = prepare(data, Path(data.cache_dir or output_dir))
    model_config = execution_config(dataclasses.replace(config.model, vocab_size=len(tokenizer)), config)
    model = Transformer(model_config, rngs=nnx.Rngs(params=config.seed))

    def batch_fn(step):
        return batch_at(train_tokens, step, data.batch_size, data.seq_len, config.seed)

    def loss_fn(model, batch, frozen):
        loss = next_token_loss(model, batch)
        return loss, {"loss": loss}

    trained = fit(model, loss_fn, batch_fn, config, output_dir, description="train-lm", model_config=model_config)
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
    memory = jax.local_devices()[0].memory_stats()  # None on the CPU
    if memory and "peak_bytes_in_use" in memory:
        summary["peak_device_memory_bytes"] = int(memory["peak_bytes_in_use"])
    (model_dir / "eval.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def evaluate(model: Transformer, batches: list[np.ndarray]) -> float:
    """Mean next-token cross-entropy over fixed held-out batches."""
    loss = jax.jit(next_token_loss)
    return float(np.mean([float(loss(model, jnp.asarray(batch))) for batch in batches]))
