"""The requests the greedy-equality tests decode (ragged prompts and budgets, some rows ending at an
EOS inside a block) and the target's autoregressive output for them."""

import functools

import numpy as np

from specjax.decoding import generate

from support.models import EOS, target_and_drafts


@functools.cache
def ragged_requests():
    """56 ragged prompts of 1-20 tokens and budgets of 1-24 tokens (some rows stop at EOS)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, rng.integers(1, 21)).tolist() for _ in range(56)]
    budgets = rng.integers(1, 25, len(prompts)).tolist()
    return prompts, budgets


@functools.cache
def repeating_requests():
    """20 ragged requests, every other prompt a repeated block: n-gram lookup finds drafts in them."""
    rng = np.random.default_rng(0)
    prompts = []
    for row in range(20):
        if row % 2:  # repeats, so that many drafts come from the prompt
            block = rng.integers(0, 128, rng.integers(2, 7)).tolist()
            prompts.append((block * 8)[:rng.integers(len(block) + 1, 21)])
        else:
            prompts.append(rng.integers(0, 128, rng.integers(1, 21)).tolist())
    return prompts, rng.integers(1, 33, len(prompts)).tolist()


REQUESTS = {"ragged": ragged_requests, "ragged16": lambda: tuple(x[:16] for x in ragged_requests()),
            "repeating": repeating_requests}


@functools.cache
def autoregressive_outputs(requests: str = "ragged"):
    """The target's greedy autoregressive output for REQUESTS[requests], stopping at EOS."""
    prompts, budgets = REQUESTS[requests]()
    return generate(target_and_drafts()[0], prompts, max_new_tokens=budgets, eos_token_ids=[EOS])

