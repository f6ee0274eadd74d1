"""Training multi-token prediction modules on a frozen target (MTPTrainConfig; `specjax train-mtp`).

- The target runs once per batch of sequences [B, S] (a pure function of (seed, step), so a killed run
  resumes exactly), without a cache and under stop_gradient; its final-norm hidden states feed module 0.
- Every module runs over the whole sequence as specjax.models.mtp describes (module m at position s reads
  token x_{s+m+1} and the hidden state that MTPTrainConfig.hidden_state says) and predicts x_{s+m+2}
  through the target's LM head; positions whose label lies past the sequence are left out.
- The loss is DeepSeek-V3's over depths, sum_m weight_m * CE_m (loss_weights; by default the mean over
  modules), each CE_m against the sequence's token or, with distill_weight, mixed with the cross-entropy
  against the target's own distribution of that token (its output at s + m + 1). Embedding and LM head
  are the target's and stay frozen.
- The sequences are corpus windows or continuations the target writes itself (regenerate_sequences, as
  the DFlash trainer's; specjax.data.regenerate).

Writes under output_dir: tokenizer/ and token files (data), regenerated.npy, checkpoints/, metrics.jsonl, and
mtp/ (MiMo's tensor names, which load_mtp reads) with eval.json: the greedy mean acceptance length of the
closing held-out eval at K = eval_num_speculative_tokens and the final logged loss.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig, MTPTrainConfig, SpecConfig
from specjax.data.dataset import batch_at
from specjax.data.regenerate import frozen_target_and_tokens, own_text
from specjax.models.mtp import MTPConfig, MTPModules, init_mtp, save_mtp
from specjax.models.transformer import Transformer, num_parameters, unembed
from specjax.training import loop
from specjax.training.evaluation import held_out_prompts, mean_acceptance_length
from specjax.training.lm import execution_config, fit


def modules_config(config: MTPTrainConfig, target_config: ModelConfig) -> MTPConfig:
    """The untrained modules' shape: Qwen2 layers (MiMo's) as wide as the target's, MLP width
    config.intermediate_size."""
    layer = dataclasses.replace(target_config, num_layers=config.num_modules, architecture="Qwen2ForCausalLM",
                                qkv_bias=True, qk_norm=False, out_bias=False, mlp_bias=False, sliding_window=None,
                                intermediate_size=config.intermediate_size or target_config.intermediate_size)
    return MTPConfig(layer=execution_config(layer, config), hidden_state=config.hidden_state)


def mtp_loss(modules: MTPModules, target: Transformer, tokens: jax.Array, weights: tuple[float, ...],
             distill_weight: float):
    """The module docstring's loss on sequences [B, S]; (loss, metrics with each depth's accuracy)."""
    length = tokens.shape[1]
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens.shape)
    target_logits, hidden, _ = target(tokens, positions, compute_logits=distill_weight > 0)
    outs, _ = modules.over_sequence(tokens, jax.lax.stop_gradient(hidden.final), target.embed[...])
    lm_head = None if target.lm_head is None else target.lm_head[...]
    loss, metrics = 0.0, {}
    for module, (out, weight) in enumerate(zip(outs, weights)):
        valid = length - module - 2  # positions whose label x_{s + module + 2} is in the sequence
        log_probs = jax.nn.log_softmax(unembed(out[:, :valid], target.embed[...], lm_head, target.config.jnp_dtype))
        labels = tokens[:, module + 2:]
        ce = -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
        if distill_weight > 0:
            wanted = jax.nn.softmax(jax.lax.stop_gradient(target_logits[:, module + 1:length - 1]), axis=-1)
            ce = (1 - distill_weight) * ce - distill_weight * (wanted * log_probs).sum(-1)
        loss = loss + weight * ce.mean()
        metrics[f"accuracy_{module + 1}"] = (jnp.argmax(log_probs, -1) == labels).mean()
    return loss, metrics


def batch_rows(seed: int, step: int, num_sequences: int, batch_size: int) -> np.ndarray:
    """The regenerated sequences of a step's batch, drawn from (seed, step)."""
    return np.random.default_rng([seed, step, 4]).integers(0, num_sequences, batch_size)


def closing_eval(config: MTPTrainConfig, target: Transformer, modules: MTPModules, held_out_tokens: np.ndarray) -> dict:
    """Greedy acceptance on the held-out prompts of config (the same prompts as the other drafters' evals)."""
    prompts = held_out_prompts(held_out_tokens, config.eval_prompts, config.eval_prompt_len, config.seed)
    spec = SpecConfig(method="mtp", num_speculative_tokens=config.eval_num_speculative_tokens or config.num_modules)
    return mean_acceptance_length(target, spec, modules, prompts, config.eval_new_tokens)


def train_mtp(config: MTPTrainConfig) -> dict:
    output_dir, target, train_tokens, held_out_tokens = frozen_target_and_tokens(config)
    data = config.data
    modules = init_mtp(modules_config(config, target.config), seed=config.seed)

    def loss_fn(modules, batch, target):
        loss, metrics = mtp_loss(modules, target, batch["tokens"], config.depth_weights, config.distill_weight)
        return loss, {"loss": loss, **metrics}

    sequences = own_text(config, target, train_tokens, output_dir)

    def batch_fn(step):  # a function of (seed, step): a resumed run sees the same batches
        if sequences is None:
            windows = batch_at(train_tokens, step, data.batch_size, data.seq_len, config.seed)
            return {"tokens": windows[:, :data.seq_len]}
        return {"tokens": sequences[batch_rows(config.seed, step, len(sequences), data.batch_size), :data.seq_len]}

    trained = fit(modules, loss_fn, batch_fn, config, output_dir, description="train-mtp", frozen=target,
                  model_config=modules.config.layer)
    save_mtp(trained, output_dir / "mtp")
    acceptance = closing_eval(config, target, trained, held_out_tokens)
    records = loop.read_metrics(output_dir / "metrics.jsonl")
    summary = {"kind": "mtp", "mean_acceptance_length": acceptance["mean_acceptance_length"],
               "acceptance_rate": acceptance["acceptance_rate"],
               "per_position_acceptance": acceptance["per_position_acceptance"],
               "final_loss": records[-1]["loss"] if records else float("nan"), "steps": config.optimizer.total_steps,
               "num_modules": config.num_modules, "hidden_state": config.hidden_state,
               "loss_weights": list(config.depth_weights), "parameters": num_parameters(trained),
               "num_speculative_tokens": config.eval_num_speculative_tokens or config.num_modules,
               "eval_prompts": config.eval_prompts}
    (output_dir / "mtp" / "eval.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
