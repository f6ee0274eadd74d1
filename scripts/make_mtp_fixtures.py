"""Make tests/fixtures/mtp: tiny Qwen2 targets with 1 and 3 MTP modules in MiMo's layout, with outputs of
MiMo's own PyTorch code (``modeling_mimo.py`` of huggingface.co/XiaomiMiMo/MiMo-7B-Base: ``MiMoForCausalLM``,
``MiMoMTPLayers``) as golden files.

MiMo's HF ``forward`` does not run its MTP layers (engines do), so the script runs each ``MiMoMTPLayers``
itself over a whole sequence, as MiMo trains them: module m at position s reads the embedding of token
x_{s+m+1} (the ids rolled left by m + 1, zeros past the end) and a hidden state for s, the target's
final-norm hidden state for module 0 and, for module m > 0, either the previous module's output
("chained") or the target's hidden state again ("target"); a causal mask; logits through the target's
``lm_head``.

Writes, for N in 1, 3:
* ``mtp/mimo{N}/`` -- a random ``MiMoForCausalLM`` (float32, 2 layers, hidden 64, vocab 256, N MTP modules,
  ``num_nextn_predict_layers`` N), ``save_pretrained`` output: MiMo's layout (``model.mtp_layers.{i}.*``);
* ``golden/mtp{N}.npz`` -- ``input_ids`` [2, 12]; ``logits`` [2, 12, V] (the target's);
  ``module_logits_chained`` and ``module_logits_target`` [N, 2, 12, V]; ``prompt_{0,1,2}`` (lengths 3, 7, 12)
  with ``greedy_{0,1,2}`` (16 greedy tokens of the target each, no eos: what greedy speculative decoding
  must emit) and ``min_greedy_margin`` (the smallest top-1 minus top-2 logit gap over those steps).

MiMo's code is not copied here: pass a folder holding its ``modeling_mimo.py`` and ``configuration_mimo.py``
(downloaded from the model's Hugging Face page). Its ``MiMoMTPLayers.forward`` forwards extra keyword
arguments to ``Qwen2Attention``, which in transformers 5 takes the rotary ``position_embeddings``: the script
passes them that way. Needs torch, transformers (written with torch 2.13.0+cpu, on the CPU, and transformers
5.24.0), safetensors and numpy; torch is not a specjax dependency, so from a separate virtual environment:

    python scripts/make_mtp_fixtures.py --mimo-src PATH/TO/MIMO_FILES [--out tests/fixtures]
"""

import argparse
import importlib
import sys
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
VOCAB = 256
SEQUENCE = 12
PROMPT_LENGTHS = (3, 7, 12)
NEW_TOKENS = 16
SEED = 0

_CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
               tie_word_embeddings=False, use_sliding_window=False, initializer_range=0.1, bos_token_id=1,
               eos_token_id=2, attention_bias=True)


def randomise_norms_and_biases(model, std=0.1):
    """Norm weights around 1 and biases around 0 (initialised to exactly 1 and 0), so that loading them is tested."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, std)
            elif name.endswith(".bias"):
                param.normal_(0.0, std)


def module_logits(model, input_ids, hidden_state: str):
    """[N, B, T, V]: each MiMoMTPLayers over the sequence (the module docstring's rule)."""
    inner = model.model
    batch, length = input_ids.shape
    target_hidden = model(input_ids, output_hidden_states=True).hidden_states[-1]  # after the final norm
    positions = torch.arange(length)[None].expand(batch, length)
    position_embeddings = inner.rotary_emb(target_hidden, positions)
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None].expand(batch, 1, length, length)
    previous, logits = target_hidden, []
    for m, layer in enumerate(inner.mtp_layers):
        rolled = torch.cat([input_ids[:, m + 1:], torch.zeros(batch, m + 1, dtype=input_ids.dtype)], dim=1)
        fed = target_hidden if hidden_state == "target" or m == 0 else previous
        out = layer(inner.embed_tokens(rolled), fed, mask, positions,
                    position_embeddings=position_embeddings).last_hidden_state
        logits.append(model.lm_head(out))
        previous = out
    return torch.stack(logits).numpy()


def greedy(model, prompt):
    tokens, margins = list(prompt), []
    for _ in range(NEW_TOKENS):
        logits = model(torch.tensor([tokens])).logits[0, -1]
        top = torch.topk(logits, 2).values
        margins.append(float(top[0] - top[1]))
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):], min(margins)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mimo-src", type=Path, required=True,
                        help="a folder with MiMo's modeling_mimo.py and configuration_mimo.py")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures")
    args = parser.parse_args()
    source = args.mimo_src.resolve()
    sys.path.insert(0, str(source.parent))
    mimo = importlib.import_module(f"{source.name}.modeling_mimo")
    config_class = importlib.import_module(f"{source.name}.configuration_mimo").MiMoConfig

    for num_modules in (1, 3):
        torch.manual_seed(SEED + num_modules)
        config = config_class(**_CONFIG, num_nextn_predict_layers=num_modules)
        config._attn_implementation = "eager"
        model = mimo.MiMoForCausalLM(config).eval()
        randomise_norms_and_biases(model)
        folder = args.out / "mtp" / f"mimo{num_modules}"
        model.save_pretrained(folder, safe_serialization=True)
        rng = np.random.default_rng(SEED + num_modules)
        input_ids = torch.tensor(rng.integers(3, VOCAB, (2, SEQUENCE)))
        arrays = {"input_ids": input_ids.numpy()}
        with torch.no_grad():
            arrays["logits"] = model(input_ids).logits.numpy()
            for hidden_state in ("chained", "target"):
                arrays[f"module_logits_{hidden_state}"] = module_logits(model, input_ids, hidden_state)
            margins = []
            for i, length in enumerate(PROMPT_LENGTHS):
                prompt = rng.integers(3, VOCAB, length).tolist()
                tokens, margin = greedy(model, prompt)
                arrays[f"prompt_{i}"], arrays[f"greedy_{i}"] = np.asarray(prompt), np.asarray(tokens)
                margins.append(margin)
        arrays["min_greedy_margin"] = np.float32(min(margins))
        (args.out / "golden").mkdir(parents=True, exist_ok=True)
        np.savez_compressed(args.out / "golden" / f"mtp{num_modules}.npz",
                            **{k: np.asarray(v, np.float32) if v.dtype == np.float64 else v for k, v in arrays.items()})
        print(folder, "min greedy margin", min(margins))


if __name__ == "__main__":
    main()
