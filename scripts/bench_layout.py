"""Stacked against decoding layout by model size: where the decoding layout pays (transformer.for_decoding).

    PYTHONPATH=. python scripts/bench_layout.py [--hidden-sizes 384,768,1024,2048,4096] [--layers 6]
        [--batch 1] [--prompt-len 64] [--new-tokens 64] [--dtype bfloat16|float32]

Llama-shaped random models (head dim 64, or 128 from hidden 4096; a quarter as many KV heads as query
heads; MLP width 8/3 of hidden rounded to 256, 14336 at hidden 4096, as Llama-3.1-8B; vocabulary 8192)
of the same depth, decoded greedily in each layout: autoregressive tokens/s (the full run's time minus a
one-token run's) and the first call's time (compile and one run). The weight bytes of a layer at which
the decoding layout starts to pay is transformer.DECODING_LAYOUT_MIN_LAYER_BYTES. Writes
benchmarks/results/bench_layout.{json,md}.
"""

from __future__ import annotations

import argparse
import time

import jax

from specjax import benchmarking
from specjax.config import ModelConfig
from specjax.models.transformer import init_model, layer_weight_bytes, to_decoding_layout
from specjax.speed import autoregressive_run, cache_size_for, generation_args, tokens_per_s


def llama_shape(hidden: int, layers: int, dtype: str) -> ModelConfig:
    head_dim = 128 if hidden >= 4096 else 64
    heads = hidden // head_dim
    width = 14336 if hidden == 4096 else -(-hidden * 8 // 3 // 256) * 256
    return ModelConfig(vocab_size=8192, hidden_size=hidden, num_layers=layers, num_heads=heads,
                       num_kv_heads=max(1, heads // 4), head_dim=head_dim, intermediate_size=width,
                       tie_word_embeddings=True, param_dtype="bfloat16", dtype=dtype)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-sizes", default="384,768,1024,2048,4096")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="compute dtype")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--name", default="bench_layout")
    args = parser.parse_args()
    cache_size = cache_size_for(args.prompt_len, args.new_tokens, 0)
    rows = []
    for hidden in (int(h) for h in args.hidden_sizes.split(",")):
        config = llama_shape(hidden, args.layers, args.dtype)
        stacked = benchmarking.on_device(lambda config=config: init_model(config, seed=0))
        row = {"hidden": hidden, "layer_MiB": layer_weight_bytes(stacked) / 2 ** 20}
        for name, model in (("stacked", stacked), ("decoding", to_decoding_layout(stacked))):
            run_args, one_args = (generation_args(model, args.batch, args.prompt_len, n, 1, cache_size)
                                  for n in (args.new_tokens, 1))
            run = autoregressive_run(model, cache_size)
            start = time.perf_counter()
            jax.block_until_ready(run(one_args))
            row[f"{name}_first_call_s"] = time.perf_counter() - start
            row[f"{name}_tok_s"], _ = tokens_per_s(run, run_args, one_args)
        row["decoding_over_stacked"] = row["decoding_tok_s"] / row["stacked_tok_s"]
        rows.append(row)
        print(row, flush=True)
    columns = [("hidden", "hidden"), ("layer_MiB", "MiB a layer"), ("stacked_tok_s", "stacked tok/s"),
               ("decoding_tok_s", "decoding tok/s"), ("decoding_over_stacked", "decoding / stacked"),
               ("stacked_first_call_s", "stacked first call s"), ("decoding_first_call_s", "decoding first call s")]
    meta = {**benchmarking.environment(), "layers": args.layers, "batch": args.batch, "prompt": args.prompt_len,
            "new_tokens": args.new_tokens, "dtype": args.dtype, "weights": "random bfloat16"}
    print("wrote", *benchmarking.write_results(args.name, rows, columns, meta, args.out_dir))


if __name__ == "__main__":
    main()
