"""Training an EAGLE-3 (or EAGLE-1) head against a frozen target of a benchmarking.SHAPES shape (random weights),
online and offline, through the project's trainer (training.lm.fit, training.loop, training.eagle's losses).

    PYTHONPATH=. python scripts/bench_train_head.py --shape 8b [--kind eagle3] [--modes online,offline]
        [--batch-sizes 1,2,4] [--seq-len 2048] [--remat layer] [--steps 20] [--warmup 5] [--pool 4]
        [--offline-source device] [--profile-steps 0] [--out benchmarks/results/train_head_8b]

online: the target's forward runs inside the jitted train step (training.eagle.eagle3_loss: target_hidden under
stop_gradient, then the head's loss); only the head's parameters are in the optimizer. offline: a first process
runs the target once over a pool of --pool batches and stores what the head's loss reads (target_hidden: the
final-norm features and the fused layers' inputs) with the target's embedding and unembedding in a file, as
SpecForge's prepare_hidden_states.py does; the training process loads them (never the target's layers) and
its step runs only the head (eagle3_head_loss). --offline-source device: the pool is put on the device once;
host: it stays in host memory and each step's batch is copied to the device.

Each configuration runs in its own process (peak memory is the process's: peak_bytes_in_use of device 0);
--in-process runs them all in this one (tests; peak memory is then the largest so far). Step time: the median
of the intervals between steps after --warmup (the trainer logs every step, and each log waits for its step's
results). FLOPs per trained token (T = seq_len pairs a row, causal attention counted at half): target forward
2 P_target + 2 L T H E; head 6 P_trained + 2 P_frozen_in_grad_path + 2 P_labels + 3 x 2 T H E a head step
(EAGLE-3: unroll_steps head steps, each with its LM head over the draft vocabulary; P_labels the target's
unembedding over the draft ids). MFU: FLOPs x tokens/s over --peak-tflops (989: the H200's dense bf16 figure;
the bf16 matrix rate measured on these machines is about 790, docs/performance.md). --profile-steps N traces N
steps of each configuration after training.loop.PROFILE_AFTER (HeadTrainConfig.profile_steps): the device's busy
share and its kernel time by kind go to the row, the whole summary to profile_<mode>_b<B>_<remat>.json, and those
steps and the one after (the trace's stop and summary) are left out of the timing. Writes results.json and
results.md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import benchmarking
from specjax.config import DataConfig, HeadTrainConfig, MeshConfig, OptimizerConfig
from specjax.models.eagle import default_fuse_layers
from specjax.models.transformer import Hidden, init_model
from specjax.training import loop
from specjax.training.eagle import (TargetVocabulary, build_head, eagle1_head_loss, eagle1_loss, eagle3_head_loss,
                                    eagle3_loss, feature_noise, noise_rows, target_hidden)
from specjax.training.lm import fit

MODES = ("online", "offline")
SPECFORGE_DRAFT_VOCAB = 32000  # SpecForge's llama3-8B-eagle3.json draft_vocab_size


def run_config(args, batch_size: int, remat: str, output_dir: Path) -> HeadTrainConfig:
    target_config = benchmarking.SHAPES[args.shape][0]
    draft_vocab = args.draft_vocab if args.draft_vocab < target_config.vocab_size else None
    return HeadTrainConfig(
        target=f"shape:{args.shape}", kind=args.kind, unroll_steps=args.unroll_steps, draft_vocab_size=draft_vocab,
        data=DataConfig(seq_len=args.seq_len, batch_size=batch_size),
        optimizer=OptimizerConfig(lr=1e-4, warmup_steps=0, total_steps=args.steps),
        remat=remat, compute_dtype="bfloat16", mesh=MeshConfig(data=1), output_dir=str(output_dir),
        checkpoint_every=10 ** 9, log_every=1, seed=args.seed, profile_steps=args.profile_steps)


def token_pool(args, batch_size: int) -> np.ndarray:
    """--pool window batches [pool, B, T + 1] of random ids; step s trains on batch s % pool in both modes."""
    vocab = benchmarking.SHAPES[args.shape][0].vocab_size
    return np.random.default_rng(args.seed).integers(0, vocab, (args.pool, batch_size, args.seq_len + 1), np.int32)


def to_bits(x) -> np.ndarray:
    """A device array as host bytes that np.save keeps exactly (bfloat16 has no numpy dtype of its own)."""
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype == jnp.bfloat16 else x


def prepare(args, batch_size: int, path: Path) -> dict:
    """The offline features of the token pool: runs the target (random weights) over each batch once and
    saves target_hidden, the tokens and the target's embedding and unembedding to path (.npz); returns the
    target forward's median time a batch."""
    target_config = benchmarking.SHAPES[args.shape][0]
    target = benchmarking.on_device(lambda: init_model(target_config, seed=0))
    fuse_layers = default_fuse_layers(target_config.num_layers) if args.kind == "eagle3" else ()
    forward = jax.jit(lambda target, batch: target_hidden(target, batch, fuse_layers))
    tokens = token_pool(args, batch_size)
    hidden, times = [], []
    for i, batch in enumerate([*tokens, tokens[0]]):  # the first call compiles: timed again at the end
        start = time.perf_counter()
        out = jax.block_until_ready(forward(target, jnp.asarray(batch)))
        times.append(time.perf_counter() - start)
        if i < len(tokens):
            hidden.append(jax.device_get(out))
    vocabulary = TargetVocabulary.of(target)
    arrays = {"tokens": tokens, "final": np.stack([to_bits(h.final) for h in hidden]),
              "embed": to_bits(vocabulary.embed), "dtype": np.asarray(target_config.dtype)}
    if fuse_layers:
        arrays["layers"] = np.stack([to_bits(h.layers) for h in hidden])
    if vocabulary.lm_head is not None:
        arrays["lm_head"] = to_bits(vocabulary.lm_head)
    np.savez(path, **arrays)
    return {"target_forward_ms": 1e3 * statistics.median(times[1:])}


def load_features(path: Path, matmul_precision: str):
    """(tokens, Hidden of numpy arrays [pool, ...], TargetVocabulary on the device) from prepare's file."""
    data = np.load(path)
    dtype = str(data["dtype"])

    def value(name):
        x = data[name]
        return x.view(jnp.bfloat16) if dtype == "bfloat16" else x

    vocabulary = TargetVocabulary(jnp.asarray(value("embed")), jnp.asarray(value("lm_head")) if "lm_head" in data
                                  else None, dtype, matmul_precision)
    hidden = Hidden(final=value("final"), layers=value("layers") if "layers" in data else None)
    return data["tokens"], hidden, vocabulary


def flops_per_token(args, target_config, head) -> dict:
    """Model FLOPs per trained token (module docstring): the target's forward, and the head's step."""
    T, c = args.seq_len, head.config.layer
    attention = 2 * T * c.num_heads * c.head_dim  # causal QK^T and PV of one layer, forward
    target_layers = matrix_parameters(nnx.eval_shape(lambda: init_model(target_config, seed=0)).layers)
    target = 2 * target_layers + target_config.num_layers * 2 * T * target_config.num_heads * target_config.head_dim
    layer = matrix_parameters(head.layer)
    fc = int(np.prod(head.fc.shape))
    D, V = target_config.hidden_size, target_config.vocab_size
    if head.config.version == 1:
        # fc and the layer trained; the target's unembedding of the head's output in the gradient path; its
        # unembedding of the next feature gives the labels
        head_flops = 6 * (fc + layer) + 2 * D * V + 2 * D * V + 3 * attention
    else:
        Vd = head.config.draft_vocab
        steps = args.unroll_steps
        head_flops = 6 * fc + steps * (6 * (layer + D * Vd) + 3 * attention) + 2 * D * Vd
    return {"target_forward": float(target), "head": float(head_flops)}


def matrix_parameters(layers) -> int:
    """Parameters of stacked layers' matrix products ([L, in, ...] weights; no norms or biases)."""
    return int(sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(nnx.state(layers, nnx.Param))
                   if len(leaf.shape) >= 3))


def measure(args, mode: str, batch_size: int, remat: str, work: Path) -> dict:
    """One configuration in this process: trains --steps steps and times them."""
    target_config = benchmarking.SHAPES[args.shape][0]
    output_dir = work / f"{mode}_b{batch_size}_{remat}"
    config = run_config(args, batch_size, remat, output_dir)
    row = {"mode": mode, "kind": args.kind, "batch_size": batch_size, "seq_len": args.seq_len, "remat": remat,
           "steps": args.steps, "offline_source": args.offline_source if mode == "offline" else ""}
    if mode == "online":  # the frozen module the step receives: the whole target
        tokens, frozen = token_pool(args, batch_size), benchmarking.on_device(lambda: init_model(target_config, seed=0))
    else:  # only the target's embedding and unembedding, and the stored features
        tokens, hidden, frozen = load_features(work / f"features_b{batch_size}.npz", target_config.matmul_precision)
        if args.offline_source == "device":
            hidden = jax.device_put(hidden)
    head = build_head(config, target_config, tokens.reshape(-1))  # draft vocabulary: the pool's most frequent ids
    noise_shape = (args.seq_len, target_config.hidden_size)

    def batch_fn(step):
        i = step % args.pool
        batch = {"tokens": tokens[i]}
        if mode == "offline":
            batch["hidden"] = jax.tree.map(lambda x: x[i], hidden)
        if head.config.version == 1:  # train_eagle's device-drawn feature noise
            batch["noise_rows"] = noise_rows(step, batch_size)
        return batch

    def loss_fn(head, batch, frozen):
        if head.config.version == 1:
            batch = {**batch, "noise": feature_noise(batch["noise_rows"], noise_shape, config.feature_noise, args.seed)}
        if mode == "online":
            loss, metrics = (eagle1_loss(head, frozen, batch["tokens"], batch["noise"]) if head.config.version == 1
                             else eagle3_loss(head, frozen, batch["tokens"], args.unroll_steps, config.step_decay))
        elif head.config.version == 1:
            loss, metrics = eagle1_head_loss(head, frozen, batch["tokens"], batch["hidden"], batch["noise"])
        else:
            loss, metrics = eagle3_head_loss(head, frozen, batch["tokens"], batch["hidden"], args.unroll_steps,
                                             config.step_decay)
        return loss, {"loss": loss, **metrics}

    start = time.perf_counter()
    fit(head, loss_fn, batch_fn, config, output_dir, description=f"{mode} {args.kind} b{batch_size} {remat}",
        frozen=frozen, model_config=head.config.layer)
    records = loop.read_metrics(output_dir / "metrics.jsonl")
    kept = [r for r in records if r["step"] > last_untimed_step(args)]
    step_s = statistics.median((b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(kept, kept[1:]))
    tokens_per_s = batch_size * args.seq_len / step_s
    flops = flops_per_token(args, target_config, head)
    counted = flops["head"] + (flops["target_forward"] if mode == "online" else 0.0)
    memory = jax.local_devices()[0].memory_stats()
    peak = memory.get("peak_bytes_in_use") if memory else None
    row.update(tokens_per_s=tokens_per_s, step_ms=1e3 * step_s, wall_s=time.perf_counter() - start,
               peak_gib=peak / 2 ** 30 if peak is not None else "n/a",
               head_gflop_per_token=flops["head"] / 1e9,
               target_gflop_per_token=flops["target_forward"] / 1e9 if mode == "online" else 0.0,
               mfu=counted * tokens_per_s / (args.peak_tflops * 1e12),
               target_mfu=flops["target_forward"] * tokens_per_s / (args.peak_tflops * 1e12) if mode == "online"
               else 0.0,
               first_loss=records[0]["loss"], final_loss=records[-1]["loss"],
               head_parameters=int(sum(x.size for x in jax.tree.leaves(nnx.state(head, nnx.Param)))))
    if args.profile_steps:
        profile = json.loads((output_dir / "profile.json").read_text())
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"profile_{output_dir.name}.json").write_text(json.dumps(profile, indent=2) + "\n")
        kinds = profile.get("breakdown", {}).get("kinds", {})
        row["profile"] = (f"busy {profile['busy_share']:.0%}; " + ", ".join(
            f"{kind} {v['share']:.0%}" for kind, v in kinds.items()) if kinds else profile.get("device", ""))
    return row


def last_untimed_step(args) -> int:
    """The last step left out of the timing: --warmup's, or the profiled window's and the step after it."""
    return max(args.warmup, loop.PROFILE_AFTER + args.profile_steps + 1 if args.profile_steps else 0)


def in_child(args, argv: list[str], work: Path, task: str, out: Path) -> dict:
    """Runs one task (prepare or a configuration) in a fresh process, or in this one with --in-process."""
    if args.in_process:
        return task_main(args, work, task)
    command = [sys.executable, __file__, *argv, "--task", task, "--work", str(work), "--task-out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        error = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "no output")
        return {"error": error[:600]}
    return json.loads(out.read_text())


def task_main(args, work: Path, task: str) -> dict:
    kind, *rest = task.split(":")
    if kind == "prepare":
        batch_size = int(rest[0])
        return prepare(args, batch_size, work / f"features_b{batch_size}.npz")
    mode, batch_size, remat = rest[0], int(rest[1]), rest[2]
    return measure(args, mode, batch_size, remat, work)


ANCHOR = """SpecForge anchor (sgl-project/SpecForge): scripts/train_eagle3.py (commit 054c8cf) defaults --max-length
2048, --batch-size 1, --ttt-length 7, --learning-rate 1e-4; offline it loads only the target's LM head
(TargetHead) and the draft's embedding from the target, frozen. examples/run_llama3.1_8b_eagle3_online.sh (commit
10004e7) trains Llama-3.1-8B-Instruct's EAGLE-3 head on 1 GPU, batch 1, --max-length 4096, target served by
SGLang. No Llama-3.1-8B training throughput figure was found in SpecForge's sources or in the stored text of its
paper (arXiv 2603.18567, whose abstract reports up to 9.9x faster EAGLE-3 training for Qwen3-235B-A22B)."""

COLUMNS = [("mode", "mode"), ("offline_source", "offline pool"), ("kind", "head"), ("batch_size", "batch"),
           ("seq_len", "seq"), ("remat", "remat"), ("tokens_per_s", "tokens/s"), ("step_ms", "step ms"),
           ("peak_gib", "peak GiB"), ("head_gflop_per_token", "head GFLOP/token"),
           ("target_gflop_per_token", "target fwd GFLOP/token"), ("mfu", "MFU (all counted)"),
           ("target_mfu", "MFU (target fwd)"), ("first_loss", "loss step 1"),
           ("profile", "device busy; kernel time by kind (profiled steps)"), ("error", "error")]


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(benchmarking.SHAPES), default="8b")
    parser.add_argument("--kind", choices=("eagle3", "eagle1"), default="eagle3")
    parser.add_argument("--modes", default="online,offline", help=f"comma-separated, of {MODES}")
    parser.add_argument("--batch-sizes", default="1", help="comma-separated window rows a step")
    parser.add_argument("--remat", default="layer", help="comma-separated head remat policies (none, layer, dots)")
    parser.add_argument("--seq-len", type=int, default=2048, help="pairs a row (SpecForge's default max length)")
    parser.add_argument("--unroll-steps", type=int, default=7, help="EAGLE-3 training-time-test steps (ttt-length)")
    parser.add_argument("--draft-vocab", type=int, default=SPECFORGE_DRAFT_VOCAB)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timing (compilation)")
    parser.add_argument("--pool", type=int, default=4, help="distinct batches (offline: stored features of each)")
    parser.add_argument("--offline-source", choices=("device", "host"), default="device")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="steps of each configuration traced with JAX's profiler (module docstring); 0: none")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/train_head")
    parser.add_argument("--in-process", action="store_true", help="every configuration in this process")
    parser.add_argument("--task", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--task-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        parser.error(f"--modes {args.modes!r}: {bad} not allowed; allowed {MODES}")
    if args.profile_steps < 0:
        parser.error(f"--profile-steps {args.profile_steps}: allowed an integer >= 0")
    if args.steps <= last_untimed_step(args) + 1:
        parser.error(f"--steps {args.steps} must exceed {last_untimed_step(args) + 1} (two timed steps at least after "
                     f"--warmup {args.warmup}, and after the --profile-steps {args.profile_steps} traced from step "
                     f"{loop.PROFILE_AFTER + 1} and the step that ends the trace)")
    if args.task:  # a child process of main
        Path(args.task_out).write_text(json.dumps(task_main(args, Path(args.work), args.task)))
        return {}
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    remats = [r for r in args.remat.split(",") if r]
    target_config = benchmarking.SHAPES[args.shape][0]
    meta = benchmarking.environment()
    meta["command"] = "python scripts/bench_train_head.py " + shlex.join(argv)  # argv given in-process too
    meta.update(shape=args.shape, target=(
        f"{target_config.num_layers} layers x {target_config.hidden_size}, {target_config.num_heads} heads "
        f"({target_config.num_kv_heads} KV) of {target_config.head_dim}, MLP {target_config.intermediate_size}, "
        f"vocab {target_config.vocab_size}, weights {target_config.param_dtype}, random"),
                head=f"{args.kind}, draft vocab {min(args.draft_vocab, target_config.vocab_size)}, "
                     f"float32 master weights, bfloat16 compute, AdamW",
                unroll_steps=args.unroll_steps, peak_tflops=args.peak_tflops, xla_flags=os.environ.get("XLA_FLAGS", ""))
    rows, out_dir = [], Path(args.out)
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        for batch_size in batch_sizes:
            if "offline" in modes:
                prepared = in_child(args, argv, work, f"prepare:{batch_size}", work / "task.json")
                meta[f"target_forward_ms_b{batch_size}"] = prepared.get("target_forward_ms", prepared.get("error"))
            for remat in remats:
                for mode in modes:
                    row = in_child(args, argv, work, f"measure:{mode}:{batch_size}:{remat}", work / "task.json")
                    rows.append({"mode": mode, "batch_size": batch_size, "remat": remat, **row})
                    print({k: v for k, v in rows[-1].items()}, flush=True)
                    benchmarking.write_results("results", rows, COLUMNS, meta, out_dir, notes=ANCHOR)
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "anchor": ANCHOR, "rows": rows}, indent=2) + "\n")
    return {"meta": meta, "rows": rows}


if __name__ == "__main__":
    main()
