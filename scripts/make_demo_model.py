"""Makes a small randomly initialised Llama-style checkpoint folder with a BPE tokenizer trained offline
on the Python standard library: the main job's model until the trained default models ship.

    python scripts/make_demo_model.py --out build/demo_model
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from specjax.config import ModelConfig
from specjax.data.corpus import read_texts, source_files
from specjax.data.tokenizer import train_bpe_tokenizer
from specjax.models import hf
from specjax.models.transformer import init_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--num-files", type=int, default=200, help="stdlib files the tokenizer learns from")
    args = parser.parse_args()
    if (args.out / "config.json").exists():
        print(f"{args.out} exists; reusing it")
        return
    files = list(itertools.islice(source_files(), args.num_files))
    tokenizer = train_bpe_tokenizer(read_texts(files), args.vocab_size)
    config = ModelConfig(vocab_size=len(tokenizer), hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                         head_dim=32, intermediate_size=384, max_position_embeddings=2048, init_std=0.05)
    model = init_model(config, seed=0)
    hf.save(model, args.out, extra_config={"bos_token_id": tokenizer.bos_token_id,
                                           "eos_token_id": tokenizer.eos_token_id,
                                           "pad_token_id": tokenizer.pad_token_id})
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}: {config.num_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size} "
          f"(random weights: text is noise until the trained default models ship)")


if __name__ == "__main__":
    main()
