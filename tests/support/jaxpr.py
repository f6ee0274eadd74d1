"""Walks over jaxprs (every equation, nested ones included) and the arguments of
`decoding.speculative_loop` as `generate` builds them, for tests that inspect the lowered loop."""

import jax.numpy as jnp

from specjax.config import SamplingConfig, SpecConfig
from specjax.decoding import loop_arrays, pad_request, static_spec
from specjax.proposers import build_proposer
from specjax.verify import lossless_verifiers, method_index


def equations(jaxpr, depth=0):
    """(equation, nesting depth) for every equation, descending into sub-jaxprs."""
    for eqn in jaxpr.eqns:
        yield eqn, depth
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from equations(inner, depth + 1)


def primitives(jaxpr) -> list[tuple[str, int]]:
    """(primitive name, nesting depth) for every equation, descending into sub-jaxprs."""
    return [(eqn.primitive.name, depth) for eqn, depth in equations(jaxpr)]


def speculative_loop_args(target, drafter, prompts, max_new_tokens, spec: SpecConfig, sampling: SamplingConfig,
                          eos_token_ids=()):
    """(args, static keyword arguments) of `decoding.speculative_loop` for a request, as generate builds
    them (the proposer built for the drafter, its weights bound to the target)."""
    request = pad_request(target, prompts, max_new_tokens, lookahead=spec.num_draft_nodes + 1)
    arrays, mode = loop_arrays(request, sampling)
    proposer = build_proposer(static_spec(spec, mode), mode, request.cache_size, drafter)
    args = (target, proposer.bind(drafter, target), *arrays, jnp.int32(method_index(spec)))
    return args, dict(proposer=proposer, verifiers=lossless_verifiers(spec), eos_token_ids=tuple(eos_token_ids))

