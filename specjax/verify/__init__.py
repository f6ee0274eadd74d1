"""Verifiers: one signature, one registry line each.

`verify(target_probs[B,K+1,V], draft_tokens[B,K], draft_probs[B,K,V] | None, keys[B])
-> (num_accepted[B] in 0..K, next_token[B])`: the row emits draft_tokens[:n] + [next_token].

The Pallas block verifier (specjax.pallas_kernels.block_verify) builds on this package's jnp modules
(block, common); this module is the one place that chooses between them.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

from specjax.config import SamplingConfig, SpecConfig, require
from specjax.sharding import vocabulary_argmax
from specjax.verify import block, greedy, standard, synthetic, tree
from specjax.verify.common import from_draws

VERIFIERS: dict[str, Callable] = {
    "greedy": greedy.verify,
    "standard": standard.verify,
    "block": block.verify,
}
# What SpecConfig.rejection_sample_method accepts: the lossless verifiers chosen by name, and the
# benchmark mode (greedy is chosen by temperature 0, not by name).
REJECTION_SAMPLE_METHODS = (*(name for name in VERIFIERS if name != "greedy"), "synthetic")


def verifier_name(spec: SpecConfig, sampling: SamplingConfig) -> str:
    """Greedy rows skip the random path whichever lossless method is chosen, as in vLLM. An unknown
    rejection_sample_method is a ConfigError, at temperature 0 too."""
    require(spec.rejection_sample_method in REJECTION_SAMPLE_METHODS, "SpecConfig", "rejection_sample_method",
            spec.rejection_sample_method, f"one of {REJECTION_SAMPLE_METHODS}")
    if spec.rejection_sample_method == "synthetic":
        return "synthetic"
    return "greedy" if sampling.is_greedy else spec.rejection_sample_method


# Backends where verify_impl 'auto' takes the Pallas kernel. None: on the H200 XLA's fusion of the jnp
# block verifier is at least as fast, and TPU is unmeasured (figures in docs/performance.md).
AUTO_PALLAS_BACKENDS: tuple[str, ...] = ()


def uses_pallas(spec: SpecConfig) -> bool:
    """Whether verify_impl asks for the Pallas kernel on the default backend."""
    if spec.verify_impl == "auto":
        return jax.default_backend() in AUTO_PALLAS_BACKENDS
    return spec.verify_impl == "pallas"


def verifier_for(spec: SpecConfig, sampling: SamplingConfig) -> Callable:
    """The verifier of spec and sampling. The Pallas kernel where asked for and compilable here; where it
    is not (see block_verify.kernel_available), the jnp block verifier, which gives the same tokens."""
    name = verifier_name(spec, sampling)
    if name == "synthetic":
        return from_draws(functools.partial(synthetic.verify_with_draws, rates=spec.synthetic_rates))
    if name == "block" and uses_pallas(spec):
        # Imported here: the kernel module imports this package's jnp modules, so an import above would
        # hand it this package half-initialised.
        from specjax.pallas_kernels import block_verify

        if block_verify.kernel_available(jax.default_backend()):
            return block_verify.verify
    return VERIFIERS[name]


def tree_verifier_for(spec: SpecConfig, sampling: SamplingConfig) -> Callable:
    """The verifier of draft trees (specjax.verify.tree), with the signature
    `verify(scores[B,N+1,V], tokens[B,N], parents[B,N], draft_probs | None, keys[B]) -> (path, length, next_token)`;
    scores are logits where the greedy verifier runs, processed probabilities otherwise."""
    name = verifier_name(spec, sampling)
    if name == "greedy":
        return lambda logits, tokens, parents, draft_probs, keys: tree.verify_tree_greedy(
            vocabulary_argmax(logits), tokens, parents)
    if name == "synthetic":
        return functools.partial(tree.verify_tree_synthetic, rates=spec.synthetic_rates)
    return tree.verify_tree_traversal if name == "block" else tree.verify_tree
