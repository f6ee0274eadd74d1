"""Installs trained default models and writes their model card.

    PYTHONPATH=. python scripts/make_model_card.py --runs runs/default --out specjax/default_models

Reads the runs of scripts/train_default_models.sh (target/, draft/, medusa/, eagle1/, eagle3/),
stores every model in bfloat16 under --out (refusing more than --max-mb in all), measures the greedy
mean acceptance length at K = 4 of each drafter on held-out prompts of the target's corpus split,
and writes MODEL_CARD.md and model_card.json there.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from specjax import benchmarking
from specjax.config import SpecConfig
from specjax.models import hf
from specjax.models.eagle import load_eagle, save_eagle
from specjax.models.medusa import load_medusa, save_medusa
from specjax.training.evaluation import held_out_prompts, mean_acceptance_length


def folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=Path("runs/default"))
    parser.add_argument("--out", type=Path, default=Path("specjax/default_models"))
    parser.add_argument("--max-mb", type=float, default=40.0)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    runs, out = args.runs, args.out
    out.mkdir(parents=True, exist_ok=True)

    # Every model in bfloat16: the package carries them, and history keeps every blob.
    target = hf.load(runs / "target/model", param_dtype="bfloat16")
    draft = hf.load(runs / "draft/model", param_dtype="bfloat16")
    tokenizer = AutoTokenizer.from_pretrained(runs / "target/model")
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    for name, model in (("target", target), ("draft", draft)):
        hf.save(model, out / name, extra_config=special)
        tokenizer.save_pretrained(out / name)
        shutil.copy(runs / name / "model/eval.json", out / name / "eval.json")
    medusa = load_medusa(runs / "medusa/heads", param_dtype="bfloat16")
    save_medusa(medusa, out / "medusa")
    heads = {}
    for kind in ("eagle1", "eagle3"):
        heads[kind] = load_eagle(runs / kind / "head", target.config)
        save_eagle(heads[kind], out / kind)
    total_mb = folder_mb(out)
    if total_mb > args.max_mb:
        raise SystemExit(f"the default models take {total_mb:.1f} MB: allowed at most {args.max_mb} MB")

    held_out = np.memmap(runs / "target/tokens_held_out.bin", np.uint32, "r")  # the target run's split
    prompts = held_out_prompts(held_out, args.prompts, args.prompt_len)
    drafters = {
        "draft_model": (SpecConfig(method="draft_model", num_speculative_tokens=4), draft),
        "eagle": (SpecConfig(method="eagle", num_speculative_tokens=4), heads["eagle1"]),
        "eagle3": (SpecConfig(method="eagle3", num_speculative_tokens=4), heads["eagle3"]),
        "medusa": (SpecConfig(method="medusa", num_speculative_tokens=4), medusa),
        "ngram": (SpecConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=5),
                  None),
    }
    acceptance = {name: mean_acceptance_length(target, spec, drafter, prompts, args.new_tokens)
                  for name, (spec, drafter) in drafters.items()}
    card = {
        "environment": benchmarking.environment(),
        "target": json.loads((out / "target/eval.json").read_text()),
        "draft": json.loads((out / "draft/eval.json").read_text()),
        "heads": {kind: json.loads((runs / folder / "eval.json").read_text())
                  for kind, folder in (("medusa", "medusa/heads"), ("eagle1", "eagle1/head"),
                                       ("eagle3", "eagle3/head"))},
        "acceptance_T0_K4": {name: summary["mean_acceptance_length"] for name, summary in acceptance.items()},
        "held_out_prompts": {"count": len(prompts), "tokens": args.prompt_len, "new_tokens": args.new_tokens},
        "size_MB": round(total_mb, 2),
        "vocab_size": len(tokenizer),
    }
    (out / "model_card.json").write_text(json.dumps(card, indent=2) + "\n")
    (out / "MODEL_CARD.md").write_text(render(card))
    print(render(card))


def render(card: dict) -> str:
    t, d, env = card["target"], card["draft"], card["environment"]
    lines = [
        "# specjax default models", "",
        "Trained by `scripts/train_default_models.sh` on the Python standard library sources (tests excluded; "
        "a file's split is a hash of its path), with a byte-level BPE tokenizer trained on the training split "
        f"({card['vocab_size']} tokens). Stored in bfloat16, {card['size_MB']} MB in all. Measured on "
        f"{env['device']} with JAX {env['jax']}, {env['date']}.", "",
        "| model | parameters | steps | held-out loss | held-out perplexity |", "|---|---|---|---|---|",
        f"| target | {t['parameters'] / 1e6:.1f}M | {t['steps']} | {t['held_out_loss']:.3f} | "
        f"{t['held_out_perplexity']:.1f} |",
        f"| draft | {d['parameters'] / 1e6:.1f}M | {d['steps']} | {d['held_out_loss']:.3f} | "
        f"{d['held_out_perplexity']:.1f} |", "",
        f"Mean acceptance length, greedy, K = 4, {card['held_out_prompts']['count']} held-out prompts of "
        f"{card['held_out_prompts']['tokens']} tokens, {card['held_out_prompts']['new_tokens']} new tokens "
        "(n-gram with prompt_lookup_min 2, max 5):", "",
        "| drafter | mean acceptance length |", "|---|---|",
        *[f"| {name} | {value:.2f} |" for name, value in card["acceptance_T0_K4"].items()], "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
