"""Training throughput: tokens/s and model-FLOPs utilisation of train_lm on this device.

    PYTHONPATH=. python scripts/bench_train.py [--config configs/train/default_target.yaml] [--steps 80]

Trains the config for --steps steps (on --max-files corpus files: throughput does not depend on the
text), times steady-state steps from the per-step metric timestamps (each log waits for its step),
and measures the bf16 matmul peak in the same run. FLOPs per token: 6 N (parameters, forward and
backward) + 6 L T D (causal attention scores and values, forward and backward; T the sequence
length, D the attention width). Writes benchmarks/results/bench_train.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import jax
import jax.numpy as jnp

from specjax import benchmarking
from specjax.config import TrainConfig, load_yaml
from specjax.training.lm import train_lm
from specjax.training.loop import read_metrics


def matmul_peak(size: int = 8192) -> float:
    """bf16 matmul FLOP/s of a size^3 product."""
    a = jnp.ones((size, size), jnp.bfloat16)
    timing = benchmarking.time_call(jax.jit(lambda x: x @ x), a, calls_per_sample=10, samples=5)
    return 2 * size ** 3 / timing["median_s"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/train/default_target.yaml")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--skip", type=int, default=10, help="first steps left out (compilation)")
    parser.add_argument("--max-files", type=int, default=200)
    parser.add_argument("--set", action="append", default=[], help="further config overrides")
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args()
    meta = benchmarking.environment()
    peak = matmul_peak() if meta["platform"] != "cpu" else float("nan")
    with tempfile.TemporaryDirectory() as tmp:
        config = load_yaml(TrainConfig, args.config, [
            f"output_dir={tmp}", f"data.max_files={args.max_files}", f"optimizer.total_steps={args.steps}",
            f"optimizer.warmup_steps={min(10, args.steps)}", "checkpoint_every=1000000", "log_every=1",
            "eval_batches=2", *args.set])
        summary = train_lm(config)
        records = read_metrics(f"{tmp}/metrics.jsonl")
    times = [r["time"] for r in records]
    step_seconds = statistics.median(b - a for a, b in zip(times[args.skip:], times[args.skip + 1:]))
    c, data = config.model, config.data
    tokens_per_step = data.batch_size * data.seq_len
    flops_per_token = 6 * summary["parameters"] + 6 * c.num_layers * data.seq_len * c.num_heads * c.head_dim
    tokens_per_second = tokens_per_step / step_seconds
    row = {"parameters_M": summary["parameters"] / 1e6, "batch": data.batch_size, "seq_len": data.seq_len,
           "dtype": f"params {c.param_dtype}, compute {c.dtype}", "step_ms": step_seconds * 1e3,
           "tokens_per_s": tokens_per_second, "model_TFLOPs": flops_per_token * tokens_per_second / 1e12,
           "peak_bf16_TFLOPs": peak / 1e12, "mfu": flops_per_token * tokens_per_second / peak,
           "devices": jax.device_count()}
    meta.update(config=args.config, steps=args.steps, final_loss=records[-1]["loss"])
    print(row)
    benchmarking.write_results(
        "bench_train", [row],
        [("parameters_M", "params (M)"), ("batch", "batch"), ("seq_len", "seq"), ("dtype", "dtypes"),
         ("step_ms", "step ms"), ("tokens_per_s", "tokens/s"), ("model_TFLOPs", "model TFLOP/s"),
         ("peak_bf16_TFLOPs", "bf16 matmul peak TFLOP/s"), ("mfu", "MFU")],
        meta, args.out_dir,
        notes=f"train_lm steady-state step time (median over steps {args.skip + 1}..{args.steps}); FLOPs per token "
              "6N + 6 L T D; the peak is a bf16 8192^3 matmul measured in the same run.")


if __name__ == "__main__":
    main()
