"""A research script on the library API: how does EAGLE-1's mean acceptance length grow with K, and
does block verification accept more than standard rejection sampling at T = 1?

    PYTHONPATH=. python scripts/example_research.py [--prompts 16] [--new-tokens 64]

Uses the bundled default models; any Hugging Face folder works in their place.
"""

import argparse

from specjax.config import SamplingConfig, SpecConfig
from specjax.decoding import generate
from specjax.experiments import RunConfig, load_models, load_prompts


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()

    # The target, its tokenizer and the bundled EAGLE-1 head; float32 compute keeps greedy exact.
    target, tokenizer, head = load_models("default:target", "eagle", dtype="float32")
    prompts = load_prompts(RunConfig(target="default:target", num_prompts=args.prompts), tokenizer)
    greedy = generate(target, prompts, max_new_tokens=args.new_tokens).sequences()

    print("K  mean acceptance length (T=0)   greedy rows = autoregressive")
    for k in (1, 2, 4, 6, 8):
        result = generate(target, prompts, max_new_tokens=args.new_tokens,
                          spec=SpecConfig(method="eagle", num_speculative_tokens=k), drafter=head)
        same = sum(a == b for a, b in zip(result.sequences(), greedy, strict=True))
        print(f"{k}  {result.metrics.summary()['mean_acceptance_length']:.3f}" + " " * 26 + f"{same}/{len(prompts)}")

    print("\nT=1, K=4, drafting from the head's distribution:")
    for verifier in ("standard", "block"):
        spec = SpecConfig(method="eagle", num_speculative_tokens=4, rejection_sample_method=verifier,
                          draft_sample_method="probabilistic")
        result = generate(target, prompts, max_new_tokens=args.new_tokens, spec=spec, drafter=head,
                          sampling=SamplingConfig(temperature=1.0), seeds=list(range(len(prompts))))
        print(f"  {verifier:8s} mean acceptance length {result.metrics.summary()['mean_acceptance_length']:.3f}")


if __name__ == "__main__":
    main()
