"""specjax against PyTorch transformers on the same GPU: greedy decoding, batch 1, the same prompts.

    PYTHONPATH=. python scripts/bench_peer_hf.py [--prompts 8] [--new-tokens 128] [--k 4] [--no-8b]

1. The bundled default models (target + draft; already Hugging Face folders), float32 so that greedy
   outputs can be compared token for token: transformers' static-cache `generate` and assisted
   generation (the draft as assistant, K tokens a step, constant schedule) against specjax
   autoregressive and speculative (draft_model, K) decoding. Outputs checked equal; tokens/s and ratios.
2. Llama-3.1-8B and 3.2-1B shapes with random bfloat16 weights, 256 new tokens: transformers' static
   cache and assisted generation against specjax autoregressive (speed only: the random weights differ
   between the frameworks, so their outputs are not compared).
Writes benchmarks/results/bench_peer_hf.{json,md}. Needs torch (present on the GPU machine, never a
specjax dependency). EOS never stops a row (both sides generate exactly --new-tokens).
--only hf | specjax runs one side of part 1 and exchanges prompts and outputs through --work-file (a
check where the two cannot share one Python).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # leave the GPU's other half to torch
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def hf_side(target_dir: Path, draft_dir: Path, prompts: list[list[int]], new_tokens: int, k: int, dtype: str) -> dict:
    """transformers' static-cache and assisted greedy generation, one prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = getattr(torch, dtype)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch_dtype).to(device).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch_dtype).to(device).eval()
    return hf_generate(target, draft, prompts, new_tokens, k, device)


def hf_generate(target, draft, prompts, new_tokens: int, k: int, device: str) -> dict:
    import torch

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    common = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    modes = {"hf_static": dict(cache_implementation="static"),
             "hf_assisted": dict(assistant_model=draft, num_assistant_tokens=k,
                                 num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)}
    results = {}
    with torch.inference_mode():
        for name, extra in modes.items():
            outputs, seconds = [], 0.0
            for index, prompt in enumerate(prompts):
                ids = torch.tensor([prompt], device=device)
                if index == 0:  # warm-up (static cache compiles, allocations)
                    target.generate(ids, **common, **extra)
                sync()
                start = time.perf_counter()
                out = target.generate(ids, **common, **extra)
                sync()
                seconds += time.perf_counter() - start
                outputs.append(out[0, len(prompt):].tolist())
            results[name] = {"tokens": outputs, "tok_s": new_tokens * len(prompts) / seconds}
    return results


def specjax_side(target_dir: Path, draft_dir: Path, prompts: list[list[int]], new_tokens: int, k: int,
                 dtype: str) -> dict:
    """specjax autoregressive and speculative greedy generation, one prompt at a time (as the peer)."""
    import jax

    from specjax.config import SpecConfig
    from specjax.decoding import generate
    from specjax.models import hf
    from specjax.models.transformer import to_decoding_layout

    target, draft = (to_decoding_layout(hf.load(folder, dtype=dtype, param_dtype=dtype)) for folder in (target_dir, draft_dir))
    modes = {"specjax_ar": {}, "specjax_speculative": dict(spec=SpecConfig(method="draft_model",
                                                                           num_speculative_tokens=k), drafter=draft)}
    results = {}
    for name, extra in modes.items():
        outputs, seconds = [], 0.0
        for index, prompt in enumerate(prompts):
            # float32 products in float32, as PyTorch's default (the GPU's TF32 would round differently).
            with jax.default_matmul_precision("float32" if dtype == "float32" else None):
                if index == 0:
                    generate(target, [prompt], max_new_tokens=new_tokens, **extra)  # compiles
                start = time.perf_counter()
                result = generate(target, [prompt], max_new_tokens=new_tokens, **extra)
                jax.block_until_ready(result.tokens)
                seconds += time.perf_counter() - start
            outputs.append(result.sequences()[0])
        results[name] = {"tokens": outputs, "tok_s": new_tokens * len(prompts) / seconds}
    return results


def shapes_8b(new_tokens: int, k: int, prompt_len: int = 128) -> dict:
    """Speed at Llama-3.1-8B / 3.2-1B shapes, random bfloat16 weights, batch 1."""
    import jax
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench_decode import SHAPES, generation_args, on_device  # noqa: E402  (scripts/ is on the path)
    from specjax.config import SamplingConfig
    from specjax.decoding import decode_loop
    from specjax.models.hf import config_to_hf
    from specjax.models.transformer import init_model, to_decoding_layout

    target_config, draft_config = SHAPES["8b"]
    models = []
    torch.set_default_dtype(torch.bfloat16)  # initialised on the GPU in bfloat16 directly
    for config in (target_config, draft_config):
        with torch.device("cuda"):
            models.append(LlamaForCausalLM(LlamaConfig(**config_to_hf(config))).eval())
    torch.set_default_dtype(torch.float32)
    prompt = np.random.default_rng(0).integers(0, target_config.vocab_size, prompt_len).tolist()
    hf = hf_generate(models[0], models[1], [prompt], new_tokens, k, "cuda")
    del models
    torch.cuda.empty_cache()

    target = to_decoding_layout(on_device(lambda: init_model(target_config, seed=0)))
    cache_size = -(-(prompt_len + new_tokens + k + 1) // 128) * 128
    args = generation_args(target, 1, prompt_len, new_tokens, k + 1, cache_size)
    run = lambda: decode_loop(target, *args, sampling=SamplingConfig(), eos_token_ids=(), cache_size=cache_size)  # noqa: E731
    jax.block_until_ready(run())
    start = time.perf_counter()
    jax.block_until_ready(run())
    specjax_tok_s = new_tokens / (time.perf_counter() - start)
    return {"hf_static_tok_s": hf["hf_static"]["tok_s"], "hf_assisted_tok_s": hf["hf_assisted"]["tok_s"],
            "specjax_ar_tok_s": specjax_tok_s}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-8b", action="store_true")
    parser.add_argument("--only", choices=("specjax", "hf", "compare"), default=None,
                        help="one step of part 1, in this order, exchanging through --work-file")
    parser.add_argument("--work-file", type=Path, default=Path("build/bench_peer_hf.work.json"))
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args()
    from specjax import default_models

    target_dir, draft_dir = default_models.path("target"), default_models.path("draft")

    work = json.loads(args.work_file.read_text()) if args.only in ("hf", "compare") else {}
    if args.only in (None, "specjax"):
        from specjax.experiments import RunConfig, load_models, load_prompts

        _, tokenizer, _ = load_models("default:target")
        work["prompts"] = load_prompts(RunConfig(target="default:target", num_prompts=args.prompts), tokenizer)
        work.update(specjax_side(target_dir, draft_dir, work["prompts"], args.new_tokens, args.k, args.dtype))
    if args.only in (None, "hf"):
        work.update(hf_side(target_dir, draft_dir, work["prompts"], args.new_tokens, args.k, args.dtype))
    if args.only in ("specjax", "hf"):
        args.work_file.parent.mkdir(parents=True, exist_ok=True)
        args.work_file.write_text(json.dumps(work))
        print(f"wrote {args.work_file}")
        return

    reference = work["hf_static"]["tokens"]
    rows = []
    for name in ("hf_static", "hf_assisted", "specjax_ar", "specjax_speculative"):
        same = sum(a == b for a, b in zip(work[name]["tokens"], reference, strict=True))
        rows.append({"models": "default (float32)", "decoder": name, "tok_s": work[name]["tok_s"],
                     "rows_equal_hf_static": f"{same}/{len(reference)}"})
    ratios = {"specjax_speculative_over_hf_assisted": work["specjax_speculative"]["tok_s"] / work["hf_assisted"]["tok_s"],
              "specjax_ar_over_hf_static": work["specjax_ar"]["tok_s"] / work["hf_static"]["tok_s"]}
    if not args.no_8b and args.only is None:
        eight = shapes_8b(256, args.k + 1)
        rows += [{"models": "8B / 1B shapes (bfloat16, random)", "decoder": name, "tok_s": eight[f"{name}_tok_s"]}
                 for name in ("hf_static", "hf_assisted", "specjax_ar")]
        ratios["8b_specjax_ar_over_hf_static"] = eight["specjax_ar_tok_s"] / eight["hf_static_tok_s"]
    from specjax import benchmarking

    for row in rows:
        print(row)
    print(ratios)
    meta = {**benchmarking.environment(), "prompts": len(reference), "new_tokens": args.new_tokens, "K": args.k,
            **{key: round(value, 3) for key, value in ratios.items()}}
    benchmarking.write_results("bench_peer_hf", rows, [("models", "models"), ("decoder", "decoder"),
                                                      ("tok_s", "tokens/s"), ("rows_equal_hf_static", "rows = HF")],
                               meta, args.out_dir)


if __name__ == "__main__":
    main()
