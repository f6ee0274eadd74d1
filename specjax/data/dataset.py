"""From a folder of text files to training batches: a train / held-out split by a hash of each
file's path, a tokenizer, token ids in memory-mapped files, and batches that are a pure function of
(seed, step) so that a resumed run sees exactly the batches it would have seen."""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from specjax import default_models
from specjax.config import DataConfig
from specjax.data.corpus import read_texts, source_files, stdlib_dir
from specjax.data.tokenizer import train_bpe_tokenizer


def is_held_out(path: Path, root: Path, fraction: float) -> bool:
    """A stable split: the file's relative path hashed to [0, 1)."""
    digest = hashlib.sha256(str(path.relative_to(root)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < fraction


def split_files(config: DataConfig) -> tuple[Path, list[Path], list[Path]]:
    files = source_files(Path(config.corpus_dir) if config.corpus_dir else None, config.pattern)
    if config.max_files is not None:
        files = files[:config.max_files]
    root = Path(config.corpus_dir) if config.corpus_dir else stdlib_dir()
    held_out = [f for f in files if is_held_out(f, root, config.held_out_fraction)]
    train = [f for f in files if not is_held_out(f, root, config.held_out_fraction)]
    if not train or not held_out:
        raise ValueError(f"the split of {len(files)} files under {root} left an empty part (train {len(train)}, "
                         f"held-out {len(held_out)}): use more files or another held_out_fraction")
    return root, train, held_out


def prepare(config: DataConfig, out_dir: Path) -> tuple[PreTrainedTokenizerFast, np.ndarray, np.ndarray]:
    """The tokenizer and the train / held-out token arrays (memory-mapped uint32), made once under
    out_dir and reused when they exist."""
    out_dir = Path(out_dir)
    tokenizer_dir = out_dir / "tokenizer"
    train_path, held_out_path = out_dir / "tokens_train.bin", out_dir / "tokens_held_out.bin"
    if tokenizer_dir.exists() and train_path.exists() and held_out_path.exists():
        return (AutoTokenizer.from_pretrained(tokenizer_dir), np.memmap(train_path, np.uint32, "r"),
                np.memmap(held_out_path, np.uint32, "r"))
    _, train_files, held_out_files = split_files(config)
    if config.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(default_models.tokenizer_folder(config.tokenizer))
    else:
        tokenizer = train_bpe_tokenizer(read_texts(train_files), config.vocab_size)
    arrays = [_tokenize_to(path, files, tokenizer) for path, files in
              ((train_path, train_files), (held_out_path, held_out_files))]
    tokenizer.save_pretrained(tokenizer_dir)  # last: its presence marks the preparation complete
    return tokenizer, *arrays


# Files a tokenizer call encodes: a fast tokenizer encodes a batch on every core (311 MB of site-packages in
# minutes, not tens of them).
TOKENIZE_CHUNK = 256


def _tokenize_to(path: Path, files: list[Path], tokenizer) -> np.ndarray:
    """Files joined with the EOS token between them, written as uint32 and memory-mapped back; they go to the
    tokenizer TOKENIZE_CHUNK at a time."""
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    texts = read_texts(files)
    parts: list[np.ndarray] = []
    while batch := list(itertools.islice(texts, TOKENIZE_CHUNK)):
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            parts.append(np.asarray(ids + eos, np.uint32))
    path.parent.mkdir(parents=True, exist_ok=True)
    np.concatenate(parts).tofile(path)
    return np.memmap(path, np.uint32, "r")


def batch_at(tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int) -> np.ndarray:
    """Batch `step`: batch_size windows of seq_len + 1 tokens at offsets drawn from (seed, step)."""
    if len(tokens) <= seq_len + 1:
        raise ValueError(f"{len(tokens)} tokens cannot fill a window of seq_len + 1 = {seq_len + 1}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, batch_size)
    return np.stack([np.asarray(tokens[s:s + seq_len + 1], np.int32) for s in starts])


def eval_batches(tokens: np.ndarray, num_batches: int, batch_size: int, seq_len: int) -> list[np.ndarray]:
    """Fixed held-out batches, drawn with their own seed."""
    return [batch_at(tokens, i, batch_size, seq_len, seed=2 ** 31 - 1) for i in range(num_batches)]
