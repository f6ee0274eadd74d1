"""Prefill from an offset, prefix caching and chunked prefill (docs/serving.md "Prefix caching").

The building block: a proposer's state built from a cached prefix plus the rest equals the state built over
the whole prompt (caches equal over the filled slots, same first token, same drafts). On it, the engine's
prefix cache and chunked prefill: greedy outputs identical with them on and off and to autoregressive
decoding, hit counts exact on a constructed workload, eviction and reference counts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import EOS, dflash_config, head_for, medusa_for, target_and_drafts

from specjax import decoding
from specjax.config import SpecConfig
from specjax.decoding import Prefix, generate, loop_arrays, pad_request
from specjax.engine import Engine, EngineConfig, Request
from specjax.models.dflash import init_dflash
from specjax.proposers import Context, build_proposer
from specjax.verify.sampling import GREEDY

SPECS = {
    "draft_model": SpecConfig(method="draft_model", num_speculative_tokens=3),
    "eagle": SpecConfig(method="eagle", num_speculative_tokens=3),
    "eagle3": SpecConfig(method="eagle3", num_speculative_tokens=3),
    "dflash": SpecConfig(method="dflash", num_speculative_tokens=3),
    "medusa": SpecConfig(method="medusa", num_speculative_tokens=3),
    "ngram": SpecConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3),
}


@functools.cache
def drafter_for(name: str):
    target, drafts = target_and_drafts()
    if name == "draft_model":
        return drafts["perturbed"]
    if name == "medusa":
        return medusa_for(target, num_heads=3, scale=0.05)
    if name == "dflash":
        return init_dflash(dflash_config(target.config, (0, 1), 8))
    if name == "ngram":
        return None
    return head_for(name)


def filled(cache, stop: int):
    """A KVCache's keys and values over slots [0, stop) of every row, as arrays per layer."""
    def part(x):
        return np.asarray(x[:, :, :stop] if x.ndim == 5 else x[:, :stop])
    k = cache.k if isinstance(cache.k, tuple) else (cache.k,)
    v = cache.v if isinstance(cache.v, tuple) else (cache.v,)
    return [part(x) for x in k + v]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_state_built_from_a_prefix_plus_the_rest_equals_the_state_built_in_one_go(name):
    """Rows of ragged prompts split at ragged starts (0 included: a prefill from an empty cache)."""
    target, drafter, spec = target_and_drafts()[0], drafter_for(name), SPECS[name]
    prompts = [list(range(3, 3 + n)) for n in (13, 9, 20, 5)]
    prompts = [[(7 * t + 3 * row) % 100 + 10 for t in p] for row, p in enumerate(prompts)]
    starts = np.array([8, 0, 16, 3], np.int32)
    request = pad_request(target, prompts, 6, lookahead=spec.num_draft_nodes + 1)
    (tokens, lengths, budgets, keys, sampling), mode = loop_arrays(request)
    proposer = build_proposer(spec, mode, request.cache_size, drafter)
    params = proposer.bind(drafter, target)
    batch = tokens.shape[0]
    starts = jnp.asarray(np.concatenate([starts, np.zeros(batch - len(starts), np.int32)]))

    @functools.partial(jax.jit, static_argnames="width")
    def init(prefix_target, prefix_draft, start, width):
        prefix = None if prefix_target is None else Prefix(target=prefix_target, draft=prefix_draft, start=start,
                                                           width=width)
        return decoding.speculative_init(target, params, tokens, lengths, budgets, keys, sampling,
                                         proposer=proposer, eos_token_ids=(), prefix=prefix)

    whole = init(None, None, None, 0)
    empty = target.create_cache(batch, request.cache_size)
    first = init(empty, proposer.new_cache(params, batch), jnp.zeros_like(starts), int(starts.max()))
    rest = init(first.decode.cache, proposer.prefix_cache(first.proposer), starts, tokens.shape[1])
    np.testing.assert_array_equal(rest.decode.tokens, whole.decode.tokens)  # the same first token
    np.testing.assert_array_equal(rest.decode.lengths, whole.decode.lengths)
    prompt_lens = lengths
    for row in range(len(prompts)):
        n = int(prompt_lens[row])
        for a, b in zip(filled(rest.decode.cache, 64), filled(whole.decode.cache, 64)):
            np.testing.assert_allclose(a[..., row, :n, :, :] if a.ndim == 5 else a[row, :n],
                                       b[..., row, :n, :, :] if b.ndim == 5 else b[row, :n], rtol=1e-5, atol=1e-5)
        if proposer.prefix_cache(whole.proposer) is not None:
            fill = n - 1  # every drafter's cache holds at least the prompt's positions but the last
            for a, b in zip(filled(proposer.prefix_cache(rest.proposer), fill),
                            filled(proposer.prefix_cache(whole.proposer), fill)):
                np.testing.assert_allclose(a[..., row, :, :, :] if a.ndim == 5 else a[row],
                                           b[..., row, :, :, :] if b.ndim == 5 else b[row], rtol=1e-5, atol=1e-5)
    context = Context(tokens=whole.decode.tokens, lengths=whole.decode.lengths, sampling=sampling)
    step_keys = jax.random.split(jax.random.key(1), batch)
    propose = jax.jit(lambda state: proposer.propose(params, state, context, step_keys)[0])
    np.testing.assert_array_equal(propose(rest.proposer)[:len(prompts)], propose(whole.proposer)[:len(prompts)])
