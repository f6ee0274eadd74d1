"""specjax: speculative decoding in JAX / Flax (README.md)."""

import os

# specjax uses transformers for tokenizers only; without PyTorch it warns so on every import ("PyTorch was not
# found"), which only the environment silences before that import. A user's own setting wins.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
