"""The closing evaluation of a drafter: mean acceptance length on held-out prompts, greedy."""

from __future__ import annotations

from typing import Any

import numpy as np

from specjax.config import SpecConfig
from specjax.decoding import generate
from specjax.models.transformer import Transformer


def held_out_prompts(tokens: np.ndarray, num_prompts: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """Windows of held-out tokens at evenly spread offsets (jittered by seed)."""
    rng = np.random.default_rng(seed)
    span = len(tokens) - prompt_len - 1
    if span < num_prompts:
        raise ValueError(f"{len(tokens)} held-out tokens are too few for {num_prompts} prompts of {prompt_len}")
    starts = (np.linspace(0, span - 1, num_prompts) + rng.integers(0, max(1, span // num_prompts), num_prompts))
    return [np.asarray(tokens[s:s + prompt_len], np.int64).tolist() for s in np.minimum(starts, span - 1).astype(int)]


def mean_acceptance_length(target: Transformer, spec: SpecConfig, drafter: Any, prompts: list[list[int]],
                           max_new_tokens: int) -> dict:
    """Greedy speculative generation on the prompts; the summary of its acceptance metrics."""
    result = generate(target, prompts, max_new_tokens=max_new_tokens, spec=spec, drafter=drafter)
    return result.metrics.summary()
