"""The engine's peer: transformers' continuous batching (`model.generate_batch`, paged KV) at the 8B shape.

    python scripts/bench_peer_cb.py --batches 64,256 --prompt-len 128 --new-tokens 128 --output $OUT

A Llama-3.1-8B-shaped LlamaForCausalLM with random bfloat16 weights on one GPU (the same sizes as
benchmarking.SHAPES["8b"], which scripts/bench_serve.py --models 8b serves), greedy, the same random prompts
as bench_serve (numpy seed 0), no end-of-sequence id: every request generates --new-tokens tokens. For each
batch, all its requests are handed to generate_batch at once (its scheduler admits them as its cache allows),
after one untimed call that warms it up; output tok/s = generated tokens / the call's wall time. Needs torch
and transformers >= 5 (the GPU machine has both; they are not specjax dependencies). Writes NAME.json/.md.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import sys
import time

import numpy as np

COLUMNS = [("system", "system"), ("attention", "attention"), ("requests", "requests"), ("new_tokens", "new tokens"),
           ("generated", "tokens generated"), ("seconds", "seconds"), ("output_tok_s", "output tok/s")]


def build_model(attention: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specjax.benchmarking import SHAPES

    shape = SHAPES["8b"][0]
    config = LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                         intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                         num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                         head_dim=shape.head_dim, max_position_embeddings=shape.max_position_embeddings,
                         rope_theta=shape.rope_theta, tie_word_embeddings=False, eos_token_id=None,
                         bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(config, torch_dtype=torch.bfloat16, attn_implementation=attention)
    return model.eval(), shape.vocab_size


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--attention", default="paged|sdpa", help="attn_implementation (transformers' name)")
    parser.add_argument("--name", default="bench_peer_cb")
    parser.add_argument("--output", default="benchmarks/results")
    args = parser.parse_args(argv)

    import torch
    import transformers
    from transformers import GenerationConfig

    from specjax.benchmarking import write_results

    model, vocab = build_model(args.attention)
    prompts = np.random.default_rng(0).integers(0, vocab, (1024, args.prompt_len)).tolist()
    config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    rows = []
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": "Llama-3.1-8B shape, random bfloat16 weights", "prompt_len": args.prompt_len,
            "command": " ".join(["python", *map(shlex.quote, sys.argv)])}
    with torch.no_grad():  # not inference_mode: generate_batch updates its tensors in place in its own thread
        model.generate_batch(inputs=prompts[:8], generation_config=GenerationConfig(
            max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0), progress_bar=False)
        for batch in (int(b) for b in args.batches.split(",")):
            model.generate_batch(inputs=prompts[:batch], generation_config=config, progress_bar=False)  # warm-up
            torch.cuda.synchronize()
            start = time.perf_counter()
            outputs = model.generate_batch(inputs=prompts[:batch], generation_config=config, progress_bar=False)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            generated = sum(len(out.generated_tokens) for out in outputs.values())
            rows.append({"system": f"transformers {transformers.__version__} generate_batch",
                         "attention": args.attention, "requests": batch, "new_tokens": args.new_tokens,
                         "generated": generated, "seconds": seconds, "output_tok_s": generated / seconds})
            print(f"generate_batch {batch} requests: {generated / seconds:.1f} tok/s ({generated} tokens, "
                  f"{seconds:.1f} s)", flush=True)
            write_results(args.name, rows, COLUMNS, meta, args.output)


if __name__ == "__main__":
    main()
