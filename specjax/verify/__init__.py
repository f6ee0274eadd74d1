"""Verifiers: one registry of the lossless rejection rules, each with its chain and its tree form.

Chain: `verify(target_probs[B,K+1,V], draft_tokens[B,K], draft_probs[B,K,V] | None, keys[B])
-> (num_accepted[B] in 0..K, next_token[B])`: the row emits draft_tokens[:n] + [next_token].
Tree: `verify(target_probs[B,N+1,V], tokens[B,N], parents[B,N], draft_probs | None, keys[B])
-> (path[B,N], length[B], next_token[B])` (specjax.verify.tree).

Which rule a batch uses is data: `verify_drafts` takes its index in the registry as a traced scalar and
switches inside the program, so standard and block verification share one compiled loop. Greedy rows
(temperature 0) take the greedy rule whatever is chosen, as in vLLM: it reads only an argmax of the
logits. The benchmark mode 'synthetic' (not lossless) is static: it changes what the loop computes.

The Pallas block verifier (specjax.pallas_kernels.block_verify) builds on this package's jnp modules
(block, common); this module is the one place that chooses between them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from specjax.config import SamplingConfig, SpecConfig, require
from specjax.sharding import vocabulary_argmax
from specjax.verify import block, greedy, standard, synthetic, tree
from specjax.verify.common import from_draws
from specjax.verify.sampling import SamplingMode, SamplingParams, processed_probs


@dataclasses.dataclass(frozen=True)
class Verifier:
    """A lossless rejection rule over chains and over trees."""

    chain: Callable
    tree: Callable


VERIFIERS: dict[str, Verifier] = {
    "standard": Verifier(chain=standard.verify, tree=tree.verify_tree),  # tree: recursive rejection sampling
    "block": Verifier(chain=block.verify, tree=tree.verify_tree_traversal),  # tree: traversal verification
}
SYNTHETIC = "synthetic"


def rejection_sample_methods() -> tuple[str, ...]:
    """What SpecConfig.rejection_sample_method accepts: the registry's rules and the benchmark mode."""
    return (*VERIFIERS, SYNTHETIC)


def check_method(spec: SpecConfig) -> None:
    """An unknown rejection_sample_method is a ConfigError (config.py imports no registry)."""
    require(spec.rejection_sample_method in rejection_sample_methods(), "SpecConfig", "rejection_sample_method",
            spec.rejection_sample_method, f"one of {rejection_sample_methods()}")


def verifier_name(spec: SpecConfig, sampling: SamplingConfig) -> str:
    """The rule rows of these settings are verified by: 'greedy' at temperature 0 (except 'synthetic')."""
    check_method(spec)
    if spec.rejection_sample_method == SYNTHETIC:
        return SYNTHETIC
    return "greedy" if sampling.is_greedy else spec.rejection_sample_method


def method_index(spec: SpecConfig) -> int:
    """spec's rule as the index verify_drafts switches on (0 for 'synthetic', which does not switch)."""
    check_method(spec)
    return 0 if spec.rejection_sample_method == SYNTHETIC else list(VERIFIERS).index(spec.rejection_sample_method)


# Backends where verify_impl 'auto' takes the Pallas kernel. None: on the GPU measured XLA's fusion of the jnp
# block verifier is at least as fast, and TPU is unmeasured (figures in docs/performance.md).
AUTO_PALLAS_BACKENDS: tuple[str, ...] = ()


def uses_pallas(spec: SpecConfig) -> bool:
    """Whether verify_impl asks for the Pallas kernel on the default backend."""
    if spec.verify_impl == "auto":
        return jax.default_backend() in AUTO_PALLAS_BACKENDS
    return spec.verify_impl == "pallas"


def block_chain_verifier(spec: SpecConfig) -> Callable:
    """The chain block verifier: the Pallas kernel where asked for and compilable here; where it is not
    (see block_verify.kernel_available), the jnp block verifier, which gives the same tokens."""
    if uses_pallas(spec):
        # Imported here: the kernel module imports this package's jnp modules, so an import above would
        # hand it this package half-initialised.
        from specjax.pallas_kernels import block_verify

        if block_verify.kernel_available(jax.default_backend()):
            return block_verify.verify
    return VERIFIERS["block"].chain


def lossless_verifiers(spec: SpecConfig) -> tuple[Verifier, ...]:
    """The registry's rules in order (what verify_drafts switches among), with spec's block implementation:
    a static argument of the loop, so a program is compiled for the rules it can run."""
    return tuple(dataclasses.replace(rule, chain=block_chain_verifier(spec)) if name == "block" else rule
                 for name, rule in VERIFIERS.items())


def verify_drafts(logits: Float[Array, "B T V"], draft_tokens: Int[Array, "B N"], draft_probs, keys: PRNGKeyArray,
                  parents: Int[Array, "B N"] | None, *, sampling: SamplingParams, mode: SamplingMode,
                  verifiers: tuple[Verifier, ...], method: Int[Array, ""], synthetic_rates=None,
                  num_valid: Int[Array, " B"] | None = None):
    """Verifies a chain (parents None) or a tree of drafts against the target's logits over
    [last committed token, drafts]: (path [B, N] or None, num_accepted [B], next_token [B]).

    Greedy rows take the greedy rule; sampled rows the rule verifiers[method] (switched at run time) on
    the processed distributions; synthetic_rates (the benchmark mode) replace both. num_valid (chains
    only): row b verifies its first num_valid[b] drafts as its whole draft (specjax.verify.common); the
    scores past them are never read."""
    if num_valid is not None and parents is not None:
        raise ValueError("num_valid cuts chains only: a tree's verification takes its whole tree")
    cut = {} if num_valid is None else {"num_valid": num_valid}

    def greedy_rule():
        if parents is None:
            return None, *greedy.verify(logits, draft_tokens, **cut)
        return tree.verify_tree_greedy(vocabulary_argmax(logits), draft_tokens, parents)

    if synthetic_rates is not None:  # every row greedy: the argmaxes, as the greedy rule reads (synthetic's docstring)
        target = processed_probs(logits, sampling, mode) if mode.sampled else vocabulary_argmax(logits)
        if parents is None:
            verify = from_draws(functools.partial(synthetic.verify_with_draws, rates=synthetic_rates))
            return None, *verify(target, draft_tokens, draft_probs, keys, **cut)
        return tree.verify_tree_synthetic(target, draft_tokens, parents, draft_probs, keys, rates=synthetic_rates)
    if not mode.sampled:
        return greedy_rule()
    probs = processed_probs(logits, sampling, mode)
    if parents is None:
        branches = [lambda rule=rule: (jnp.zeros_like(draft_tokens), *rule.chain(probs, draft_tokens, draft_probs,
                                                                                  keys, **cut)) for rule in verifiers]
    else:
        branches = [lambda rule=rule: rule.tree(probs, draft_tokens, parents, draft_probs, keys) for rule in verifiers]
    sampled = jax.lax.switch(method, branches) if len(branches) > 1 else branches[0]()
    greedy_path, greedy_n, greedy_next = greedy_rule()
    is_greedy = jnp.broadcast_to(sampling.is_greedy, greedy_n.shape)
    num_accepted = jnp.where(is_greedy, greedy_n, sampled[1])
    next_token = jnp.where(is_greedy, greedy_next, sampled[2])
    path = None if parents is None else jnp.where(is_greedy[:, None], greedy_path, sampled[0])
    return path, num_accepted, next_token
