"""Where does an autoregressive decode step's time go? Variants of one 8B-shaped step, timed on the GPU.

    PYTHONPATH=. python scripts/profile_decode.py [--batch 1] [--context 256] [--dump-hlo DIR] [--name NAME]
    XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true ... --name profile_decode_dsf   (a compiler option tried)

Each variant is one bfloat16 forward of one token per row at `context` cached tokens, timed inside a
jitted loop (benchmarking.time_in_loop) against the bytes it must read over the copy bandwidth measured
in the same run:
- model: the model call as the decode loop makes it (layers in one lax.scan over stacked weights);
- unrolled: the same layers (transformer.decoder_layer) in a Python loop with static layer indices;
- unrolled_split: the same loop over weights held as separate per-layer arrays (no slicing at all);
- matmuls_stacked / matmuls_split: only the seven projections of each layer and the LM head, reading
  the stacked weights with a dynamic layer index in a scan, or separate per-layer arrays: what the
  matrix-vector products alone cost, and whether slicing stacked weights costs extra;
- attention: only the attention over the cache (all layers).
--dump-hlo writes the optimised HLO of every program (XLA's own dump) for reading off the device.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import jax
import jax.numpy as jnp

from specjax import benchmarking
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import attention, decoder_layer, normalize, unembed

from bench_decode import SHAPES, on_device, weight_bytes  # noqa: E402  (scripts/ is on the path when run)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--cache", type=int, default=512)
    parser.add_argument("--dump-hlo", default=None)
    parser.add_argument("--name", default="profile_decode", help="results file name (e.g. per XLA_FLAGS tried)")
    args = parser.parse_args()
    if args.dump_hlo:
        # Before the backend starts (at the first computation); every module of the run is dumped.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.dump_hlo}"
                                   " --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$")
    from specjax.models.transformer import init_model

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

    def model_step(model, cache):
        return model(token, position, cache)[0]

    def unrolled(model, cache, layers=None):
        """Layers in a Python loop: sliced from the stacked weights by static index, or given as
        separate per-layer arrays (layers)."""
        x = model.embed[...][token].astype(dtype)
        slots = cache.lengths[:, None]
        for i in range(L):
            layer = jax.tree.map(lambda w: w[i], model.layers) if layers is None else layers[i]
            x, cache = decoder_layer(x, layer, i, position, slots, cache, config)
        final = normalize(x, model.final_norm[...], None, config)
        return unembed(final, model.embed[...], model.lm_head[...], dtype)

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

    def attention_only(cache):
        q = jnp.ones((B, 1, config.num_heads, config.head_dim), dtype)
        out = [attention(q, cache.k[i], cache.v[i], cache.lengths[:, None], config) for i in range(L)]
        return sum(o.astype(jnp.float32).sum() for o in out)

    variants = {
        "model": (model_step, (model, cache), weights + kv_read),
        "unrolled": (unrolled, (model, cache), weights + kv_read),
        "unrolled_split": (unrolled, (model, cache, per_layer), weights + kv_read),
        "matmuls_stacked": (matmuls_stacked, (model,), weights),
        "matmuls_split": (matmuls_split, (split_weights, model.embed[...], model.lm_head[...]), weights),
        "attention": (attention_only, (cache,), kv_read),
    }
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; weights {weights / 1e9:.2f} GB, KV {kv_read / 1e6:.1f} MB; "
          f"B={B} context={args.context}")
    rows = []
    for name, (fn, fn_args, floor_bytes) in variants.items():
        seconds = benchmarking.time_in_loop(fn, *fn_args, iterations=10)["median_s"]
        floor = floor_bytes / bandwidth
        rows.append({"variant": name, "ms": seconds * 1e3, "floor_ms": floor * 1e3, "fraction_of_floor": floor / seconds})
        print(f"{name:16s} {seconds * 1e3:8.3f} ms   floor {floor * 1e3:7.3f} ms   {floor / seconds:5.1%}", flush=True)
    meta = {**benchmarking.environment(), "shape": args.shape, "batch": B, "context": args.context,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "copy_bandwidth_TBps": round(bandwidth / 1e12, 3), "config": dataclasses.asdict(config)}
    benchmarking.write_results(args.name, rows, [("variant", "variant"), ("ms", "ms"), ("floor_ms", "floor ms"),
                                                       ("fraction_of_floor", "of floor")], meta,
                               os.environ.get("OUT", "benchmarks/results"))


if __name__ == "__main__":
    main()
