"""Where does an autoregressive decode step's time go? Variants of one 8B-shaped step, timed on the GPU.

    python -m benchmarks.probes.profile_decode [--batch 1] [--context 256] [--dump-hlo DIR] [--name NAME]
    XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true ... --name profile_decode_dsf   (a compiler option tried)

Each variant is one bfloat16 forward of one token per row at `context` cached tokens, timed inside a
jitted loop (benchmarking.time_in_loop) against the bytes it must read over the copy bandwidth measured
in the same run:
- model: the model call as the decode loop makes it (transformer.to_decoding_layout: a Python loop over
  per-layer weights);
- model_stacked: the model call with stacked weights (layers in one lax.scan);
- unrolled: the same layers (transformer.decoder_layer) in a Python loop with static layer indices;
- unrolled_split: the same loop over weights held as separate per-layer arrays (no slicing at all);
- matmuls_stacked / matmuls_split: only the seven projections of each layer and the LM head, reading
  the stacked weights with a dynamic layer index in a scan, or separate per-layer arrays: what the
  matrix-vector products alone cost, and whether slicing stacked weights costs extra;
- matmuls_fused: the same with q, k, v in one [D, (H + 2K) E] weight and gate, up in one [D, 2F]
  (four products a layer instead of seven);
- model_xla: model with XLA's attention instead of the Pallas decode-attention kernel;
- attention: only the attention over the cache (all layers); attention_verify over K + 1 = 6 new
  positions; *_cudnn the same through jax.nn.dot_product_attention(implementation="cudnn"), *_kernel
  through the Pallas kernel, with the cache writes it makes (XLA's variants make none; *_N_splits:
  with the cache's blocks over N programs a KV head; *_block_N: N slots a step of a program's loop);
- gemv DxF / gemv FxD^T: one activation-times-weight product for each weight shape of the layer, with
  the weight stored [in, out] (as specjax stores it) or [out, in] (contraction over its minor axis),
  against the copy bandwidth.
--loop also times a step of the real decode loop (scripts/bench_decode.py's way: a long run minus a
one-token run), with the attention kernel and without, the figure the variants above approximate; under
different XLA_FLAGS it compares compiler options.
--trace STEPS profiles STEPS tokens of the real decode loop (jax.profiler) and tabulates the GPU
kernels by total time: which kernels the step spends its time in, and how much is gaps between them.
--dump-hlo writes the optimised HLO of every program (XLA's own dump) for reading off the device.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import os
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from specjax import benchmarking
from specjax.benchmarking import SHAPES, on_device, timed, weight_bytes
from specjax.config import SamplingConfig
from specjax.decoding import decode_loop, pad_request
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import attention, decoder_layer, normalize, unembed
from specjax.pallas_kernels.decode_attention import decode_attention


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--cache", type=int, default=512)
    parser.add_argument("--dump-hlo", default=None)
    parser.add_argument("--only", default="", help="time only the variants whose names match this regex")
    parser.add_argument("--trace", type=int, default=0, help="profile this many steps of the decode loop")
    parser.add_argument("--loop", action="store_true", help="also time a step of the real decode loop")
    parser.add_argument("--name", default="profile_decode", help="results file name (e.g. per XLA_FLAGS tried)")
    args = parser.parse_args()
    if args.dump_hlo:
        # Before the backend starts (at the first computation); every module of the run is dumped.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.dump_hlo}"
                                   " --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$")
    # After XLA_FLAGS are final: asking for the backend starts it.
    if args.trace and jax.default_backend() != "gpu":
        parser.error(f"--trace {args.trace}: it reads GPU kernels from the profile, and the backend here is "
                     f"{jax.default_backend()!r}: allowed on a GPU only")
    from specjax.models.transformer import init_model, to_decoding_layout

    bandwidth = benchmarking.copy_bandwidth()
    config, _ = SHAPES[args.shape]
    model = on_device(lambda: init_model(config, seed=0))
    B, L = args.batch, config.num_layers
    cache = KVCache.create(config, B, args.cache).with_lengths(jnp.full((B,), args.context, jnp.int32))
    token = jnp.ones((B, 1), jnp.int32)
    position = jnp.full((B, 1), args.context, jnp.int32)
    dtype = config.jnp_dtype
    kv_read = 2 * L * B * args.context * config.num_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize
    weights = weight_bytes(model, config, B)

    # The variants that write the cache return it (lengths as they were) for time_in_loop to carry.
    def model_step(model, cache):
        logits, _, written = model(token, position, cache)
        return logits, (written.with_lengths(cache.lengths),)

    def unrolled(model, cache, layers=None):
        """Layers in a Python loop: sliced from the stacked weights by static index, or given as
        separate per-layer arrays (layers)."""
        x = model.embed[...][token].astype(dtype)
        slots = cache.lengths[:, None]
        for i in range(L):
            layer = jax.tree.map(lambda w: w[i], model.layers) if layers is None else layers[i]
            x, cache = decoder_layer(x, layer, i, position, slots, cache, config)
        final = normalize(x, model.final_norm[...], None, config)
        return unembed(final, model.embed[...], model.lm_head[...], dtype), (cache,)

    # Every layer's weights copied out into arrays of their own (what an unstacked model would hold).
    per_layer = jax.block_until_ready([jax.tree.map(lambda w: w[i] + 0, model.layers) for i in range(L)])

    names = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")

    def projections(x, w):
        q = jnp.einsum("bd,dhe->bhe", x, w["wq"]).reshape(B, -1)
        k = jnp.einsum("bd,dke->bke", x, w["wk"]).reshape(B, -1)
        v = jnp.einsum("bd,dke->bke", x, w["wv"]).reshape(B, -1)
        o = jnp.einsum("bhe,hed->bd", q.reshape(B, *w["wo"].shape[:2]), w["wo"])
        h = jax.nn.silu(x @ w["w_gate"]) * (x @ w["w_up"])
        return x + o + h @ w["w_down"] + (k.sum(-1) + v.sum(-1))[:, None].astype(x.dtype)

    def matmuls_stacked(model):
        stacked = {n: getattr(model.layers, n)[...] for n in names}
        x = model.embed[...][token[:, 0]].astype(dtype)
        x, _ = jax.lax.scan(lambda x, w: (projections(x, w), None), x, stacked)
        return x @ model.lm_head[...]

    split_weights = jax.block_until_ready([{n: getattr(model.layers, n)[...][i] + 0 for n in names} for i in range(L)])

    def matmuls_split(split_weights, embed, lm_head):
        x = embed[token[:, 0]].astype(dtype)
        for w in split_weights:
            x = projections(x, w)
        return x @ lm_head

    def fused_projections(x, w):
        qkv = x @ w["wqkv"]
        q = qkv[:, :config.num_heads * config.head_dim]
        o = q @ w["wo"]
        gate, up = jnp.split(x @ w["w_gate_up"], 2, axis=-1)
        return x + o + (jax.nn.silu(gate) * up) @ w["w_down"] + qkv[:, -1:].astype(x.dtype)

    fused_weights = jax.block_until_ready([{
        "wqkv": jnp.concatenate([w["wq"].reshape(w["wq"].shape[0], -1), w["wk"].reshape(w["wk"].shape[0], -1),
                                 w["wv"].reshape(w["wv"].shape[0], -1)], axis=1),
        "wo": w["wo"].reshape(-1, w["wo"].shape[-1]),
        "w_gate_up": jnp.concatenate([w["w_gate"], w["w_up"]], axis=1), "w_down": w["w_down"]} for w in split_weights])

    def matmuls_fused(fused_weights, embed, lm_head):
        x = embed[token[:, 0]].astype(dtype)
        for w in fused_weights:
            x = fused_projections(x, w)
        return x @ lm_head

    def attention_only(cache):
        q = jnp.ones((B, 1, config.num_heads, config.head_dim), dtype)
        out = [attention(q, cache.k[i], cache.v[i], cache.lengths[:, None], config) for i in range(L)]
        return sum(o.astype(jnp.float32).sum() for o in out)

    def cudnn_attention(q, k, v, query_slots, config):
        """transformer.attention through cuDNN's fused attention: one kernel a layer."""
        if q.shape[1] == 1:
            return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=query_slots[:, 0] + 1,
                                                implementation="cudnn")
        visible = jnp.arange(k.shape[1])[None, None, :] <= query_slots[:, :, None]
        return jax.nn.dot_product_attention(q, k, v, mask=visible[:, None], implementation="cudnn")

    def attention_layers(cache, num_new=1, impl=attention):
        q = jnp.ones((B, num_new, config.num_heads, config.head_dim), dtype)
        slots = cache.lengths[:, None] + jnp.arange(num_new)[None, :]
        out = [impl(q, cache.k[i], cache.v[i], slots, config) for i in range(L)]
        return sum(o.astype(jnp.float32).sum() for o in out)

    def kernel_layers(cache, num_new=1, **options):
        """The Pallas kernel in every layer, cache writes included (the cache is carried, as in decoding)."""
        q = jnp.ones((B, num_new, config.num_heads, config.head_dim), dtype)
        new = jnp.ones((B, num_new, config.num_kv_heads, config.head_dim), dtype)
        slots = cache.lengths[:, None] + jnp.arange(num_new)[None, :]
        out = []
        for i in range(L):
            o, k, v = decode_attention(q, new, new, *cache.layer(i), slots, sliding_window=config.sliding_window,
                                       **options)
            cache = cache.with_layer(i, k, v)
            out.append(o)
        return sum(o.astype(jnp.float32).sum() for o in out), (cache,)

    def gemv(x, w, transposed):
        return jnp.einsum("bd,fd->bf" if transposed else "bd,df->bf", x, w)

    F, Q, KV = config.intermediate_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    gemv_shapes = {"q": (config.hidden_size, Q), "kv": (config.hidden_size, KV), "o": (Q, config.hidden_size),
                   "up": (config.hidden_size, F), "down": (F, config.hidden_size),
                   "qkv_fused": (config.hidden_size, Q + 2 * KV), "gate_up_fused": (config.hidden_size, 2 * F),
                   "lm_head": (config.hidden_size, config.vocab_size)}
    key = jax.random.key(0)
    gemvs = {}
    for name, (d_in, d_out) in gemv_shapes.items():
        x = jax.random.normal(key, (B, d_in), dtype)
        for transposed in (False, True):
            w = jax.random.normal(key, (d_out, d_in) if transposed else (d_in, d_out), dtype)
            label = f"gemv {name} {'[out,in]' if transposed else '[in,out]'} {d_in}x{d_out}"
            gemvs[label] = (lambda w, x, t=transposed: gemv(x, w, t), (w, x), 1, w.size * w.dtype.itemsize)

    split_model = to_decoding_layout(model)  # the decoding layout, built once (every copy here is a full 8B model)
    split_cache = split_model.create_cache(B, args.cache).with_lengths(cache.lengths)  # one array per layer
    xla_model = jax.tree.map(lambda w: w, split_model)  # the same arrays
    for layer in xla_model.layers:
        layer.attention_kernel = False
    # name: (function, arguments, how many leading arguments are weights (loop-invariant), bytes to read)
    variants = {
        "model": (model_step, (split_model, split_cache), 1, weights + kv_read),
        "model_xla": (model_step, (xla_model, split_cache), 1, weights + kv_read),
        "model_stacked": (model_step, (model, cache), 1, weights + kv_read),
        "unrolled": (unrolled, (model, cache), 1, weights + kv_read),
        "unrolled_split": (lambda model, layers, cache: unrolled(model, cache, layers), (model, per_layer, cache), 2,
                           weights + kv_read),
        "matmuls_stacked": (matmuls_stacked, (model,), 1, weights),
        "matmuls_split": (matmuls_split, (split_weights, model.embed[...], model.lm_head[...]), 3, weights),
        "matmuls_fused": (matmuls_fused, (fused_weights, model.embed[...], model.lm_head[...]), 3, weights),
        "attention": (attention_only, (cache,), 0, kv_read),
        "attention_cudnn": (lambda c: attention_layers(c, 1, cudnn_attention), (cache,), 0, kv_read),
        "attention_verify": (lambda c: attention_layers(c, 6), (cache,), 0, kv_read),
        "attention_verify_cudnn": (lambda c: attention_layers(c, 6, cudnn_attention), (cache,), 0, kv_read),
        "attention_kernel": (kernel_layers, (split_cache,), 0, kv_read),
        "attention_verify_kernel": (lambda c: kernel_layers(c, 6), (split_cache,), 0, kv_read),
        **{f"attention{'_verify' if n > 1 else ''}_kernel_{label}": (
            lambda c, n=n, options=options: kernel_layers(c, n, **options), (split_cache,), 0, kv_read)
           for n in (1, 6) for label, options in (("2_splits", {"num_splits": 2}), ("8_splits", {"num_splits": 8}),
                                                  ("block_128", {"block": 128}), ("block_256", {"block": 256}))},
        **gemvs,
    }
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; weights {weights / 1e9:.2f} GB, KV {kv_read / 1e6:.1f} MB; "
          f"B={B} context={args.context}")
    rows = []
    for name, (fn, fn_args, invariant, floor_bytes) in variants.items():
        if not re.search(args.only, name):
            continue
        try:
            carries_cache = name.startswith(("model", "unrolled")) or "_kernel" in name
            seconds = benchmarking.time_in_loop(fn, *fn_args, invariant=invariant, iterations=10,
                                                carry=carries_cache)["median_s"]
        except Exception as error:  # e.g. cuDNN refusing a shape: say so and go on
            print(f"{name}: {type(error).__name__}: {str(error)[:300]}", flush=True)
            continue
        floor = floor_bytes / bandwidth
        rows.append({"variant": name, "ms": seconds * 1e3, "floor_ms": floor * 1e3, "fraction_of_floor": floor / seconds})
        print(f"{name:40s} {seconds * 1e3:8.3f} ms   floor {floor * 1e3:7.3f} ms   {floor / seconds:5.1%}", flush=True)
    for name, loop_model in (("decode_loop", split_model), ("decode_loop_xla", xla_model)):
        if not args.loop:
            break
        seconds = decode_loop_step(loop_model, B)
        floor = (weights + kv_read) / bandwidth
        rows.append({"variant": name, "ms": seconds * 1e3, "floor_ms": floor * 1e3, "fraction_of_floor": floor / seconds})
        print(f"{name:40s} {seconds * 1e3:8.3f} ms   floor {floor * 1e3:7.3f} ms   {floor / seconds:5.1%}", flush=True)
    notes = kernel_table(split_model, split_cache, args.trace) if args.trace else ""
    meta = {**benchmarking.environment(), "shape": args.shape, "batch": B, "context": args.context,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "copy_bandwidth_TBps": round(bandwidth / 1e12, 3), "config": dataclasses.asdict(config)}
    benchmarking.write_results(args.name, rows, [("variant", "variant"), ("ms", "ms"), ("floor_ms", "floor ms"),
                                                       ("fraction_of_floor", "of floor")], meta,
                               os.environ.get("OUT", "benchmarks/results/probes"), notes=notes)


def greedy_decode(model, batch: int, new_tokens: int, prompt_len: int = 128, cache_size: int = 512):
    """A function running the real greedy decode loop on random prompts (as scripts/bench_decode.py builds
    them)."""
    rng = np.random.default_rng(batch * 7919 + prompt_len)
    prompts = rng.integers(0, model.config.vocab_size, (batch, prompt_len)).tolist()
    request = pad_request(model, prompts, new_tokens, 0, cache_size, 1)
    args = (jnp.asarray(request.tokens), jnp.asarray(request.lengths), jnp.asarray(request.budgets),
            jax.vmap(jax.random.key)(jnp.asarray(request.seeds)))
    return lambda: decode_loop(model, *args, sampling=SamplingConfig(), eos_token_ids=(), cache_size=cache_size).tokens


def decode_loop_step(model, batch: int, new_tokens: int = 256) -> float:
    """Seconds a step of the real greedy decode loop takes: a run of new_tokens tokens minus a one-token
    run (the prefill and the call's fixed costs), over the remaining steps (as scripts/bench_decode.py times
    it)."""
    full, one = (greedy_decode(model, batch, n) for n in (new_tokens, 1))
    return (timed(full, 5) - timed(one, 5)) / (new_tokens - 1)


# Kernel name patterns (first match wins) for the per-kind summary of a trace.
KERNEL_KINDS = [("matrix products", r"gemm|nvjet|cutlass|gemv|cublas|dot"), ("copies", r"memcpy|copy"),
                ("KV cache writes", r"dynamic_update_slice"), ("reductions (norms, softmax)", r"reduce"),
                ("other", r"")]


def kernel_table(model, cache, steps: int, top: int = 30) -> str:
    """GPU kernels of `steps` decode-loop steps under jax.profiler, by total time: a markdown table
    (kernel, XLA op, launches per step, microseconds per step, share), a summary by kind of kernel
    (KERNEL_KINDS) with the idle time between kernels, and the busy time against the wall time
    between the first kernel's start and the last kernel's end. The prefill is taken out: the same
    loop is traced for one token and for 1 + steps tokens, and the first trace's kernels and span
    are subtracted from the second's."""
    from jax.profiler import ProfileData

    B = cache.lengths.shape[0]

    def trace(new_tokens: int):
        run = greedy_decode(model, B, new_tokens)
        jax.block_until_ready(run())
        trace_dir = tempfile.mkdtemp()
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(run())
        (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        events, lines_seen = [], set()
        for plane in ProfileData.from_file(path).planes:
            if plane.name.startswith("/device:GPU:0"):
                for line in plane.lines:
                    lines_seen.add(line.name)
                    if line.name.startswith("Stream"):
                        events += [(e.name, dict(e.stats).get("hlo_op", ""), e.start_ns, e.duration_ns)
                                   for e in line.events]
        if not events:
            raise RuntimeError(f"no GPU kernels found in the trace; device lines: {sorted(lines_seen)}")
        return events

    text = summarize_kernels(trace(1 + steps), steps, top, baseline=trace(1))
    print(text, flush=True)
    return text


def _totals(events):
    totals, counts, ops = collections.Counter(), collections.Counter(), {}
    for name, op, _, duration in events:
        totals[name] += duration
        counts[name] += 1
        ops.setdefault(name, op)
    span = max(start + duration for _, _, start, duration in events) - min(start for _, _, start, _ in events)
    return totals, counts, ops, span


def summarize_kernels(events: list[tuple[str, str, int, int]], steps: int, top: int = 30,
                      baseline: list[tuple[str, str, int, int]] | None = None) -> str:
    """Markdown tables of (kernel name, XLA op, start ns, duration ns) events over `steps` steps, less
    the events of a baseline run (the same program without those steps) when one is given."""
    totals, counts, ops, span = _totals(events)
    if baseline:
        base_totals, base_counts, _, base_span = _totals(baseline)
        totals.subtract(base_totals)
        counts.subtract(base_counts)
        span -= base_span
    busy = sum(totals.values())
    lines = [f"Trace of {steps} decode steps ({'prefill subtracted' if baseline else 'prefill included'}): "
             f"kernels busy {busy / 1e6:.2f} ms of a {span / 1e6:.2f} ms span ({busy / span:.0%}); "
             f"{sum(counts.values()) / steps:.0f} launches a step", "",
             "| kernel | XLA op | launches / step | µs / step | share |", "|---|---|---|---|---|"]
    for name, total in totals.most_common(top):
        lines.append(f"| {name[:80]} | {str(ops[name])[:40]} | {counts[name] / steps:.1f} | "
                     f"{total / steps / 1e3:.1f} | {total / busy:.1%} |")
    kinds = collections.defaultdict(lambda: [0, 0])
    for name, total in totals.items():
        kind = next(kind for kind, pattern in KERNEL_KINDS if re.search(pattern, name))
        kinds[kind][0] += total
        kinds[kind][1] += counts[name]
    kinds["idle between kernels"] = [span - busy, 0]
    lines += ["", "| kind | launches / step | µs / step |", "|---|---|---|"]
    lines += [f"| {kind} | {n / steps:.1f} | {total / steps / 1e3:.1f} |" for kind, (total, n) in kinds.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
