"""Measurement helpers for the benchmark scripts and `specjax speed`: model shapes to time at, building
random models on the device, timing jitted functions, the bytes a decode step must read and the
device's copy bandwidth (the memory ceiling, measured in the same run it is compared against), and
writing results as JSON plus a markdown table that name the device, versions, shapes and dtypes."""

from __future__ import annotations

import datetime
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.config import ModelConfig

BF16 = dict(param_dtype="bfloat16", dtype="bfloat16")
SHAPES = {  # name: (target, draft LM)
    "8b": (ModelConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                       head_dim=128, intermediate_size=14336, max_position_embeddings=131072, rope_theta=500000.0,
                       **BF16),
           ModelConfig(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                       head_dim=64, intermediate_size=8192, max_position_embeddings=131072, rope_theta=500000.0,
                       tie_word_embeddings=True, **BF16)),
    # MiMo-7B (Qwen2 layers, q/k/v biases; its config.json); the draft LM is not used by its MTP module.
    "mimo7b": (ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=151680, hidden_size=4096, num_layers=36,
                           num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=11008, qkv_bias=True,
                           max_position_embeddings=32768, rope_theta=640000.0, norm_eps=1e-5, **BF16),
               ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=151680, hidden_size=896, num_layers=24,
                           num_heads=14, num_kv_heads=2, head_dim=64, intermediate_size=4864, qkv_bias=True,
                           max_position_embeddings=32768, tie_word_embeddings=True, **BF16)),
    "tiny": (ModelConfig(vocab_size=512, hidden_size=64, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=128, **BF16),
             ModelConfig(vocab_size=512, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                         intermediate_size=64, tie_word_embeddings=True, **BF16)),
}


def on_device(make):
    """A module built by make() with its parameters created on the device (no host copy of 16 GB)."""
    graphdef, _ = nnx.split(nnx.eval_shape(make))
    state = jax.jit(lambda: nnx.split(make())[1])()
    return nnx.merge(graphdef, state)


def weight_bytes(module, config: ModelConfig, batch: int) -> int:
    """Bytes of parameters one decode step reads: an untied embedding table contributes B rows."""
    leaves = jax.tree.leaves(nnx.state(module, nnx.Param))
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    if not config.tie_word_embeddings:
        total -= config.vocab_size * config.hidden_size * jnp.dtype(config.param_dtype).itemsize
        total += batch * config.hidden_size * jnp.dtype(config.param_dtype).itemsize
    return total


def kv_bytes(config: ModelConfig, batch: int, context: float) -> float:
    """Bytes of the KV cache a decode step reads: every layer's keys and values of `context` tokens a row."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * jnp.dtype(config.dtype).itemsize * context * batch


def timed(fn, repeats: int = 3) -> float:
    """Median wall time of fn() (compiled before), waiting for the device."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def time_call(fn: Callable, *args, calls_per_sample: int = 10, samples: int = 15, warmup: int = 2) -> dict:
    """Median and spread of the time of one call of fn(*args), in seconds.

    Each sample runs fn back to back calls_per_sample times and waits once, so host dispatch
    overlaps device work as it does in a real loop.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(calls_per_sample):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls_per_sample)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def loop_program(fn: Callable, invariant: int = 0, carry: bool = False) -> Callable:
    """time_in_loop's jitted loop of fn, run(count, *args): made once and passed to each time_in_loop call (its
    `program`), timing fn on other values of its arguments (a profile's cost vectors) compiles nothing again."""
    def run(count, *inputs):
        fixed = inputs[:invariant]

        def body(i, state):
            total, varying = state
            fresh, _ = jax.lax.optimization_barrier((varying, i))
            out = fn(*fixed, *fresh)
            out, varying = out if carry else (out, varying)
            leaves = jax.tree.leaves(out)
            return total + sum(jnp.sum(leaf).astype(jnp.float32) for leaf in leaves), tuple(varying)

        return jax.lax.fori_loop(0, count, body, (jnp.float32(0), tuple(inputs[invariant:])))[0]

    return jax.jit(run)


def time_in_loop(fn: Callable, *args, invariant: int = 0, carry: bool = False, iterations: int = 50,
                 samples: int = 7, warmup: int = 2, program: Callable | None = None) -> dict:
    """Median time of one fn(*args) inside one jitted fori_loop: the device time a loop step spends
    on it, without host dispatch.

    The loop runs `iterations` and then 2 * `iterations` times (its trip count is an argument, so both
    are one program) and the difference is divided by `iterations`: what one call costs whatever the
    count (dispatching the arguments of a model with hundreds of weight arrays, setting up the loop)
    cancels out. min_s and max_s are the differences of the two runs' fastest and slowest samples.

    The first `invariant` arguments (weights) are loop invariants, as in the decode loops, where XLA
    prepares them once before the loop (e.g. transposes them into the layout its matmul wants). The
    others pass an optimization barrier together with the loop counter each iteration, so no work on
    them is hoisted out of the loop. With carry=True, fn returns (output, new values of those
    arguments), which the loop carries into the next iteration, as a decode loop carries its cache:
    a cache written in fn is then updated in place, where a cache that every iteration must find
    unchanged is copied before each write. program: loop_program(fn, invariant, carry), made before (else made
    here, and compiled again at each call); warmup: untimed runs of each loop before its samples (time_call's)."""
    compiled = program or loop_program(fn, invariant, carry)
    short, long = (time_call(compiled, jnp.int32(count), *args, calls_per_sample=1, samples=samples, warmup=warmup)
                   for count in (iterations, 2 * iterations))
    return {key: (long[key] - short[key]) / iterations for key in short}


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Device copy bandwidth in bytes/s: (read + write) of a num_bytes float32 array per copy."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0 + 0.0)  # elementwise: one read, one write
    timing = time_call(copy, x, calls_per_sample=5, samples=9)
    return 2 * num_bytes / timing["median_s"]


def environment() -> dict:
    device = jax.devices()[0]
    return {
        "device": getattr(device, "device_kind", str(device)),
        "platform": device.platform,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # The command that made the results, as typed (a script's path and its arguments).
        "command": " ".join(["python", *map(shlex.quote, sys.argv)]),
    }


def write_results(name: str, rows: list[dict], columns: list[tuple[str, str]], meta: dict,
                  out_dir: str | Path = "benchmarks/results", notes: str = "") -> tuple[Path, Path]:
    """Writes out_dir/name.json (meta + rows) and out_dir/name.md (a table of the given columns:
    (key, header) pairs), and returns both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# {name}", "", ", ".join(f"{k}: {v}" for k, v in meta.items()
                                        if k != "command" and not isinstance(v, (dict, list))), ""]
    if "command" in meta:
        lines += [f"Command: `{meta['command']}`", ""]
    if notes:
        lines += [notes, ""]
    lines += ["| " + " | ".join(header for _, header in columns) + " |",
              "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_format(row.get(key)) for key, _ in columns) + " |")
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path


def save_figure(fig, path: Path | str) -> None:
    """Saves a matplotlib figure as a PNG of at most 256 colours on white: a fifth to a third of the size of
    matplotlib's own RGBA, alike to the eye (results are committed, and a device call carries the whole tree)."""
    import io

    from PIL import Image  # matplotlib's own requirement

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, facecolor="white")
    image = Image.open(buffer).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    image.save(path, optimize=True)


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return "" if value is None else str(value)
