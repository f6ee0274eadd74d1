"""DSpark against DFlash on the default models: mean acceptance length at K 7 and 15, T 0 and T 1, and the
confidence head's AUC against the margin estimator's on the same held-out steps.

    PYTHONPATH=. python scripts/dspark_eval.py --out $OUT/dspark_eval
    PYTHONPATH=. python scripts/dspark_eval.py --out /tmp/e --dspark runs/default/dspark/drafter --prompts 4

Acceptance: speculative generation from held-out prompts (the corpus split the target was trained with,
tokenized with its tokenizer, as scripts/make_model_card.py takes them), greedy drafting and verification at
T 0, probabilistic drafting with block verification at T 1 (seeded per row); the drafters draft their whole
block (dflash_full_block auto).

AUC: specjax.training.confidence's, on the held-out steps it defines (greedy draft steps over the target's
own continuation of held-out prompts, each draft given the ones before it accepted; the margin estimator
fitted on half of them, both scored on the other half). Writes dspark_eval.json and dspark_eval.md to --out
and prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from specjax import benchmarking, default_models
from specjax.config import DataConfig, SamplingConfig, SpecConfig
from specjax.data.dataset import prepare
from specjax.decoding import generate
from specjax.models import hf
from specjax.models.dflash import load_dflash
from specjax.models.dspark import load_dspark
from specjax.training.confidence import confidence_against_margin, held_out_steps
from specjax.training.evaluation import held_out_prompts


def acceptance(target, method: str, drafter, prompts, new_tokens: int, k: int, temperature: float) -> dict:
    sampled = temperature > 0
    spec = SpecConfig(method=method, num_speculative_tokens=k, draft_sample_method="probabilistic" if sampled else "greedy",
                      rejection_sample_method="block" if sampled else "standard")
    result = generate(target, prompts, max_new_tokens=new_tokens, spec=spec, drafter=drafter,
                      sampling=SamplingConfig(temperature=temperature), seeds=np.arange(len(prompts)))
    summary = result.metrics.summary()
    return {"mean_acceptance_length": summary["mean_acceptance_length"],
            "per_position_acceptance": summary["per_position_acceptance"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--target", default=default_models.TARGET)
    parser.add_argument("--dflash", default="default:dflash")
    parser.add_argument("--dspark", default="default:dspark")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--auc-prompts", type=int, default=256, help="held-out prompts continued for the AUC steps")
    parser.add_argument("--auc-new-tokens", type=int, default=96)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    target_dir = default_models.resolve(args.target)
    target = hf.load(target_dir, param_dtype="float32")
    dflash = load_dflash(default_models.resolve(args.dflash), target.config, "float32")
    dspark = load_dspark(default_models.resolve(args.dspark), target.config, "float32")
    with tempfile.TemporaryDirectory() as corpus_dir:
        _, _, held_out = prepare(DataConfig(tokenizer=str(target_dir)), Path(corpus_dir))
        prompts = held_out_prompts(held_out, args.prompts, args.prompt_len)
        auc_prompts = held_out_prompts(held_out, args.auc_prompts, args.prompt_len, seed=1)
    rows = [{"method": method, "K": k, "T": t, **acceptance(target, method, drafter, prompts, args.new_tokens, k, t)}
            for k in (7, 15) for t in (0.0, 1.0) for method, drafter in (("dflash", dflash), ("dspark", dspark))]
    confidence = confidence_against_margin(held_out_steps(target, dspark, auc_prompts, args.auc_new_tokens, args.batch))
    report = {"environment": benchmarking.environment(), "acceptance": rows, "confidence": confidence,
              "drafters": {"dflash": str(args.dflash), "dspark": str(args.dspark)},
              "prompts": {"count": len(prompts), "tokens": args.prompt_len, "new_tokens": args.new_tokens},
              "auc_prompts": {"count": len(auc_prompts), "new_tokens": args.auc_new_tokens}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dspark_eval.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = render(report)
    (args.out / "dspark_eval.md").write_text(markdown)
    print(markdown)


def render(report: dict) -> str:
    env, c, p = report["environment"], report["confidence"], report["prompts"]
    by = {(r["method"], r["K"], r["T"]): r["mean_acceptance_length"] for r in report["acceptance"]}
    lines = [f"# DSpark against DFlash on the default models ({env['device']}, JAX {env['jax']}, {env['date']})", "",
             f"Mean acceptance length, {p['count']} held-out prompts of {p['tokens']} tokens, {p['new_tokens']} new "
             "tokens (T 0: greedy; T 1: probabilistic drafting, block verification):", "",
             "| K | T | DFlash | DSpark | DSpark / DFlash |", "|---|---|---|---|---|"]
    for k in (7, 15):
        for t in (0.0, 1.0):
            a, b = by[("dflash", k, t)], by[("dspark", k, t)]
            lines.append(f"| {k} | {t:g} | {a:.3f} | {b:.3f} | {b / a:.3f} |")
    lines += ["", f"Confidence head against the margin estimator (logistic regression on top-1 minus top-2 draft "
              f"logit, fitted on {c['fitted_drafts']} drafts), AUC on the other half's {c['scored_drafts']} drafts "
              f"(accepted fraction {c['accepted_fraction']:.3f}; each draft given the ones before it accepted):", "",
              "| estimator | AUC |", "|---|---|",
              f"| confidence head | {c['auc_confidence_head']:.4f} |",
              f"| margin (logistic) | {c['auc_margin_logistic']:.4f} |", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
