"""The proposer protocol and registry.

A proposer is a frozen dataclass of static settings with three pure functions over a state pytree:
  init(params, prompt[B,T], lengths[B], target_out) -> state
  propose(params, state, context, keys[B]) -> (draft_tokens[B,K], draft_probs[B,K,V] | None, state)
  accept(state, num_accepted[B], next_token[B], target_out) -> state
`params` are the drafter's weights (a draft model, EAGLE or Medusa heads; None for n-gram lookup).
draft_probs None means a deterministic draft (one-hot to the verifier).

What the loop passes:
- init: prompt[b, :lengths[b]] is row b's prompt followed by the token the target's prefill drew
  (lengths = prompt length + 1); target_out is the prefill over the padded prompt, so
  target_out.hidden.final[b, lengths[b] - 2] is the feature that drew that token.
- propose: context.tokens[b, :context.lengths[b]] are the committed tokens.
- accept: target_out is the verify forward over [last committed token, d_1 .. d_K] (K + 1
  positions); the row kept d_1 .. d_n and next_token, which position n's logits drew. A new drafter is one file
with a `@register("name")` class, plus its import in `specjax/proposers/__init__.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Protocol

import jax
from jaxtyping import Array, Float, Int, PRNGKeyArray

from specjax.config import DTYPES, ModelConfig, SamplingConfig, SpecConfig, require
from specjax.models.transformer import Hidden


class UnsupportedSpeculation(ValueError):
    """The drafter cannot run this SpecConfig at all (e.g. more draft tokens than Medusa has heads),
    as opposed to a mistake in it; a sweep records such points as skipped and goes on."""


@functools.partial(jax.tree_util.register_dataclass, data_fields=("tokens", "lengths"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class Context:
    """Committed tokens of every row: tokens[b, :lengths[b]]; the last one is not in any cache yet."""

    tokens: Int[Array, "B S"]
    lengths: Int[Array, " B"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=("logits", "hidden"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class TargetOutput:
    """The target's last forward (prefill or verify) over T positions, for drafters that read it."""

    logits: Float[Array, "B T V"] | None
    hidden: Hidden


@dataclasses.dataclass(frozen=True)
class ProposerSettings:
    """What every proposer is built from; all static (hashable) so the proposer is a jit static arg."""

    spec: SpecConfig
    sampling: SamplingConfig
    cache_size: int  # slots of any cache the proposer keeps, as the target's

    @property
    def cache_dtype(self):
        """The drafter's KV cache dtype (spec.kv_cache_dtype), None to inherit its compute dtype."""
        return None if self.spec.kv_cache_dtype is None else DTYPES[self.spec.kv_cache_dtype]


class Proposer(Protocol):
    settings: ProposerSettings
    # Target layers whose inputs the proposer reads from TargetOutput.hidden.layers (EAGLE-3).
    hidden_layers: tuple[int, ...]

    def check(self, params: Any, target_config: ModelConfig) -> None:
        """Raises ValueError (host side, before tracing) if params cannot draft for this target."""

    def bind(self, params: Any, target: Any) -> Any:
        """The params the loop passes to init / propose, built on the host from the drafter's own
        weights and the target model (EAGLE and Medusa read the target's embedding or LM head).
        Proposers that need nothing from the target return params unchanged."""

    def init(self, params, prompt: Int[Array, "B T"], lengths: Int[Array, " B"], target_out: TargetOutput): ...

    def propose(self, params, state, context: Context, keys: PRNGKeyArray): ...

    def accept(self, state, num_accepted: Int[Array, " B"], next_token: Int[Array, " B"],
               target_out: TargetOutput): ...


PROPOSERS: dict[str, Callable[[ProposerSettings], Proposer]] = {}


def register(name: str):
    def add(cls):
        PROPOSERS[name] = cls
        return cls

    return add


def proposer_class(method: str):
    """The class registered as method (SpecConfig.method); an unknown name is a ConfigError."""
    require(method in PROPOSERS, "SpecConfig", "method", method, f"one of {sorted(PROPOSERS)}")
    return PROPOSERS[method]


def build_proposer(spec: SpecConfig, sampling: SamplingConfig, cache_size: int, drafter: Any = None) -> Proposer:
    """The proposer of spec.method. A proposer class whose static settings depend on its weights
    (EAGLE-3 reads the target layers its head fuses) defines `build(settings, drafter)`."""
    cls = proposer_class(spec.method)
    settings = ProposerSettings(spec=spec, sampling=sampling, cache_size=cache_size)
    build = getattr(cls, "build", None)
    return build(settings, drafter) if build is not None else cls(settings)
