"""The committed fixture files (tiny checkpoints, golden outputs of reference code, tiny trained
weights) and the helpers that write checkpoints or train through the CLI."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from specjax.config import ModelConfig, load_yaml
from specjax.models import hf
from specjax.models.transformer import init_model

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
HF_FIXTURES = sorted(p.name for p in (FIXTURES / "hf").iterdir() if p.is_dir())
# Tiny trained weights the tests use, made by scripts/make_test_fixtures.py (not trained in the suite).
TRAINED = FIXTURES / "trained"
TRAINED_TINY_LM = TRAINED / "tiny_lm"
TRAINED_DFLASH = TRAINED / "dflash_llama_gqa"


def fixture_dir(name: str) -> Path:
    return FIXTURES / "hf" / name


def golden(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / "golden" / f"{name}.npz") as data:
        return dict(data)


def drafter_run_config(config_class, path: Path, target_dir, output_dir, *overrides):
    """A drafter-training config from its YAML, for the target folder and the output folder."""
    return load_yaml(config_class, path, [f"target={target_dir}", f"output_dir={output_dir}", *overrides])


def train_through_cli(command: str, config: Path, target_dir, output_dir: Path) -> Path:
    """`specjax COMMAND --config CONFIG` for the target, in a subprocess, as a user would run it. The process has
    the suite's eight host devices (tests/conftest.py), so that a run the tests repeat in their own process ends
    bit for bit where it did (with one device MTP's losses differ in the last bits from step 4 on)."""
    subprocess.run([sys.executable, "-m", "specjax.cli", command, "--config", str(config), "--set",
                    f"target={target_dir}", "--set", f"output_dir={output_dir}"],
                   check=True, cwd=REPO, capture_output=True, text=True, env={**os.environ, "JAX_NUM_CPU_DEVICES": "8"})
    return output_dir


CODE_TEXT = ["def add(a, b):\n    return a + b\n", "for item in items:\n    total += item\n",
             "for i in range(10):\n    print(i)\n"] * 30


def write_tiny_checkpoint(folder: Path, seed: int = 0):
    """A random 2-layer Llama-style checkpoint folder with a BPE tokenizer trained on CODE_TEXT, as
    transformers and `specjax generate` read it; returns the tokenizer."""
    from specjax.data.tokenizer import train_bpe_tokenizer  # the tokenizers library, only where needed

    tokenizer = train_bpe_tokenizer(CODE_TEXT, vocab_size=300)
    config = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, intermediate_size=64, init_std=0.3)
    hf.save(init_model(config, seed=seed), folder, extra_config={"eos_token_id": tokenizer.eos_token_id})
    tokenizer.save_pretrained(folder)
    return tokenizer

