"""Training at scale: `specjax train-lm` at 12 x 768, seq 1024, batch 64 (configs/train/scale_lm.yaml) for each
remat policy, its memory, its speed and its loss curve; and what TF32 does to a float32 model's top-k sets.

    PYTHONPATH=. python scripts/bench_train_scale.py [--config configs/train/scale_lm.yaml] [--data-dir DIR]
        [--out-dir benchmarks/results/train_lm_scale] [--only NAME,...] [--precision-check]

Each variant is one `specjax train-lm` process (the peak memory is the process's: `peak_bytes_in_use` of
device 0, which train_lm reports), on the corpus prepared under --data-dir (the config's corpus: the Python
standard library; prepared there by the first run when absent). Tokens/s: the median over steps after the
first --skip of batch x seq_len / the step's time, from metrics.jsonl's per-step timestamps (each log waits
for its step). The runs of 200 steps give the loss curves, compared step by step. A variant that fails
(the einsum attention without remat runs out of memory, as on 2026-12-01) records its error message.
--set profile_steps=N traces N steps of each run after its fifth (specjax.training.loop) and adds what the trace
says: the device's busy share, its kernel time by kind, the kernels that took the most (the traced steps and the
trace's writing are slower: take the speed from a run without it).
--precision-check: a float32 model of the config's shape, random weights, run over random tokens at matmul
precision 'default' (TF32 on GPUs) and 'highest': the largest logit difference and the share of positions
whose top-12 set differs. Writes results.json and results.md under --out-dir after each variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# This process holds only the precision check's arrays; each run's process takes the GPU's memory as usual.
CHILD_ENV = dict(os.environ)
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

import numpy as np  # noqa: E402

from specjax import benchmarking  # noqa: E402
from specjax.config import TrainConfig, load_yaml  # noqa: E402
from specjax.training.loop import read_metrics  # noqa: E402

# name -> (config overrides, steps)
VARIANTS = {
    "layer": (["remat=layer"], 200),
    "none": (["remat=none"], 200),
    "dots": (["remat=dots"], 60),
    "layer_xla_attention": (["remat=layer", "model.attention_impl=xla"], 60),
    "none_einsum_attention": (["remat=none", "model.attention_impl=einsum"], 30),
}
TOP_K = 12


def run_variant(name: str, args, work: Path) -> dict:
    overrides, steps = VARIANTS[name]
    overrides, steps = [*overrides, *args.set], args.steps or steps
    command = [sys.executable, "-m", "specjax.cli", "train-lm", "--config", args.config,
               "--set", f"output_dir={work / name}", "--set", f"data.cache_dir={args.data_dir}",
               "--set", f"optimizer.total_steps={steps}", *sum((["--set", o] for o in overrides), [])]
    start = time.time()
    done = subprocess.run(command, capture_output=True, text=True, env=CHILD_ENV)
    row = {"variant": name, "overrides": " ".join(overrides), "steps": steps, "wall_s": time.time() - start,
           "command": "specjax train-lm --config " + args.config + " " + " ".join(
               f"--set {o}" for o in (*overrides, f"optimizer.total_steps={steps}"))}
    if done.returncode != 0:
        row["error"] = next((line for line in done.stderr.splitlines() if "error:" in line), done.stderr[-2000:])
        return row
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    records = read_metrics(work / name / "metrics.jsonl")
    config = load_yaml(TrainConfig, args.config)
    tokens = config.data.batch_size * config.data.seq_len
    kept = [r for r in records if r["step"] > args.skip]
    step_s = [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(kept, kept[1:])]
    row.update(parameters=summary["parameters"], tokens_per_s=tokens / statistics.median(step_s),
               step_ms=1e3 * statistics.median(step_s),
               peak_gib=summary.get("peak_device_memory_bytes", float("nan")) / 2 ** 30,
               final_loss=records[-1]["loss"], held_out_loss=summary["held_out_loss"],
               losses=[r["loss"] for r in records])
    profile = work / name / "profile.json"  # --set profile_steps=N: what the profiled steps' trace says
    if profile.exists():
        row["profile"] = json.loads(profile.read_text())
    return row


def precision_check(args) -> dict:
    import jax
    import jax.numpy as jnp

    from specjax.models.transformer import init_model

    run = load_yaml(TrainConfig, args.config)
    vocab, length = run.data.vocab_size, run.data.seq_len
    out = {}
    batch = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (8, length)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(length), batch.shape)
    for precision in ("default", "highest"):
        model = init_model(dataclasses.replace(run.model, vocab_size=vocab, matmul_precision=precision), seed=0)
        out[precision] = np.asarray(jax.jit(lambda m, t, p: m(t, p)[0])(model, batch, positions))
    default, highest = out["default"].reshape(-1, vocab), out["highest"].reshape(-1, vocab)
    top_default = np.sort(np.argpartition(-default, TOP_K, axis=-1)[:, :TOP_K], -1)
    top_highest = np.sort(np.argpartition(-highest, TOP_K, axis=-1)[:, :TOP_K], -1)
    return {"positions": len(default), "max_abs_logit_difference": float(np.abs(default - highest).max()),
            f"top{TOP_K}_sets_differing": int((top_default != top_highest).any(-1).sum()),
            "argmax_differing": int((default.argmax(-1) != highest.argmax(-1)).sum())}


def write(rows: list[dict], precision: dict | None, meta: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    curves = {r["variant"]: r["losses"] for r in rows if "losses" in r}
    comparison = None
    if "layer" in curves and "none" in curves:
        a, b = np.asarray(curves["layer"]), np.asarray(curves["none"])
        comparison = {"steps": len(a), "max_abs_difference": float(np.abs(a - b).max()),
                      "max_relative_difference": float((np.abs(a - b) / b).max()),
                      "final_layer": float(a[-1]), "final_none": float(b[-1]),
                      # the curve's own step-to-step wiggle over its last 50 steps, for scale
                      "step_to_step_std_last50": float(np.std(np.diff(b[-50:])))}
    (out_dir / "results.json").write_text(json.dumps(
        {"meta": meta, "rows": rows, "loss_curve_layer_vs_none": comparison, "precision_check": precision},
        indent=1) + "\n")
    lines = [f"# train-lm at scale on {meta.get('device', '?')}", "",
             f"JAX {meta.get('jax')}, {meta.get('date')}; config `{meta['config']}` (shapes and dtypes: "
             f"{meta['shape']}); corpus: the Python standard library tokenized by the run's BPE; "
             f"XLA_FLAGS: `{meta['xla_flags'] or '(none)'}`.", "",
             "| variant | overrides | steps | tokens/s | step ms | peak GiB | final loss | held-out loss |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | `{r['overrides']}` | {r['steps']} | failed: {r['error'][:400]} ||||")
        else:
            lines.append(f"| {r['variant']} | `{r['overrides']}` | {r['steps']} | {r['tokens_per_s']:,.0f} | "
                         f"{r['step_ms']:.1f} | {r['peak_gib']:.1f} | {r['final_loss']:.4f} | "
                         f"{r['held_out_loss']:.4f} |")
    if comparison:
        lines += ["", f"Loss curves, remat layer against none, {comparison['steps']} steps: largest difference "
                  f"{comparison['max_abs_difference']:.4f} ({100 * comparison['max_relative_difference']:.2f}%); "
                  f"final {comparison['final_layer']:.4f} against {comparison['final_none']:.4f}; the curve's own "
                  "step-to-step standard deviation over its last 50 steps: "
                  f"{comparison['step_to_step_std_last50']:.4f}."]
    if precision:
        lines += ["", f"Float32 model of this shape, random weights, {precision['positions']} positions, "
                  "TF32 ('default') "
                  f"against 'highest': largest logit difference {precision['max_abs_logit_difference']:.2e}; "
                  f"top-{TOP_K} sets differing at {precision[f'top{TOP_K}_sets_differing']} positions, argmax at "
                  f"{precision['argmax_differing']}."]
    for r in rows:
        breakdown = r.get("profile", {}).get("breakdown")
        if breakdown:
            profile = r["profile"]
            lines += ["", f"Where `{r['variant']}`'s device time went, steps {profile['first_step']} to "
                      f"{profile['first_step'] + profile['steps'] - 1} under the profiler: device busy "
                      f"{profile['busy_share']:.1%}, {breakdown['kernel_ms_per_step']:.1f} ms of kernels a step; "
                      + ", ".join(f"{kind} {v['share']:.1%}" for kind, v in breakdown["kinds"].items()) + ".", "",
                      "| kernel | kind | ms a step | calls a step | share |", "|---|---|---|---|---|"]
            lines += [f"| `{k['name'][:90]}` | {k['kind']} | {k['ms'] / profile['steps']:.2f} | "
                      f"{k['count'] / profile['steps']:.0f} | {k['share']:.1%} |" for k in breakdown["top"]]
    lines += ["", "Commands (each its own process): " + "; ".join(f"`{r['command']}`" for r in rows), ""]
    (out_dir / "results.md").write_text("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/train/scale_lm.yaml")
    parser.add_argument("--data-dir", default="runs/scale_lm_data")
    parser.add_argument("--out-dir", default="benchmarks/results/train_lm_scale")
    parser.add_argument("--only", default=",".join(VARIANTS), help="comma-separated variants")
    parser.add_argument("--skip", type=int, default=5, help="steps up to this one are left out of the speed "
                        "(compilation); the speed is the median over the intervals between later logged steps")
    parser.add_argument("--precision-check", action="store_true")
    parser.add_argument("--steps", type=int, default=None, help="every variant's steps (default: its own)")
    parser.add_argument("--set", action="append", default=[], help="a further override for every variant")
    args = parser.parse_args()
    meta = benchmarking.environment()
    config = load_yaml(TrainConfig, args.config)
    model = config.model
    meta.update(xla_flags=os.environ.get("XLA_FLAGS", ""), config=args.config, shape=(
                f"{model.num_layers} layers x {model.hidden_size}, {model.num_heads} heads of {model.head_dim}, "
                f"SwiGLU MLP {model.intermediate_size}, vocab {config.data.vocab_size}, seq {config.data.seq_len}, "
                f"batch {config.data.batch_size}, weights float32, compute {config.compute_dtype}"))
    out_dir, rows, precision = Path(args.out_dir), [], None
    if args.precision_check:
        precision = precision_check(args)
        print(precision, flush=True)
        write(rows, precision, meta, out_dir)
    with tempfile.TemporaryDirectory() as work:
        for name in filter(None, args.only.split(",")):
            rows.append(run_variant(name, args, Path(work)))
            print({k: v for k, v in rows[-1].items() if k != "losses"}, flush=True)
            write(rows, precision, meta, out_dir)


if __name__ == "__main__":
    main()
