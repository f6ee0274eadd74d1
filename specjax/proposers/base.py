"""The proposer protocol and registry.

A proposer is a frozen dataclass subclassing `Proposer`: static settings, with three pure functions
over a state pytree:
  init(params, prompt[B,T], lengths[B], target_out) -> state
  propose(params, state, context, keys[B]) -> (draft_tokens[B,K], draft_probs[B,K,V] | None, state)
  accept(state, num_accepted[B], next_token[B], target_out) -> state
  (under adaptive verification the loop calls accept_verified, whose default is accept)
and, to prefill from an offset (prefix caching, chunked prefill), `new_cache` / `extend` (init is extend
from an empty cache) and `prefix_cache`; where drafting can be skipped (`skips_drafting`), `idle`:
  idle(params, state, context) -> state: propose's effect on the state without drafting, for a step that
  verifies no draft (adaptive verification's width 0), after which accept sees one scored position.
`params` are the drafter's weights (a draft model, EAGLE or Medusa heads; None for n-gram lookup),
as `bind` made them. draft_probs None means a deterministic draft (one-hot to the verifier).

What the loop passes:
- init: prompt[b, :lengths[b]] is row b's prompt followed by the token the target's prefill drew
  (lengths = prompt length + 1); target_out is the prefill over the padded prompt, so
  target_out.hidden.final[b, lengths[b] - 2] is the feature that drew that token.
- propose: context.tokens[b, :context.lengths[b]] are the committed tokens.
- accept: target_out is the verify forward over [last committed token, d_1 .. d_K] (K + 1
  positions); the row kept d_1 .. d_n and next_token, which position n's logits drew. After a tree
  (drafts_trees), the loop passes the forward's positions along the accepted path, [root, path...], so
  that accept reads it as a chain. Which tree the last propose drafted: `tree_parents(state)`.

The class also says everything else about its drafter: how `load` reads its weights from a folder,
which bundled drafter the method uses (`default_drafter`), whether it takes weights at all
(`needs_drafter`); weight names of its own that specjax.sharding should split are declared by the
pytree `bind` returns (a `parameter_rules` class attribute, e.g. eagle.EagleParams). A new drafter
is one file with a `@register("name")` subclass of Proposer, plus its import line in
`specjax/proposers/__init__.py` (docs/research-guide.md works one through).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from specjax import adaptive
from specjax.trees import structure
from specjax.config import DTYPES, ConfigError, ModelConfig, SamplingConfig, SpecConfig, require
from specjax.models.transformer import Hidden
from specjax.verify.sampling import SamplingMode, SamplingParams


class UnsupportedSpeculation(ValueError):
    """The drafter cannot run this SpecConfig at all (e.g. more draft tokens than Medusa has heads),
    as opposed to a mistake in it; a sweep records such points as skipped and goes on."""


@functools.partial(jax.tree_util.register_dataclass, data_fields=("tokens", "lengths", "sampling"),
                   meta_fields=("verified",))
@dataclasses.dataclass(frozen=True)
class Context:
    """Committed tokens of every row: tokens[b, :lengths[b]]; the last one is not in any cache yet.
    sampling: each row's settings (drafters that sample draw with them under settings.sampling's mode).
    verified: how many drafts the step will verify, where adaptive verification chose it before drafting (one of
    spec.verify_widths; static: the branch of the step's switch that drafts); a drafter that drafts_to_width may
    leave the drafts past it as zeros. None: all K."""

    tokens: Int[Array, "B S"]
    lengths: Int[Array, " B"]
    sampling: SamplingParams
    verified: int | None = None

    @classmethod
    def of(cls, tokens: Int[Array, "B S"], lengths: Int[Array, " B"],
           sampling: SamplingConfig = SamplingConfig()) -> Context:
        """A context whose rows all sample with one SamplingConfig (a proposer called on its own)."""
        return cls(tokens=tokens, lengths=lengths, sampling=SamplingParams.uniform(sampling))


@functools.partial(jax.tree_util.register_dataclass, data_fields=("logits", "hidden", "path"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class TargetOutput:
    """The target's last forward (prefill or verify) over T positions, for drafters that read it."""

    logits: Float[Array, "B T V"] | None
    hidden: Hidden
    # After a draft tree: the accepted path's node indices (-1 past its length; [B, K], K the tree's
    # depth), along which logits and hidden were taken ([B, K + 1, ...], as after a chain); a drafter
    # that wrote the tree into a cache of its own moves that path with it (specjax.masks.move_path).
    # None after a chain or the prefill.
    path: Int[Array, "B K"] | None = None


@dataclasses.dataclass(frozen=True)
class ProposerSettings:
    """What every proposer is built from; all static (hashable) so the proposer is a jit static arg."""

    spec: SpecConfig
    # What the rows' sampling settings need of the program (the settings themselves are Context.sampling).
    sampling: SamplingMode
    cache_size: int  # slots of any cache the proposer keeps, as the target's

    @property
    def cache_dtype(self):
        """The drafter's KV cache dtype (spec.kv_cache_dtype), None to inherit its compute dtype."""
        return None if self.spec.kv_cache_dtype is None else DTYPES[self.spec.kv_cache_dtype]


@dataclasses.dataclass(frozen=True)
class Proposer:
    """What every proposer has, with the defaults of a drafter that reads weights from a folder and
    uses them as they are; subclasses are frozen dataclasses too and override what differs."""

    settings: ProposerSettings
    # Target layers whose inputs the proposer reads from TargetOutput.hidden.layers (EAGLE-3).
    hidden_layers: tuple[int, ...] = ()
    # The bundled drafter of the method (`default:NAME`, see specjax.default_models), taken with the
    # bundled target when no drafter folder is given; None where none is bundled.
    default_drafter: ClassVar[str | None] = None
    # What its checkpoint folder holds, in words ("an EAGLE-3 head"): errors that name a folder of another kind.
    checkpoint_kind: ClassVar[str] = "a drafter"
    # False for a method without weights (n-gram lookup): it takes no drafter folder.
    needs_drafter: ClassVar[bool] = True
    # True where propose can draft spec.speculative_token_tree: its K are then the tree's nodes, in the
    # tree's order (docs/design.md's trees; specjax.trees). Others refuse the option when built.
    drafts_trees: ClassVar[bool] = False
    # True where propose can draft a dynamic tree (spec.total_tokens, spec.tree_top_k: EAGLE-2): its K are
    # then total_tokens nodes, parents before children, whose parents `tree_parents` reads from the state.
    drafts_dynamic_trees: ClassVar[bool] = False
    # True where with_draft_vocabulary makes the drafter draft only some target ids (FR-Spec;
    # RunConfig.draft_vocab_size).
    takes_draft_vocabulary: ClassVar[bool] = False
    # True where the drafter's cache entry at position i depends on the token at i + 1 (EAGLE's pairs (f_i,
    # x_{i+1})): a prefix cache's last matched block was written with whatever token followed it then, so the
    # engine recomputes it unless EngineConfig.disable_eagle_block_drop (vLLM's EAGLE last-block drop).
    draft_kv_reads_next_token: ClassVar[bool] = False
    # True where `idle` is defined: adaptive verification then skips drafting at width 0 (a step that verifies no
    # draft costs the target's one-position forward and the idle). Elsewhere width 0 drafts and verifies none.
    skips_drafting: ClassVar[bool] = False
    # True where propose reads Context.verified and computes only the drafts the step verifies (DFlash: its LM head
    # over the first W of the block's K positions): adaptive verification's narrow widths then cost less to draft.
    drafts_to_width: ClassVar[bool] = False
    # The drafter options (SpecConfig fields) this drafter reads, each with the off values another method
    # may hold in it (OPTION_IGNORED: any, as n-gram's lookup sizes, which ride along in sweeps of every
    # method); check_options says what this drafter allows in them (check_spec runs both).
    options: ClassVar[dict[str, Any]] = {}
    # What `shaped` builds at a released model's shapes, in words (a speed table's drafter column); None where
    # the method has no shaped drafter.
    shaped_description: ClassVar[str | None] = None

    @classmethod
    def load(cls, folder: Path, target: Any, dtype: str | None, model_shards: int) -> Any:
        """The drafter's weights from its folder, for `target` (a Transformer): dtype is the compute
        dtype (None: the checkpoint's); modules come in transformer.for_decoding(..., model_shards)."""
        raise NotImplementedError(f"{cls.__name__} defines no load: pass its weights to generate() directly")

    @classmethod
    def recognizes(cls, folder: Path) -> bool:
        """Whether a drafter folder is this method's by its own files (`specjax generate --draft FOLDER`
        without --method takes the method that recognizes it); by default no folder is recognized."""
        return False

    @classmethod
    def shaped(cls, target_config: ModelConfig, draft_config: ModelConfig, model_shards: int = 1) -> Any:
        """Random weights of this drafter at a released model's shapes, for target_config's target (draft_config: a
        draft LM's shapes, where the method drafts with one), made on the device in the decoding layout: what
        speed tables time (specjax.speed; speed does not depend on the values)."""
        raise NotImplementedError(f"{cls.__name__} builds no shaped drafter (shaped_description is None)")

    @classmethod
    def describe(cls, spec: SpecConfig, drafter: Any) -> dict:
        """Columns of a results row that say what this drafter drafted under spec (a sweep's), beyond the spec."""
        return {}

    @classmethod
    def with_draft_vocabulary(cls, drafter: Any, ids) -> Any:
        """The drafter drafting only the target ids `ids` (FR-Spec), where takes_draft_vocabulary."""
        raise NotImplementedError(f"{cls.__name__} takes no draft vocabulary")

    @classmethod
    def check_options(cls, spec: SpecConfig) -> None:
        """Raises ConfigError naming the field, the value and what is allowed where spec holds a value of one of
        `options` this drafter cannot run (before anything is loaded); the options' docs live here too."""

    def check(self, params: Any, target_config: ModelConfig) -> None:
        """Raises ValueError (host side, before tracing) if params cannot draft for this target."""
        raise NotImplementedError

    def bind(self, params: Any, target: Any) -> Any:
        """The params the loop passes to init / propose, built on the host from the drafter's own
        weights and the target model (EAGLE and Medusa read the target's embedding or LM head).
        By default the params unchanged."""
        return params

    def init(self, params: Any, prompt: Int[Array, "B T"], lengths: Int[Array, " B"],
             target_out: TargetOutput) -> Any:
        """The state after the target's prefill of the whole prompt: extend from an empty cache."""
        batch = prompt.shape[0]
        return self.extend(params, self.new_cache(params, batch), prompt, lengths, jnp.zeros_like(lengths), target_out)

    def new_cache(self, params: Any, batch: int) -> Any:
        """The drafter's empty per-position cache for `batch` rows (a KVCache whose slot j holds position j,
        what a prefix cache stores and a chunked prefill carries), or None where it keeps none."""
        return None

    def extend(self, params: Any, cache: Any, prompt: Int[Array, "B T"], lengths: Int[Array, " B"],
               start: Int[Array, " B"], target_out: TargetOutput) -> Any:
        """The state after a prefill that continued from position start[b]: `cache` (new_cache's) holds row
        b's positions before start[b] (a prefix cache's blocks, earlier chunks); prompt and lengths are
        init's; target_out is the target's forward over the window of positions start[b] + i. When the
        window reaches the prompt's end the state is the one init builds over the whole prompt."""
        raise NotImplementedError(f"{type(self).__name__} defines no extend: prefix caching, chunked prefill and "
                                  "mixed prefill need it (EngineConfig.enable_prefix_caching, max_num_batched_tokens, "
                                  "mixed_prefill_tokens)")

    @classmethod
    def defines_extend(cls) -> bool:
        """Whether this drafter's state can be built from a prefill that continued (extend is overridden)."""
        return cls.extend is not Proposer.extend

    def prefix_cache(self, state: Any) -> Any:
        """The state's per-position cache (new_cache's kind), None where it keeps none."""
        return None

    def propose(self, params: Any, state: Any, context: Context,
                keys: PRNGKeyArray) -> tuple[Int[Array, "B K"], Float[Array, "B K V"] | None, Any]:
        raise NotImplementedError

    def accept(self, state: Any, num_accepted: Int[Array, " B"], next_token: Int[Array, " B"],
               target_out: TargetOutput) -> Any:
        raise NotImplementedError

    def accept_verified(self, params: Any, state: Any, num_accepted: Int[Array, " B"], next_token: Int[Array, " B"],
                        target_out: TargetOutput, context: Context) -> Any:
        """accept under adaptive verification, called inside the switch's branch of width W, where target_out
        covers the W + 1 scored positions only (W static there) and `context` is the step's (before it commits).
        Default: accept, with the hidden states padded to K + 1 positions as after a step of every draft. A drafter
        whose work on the committed positions scales with how many there are does it here, at W + 1 (DFlash's,
        EAGLE's)."""
        hidden = adaptive.padded(target_out.hidden, self.settings.spec.num_speculative_tokens + 1)
        return self.accept(state, num_accepted, next_token, dataclasses.replace(target_out, hidden=hidden))

    def idle(self, params: Any, state: Any, context: Context) -> Any:
        """The state a propose leaves, less its drafts, for a step that drafts nothing (skips_drafting): the next
        accept and propose then find it as after a step whose every draft was rejected."""
        raise NotImplementedError(f"{type(self).__name__} cannot skip drafting (skips_drafting is False)")

    def draft_confidence(self, state: Any) -> Float[Array, "B K"] | None:
        """The drafter's own estimate, per draft of the last propose, that it is accepted given the one before
        it was (a confidence head, read by adaptive verification: specjax.adaptive); None where it has none."""
        return None

    def tree_log_probs(self, state: Any) -> Float[Array, "B N"] | None:
        """A drafter of dynamic trees: the path log-probabilities of the last tree's nodes, highest first
        (structure.grow), from which specjax.trees.sizing estimates acceptance; None otherwise."""
        return None

    def tree_parents(self, state: Any, batch: int) -> Int[Array, "B N"] | None:
        """The parent of each node the last propose drafted (specjax.trees), None for a chain: a
        static tree's from the config; a drafter of dynamic trees returns those it kept in its state."""
        tree = self.settings.spec.speculative_token_tree
        if tree is None:
            return None
        return jnp.broadcast_to(jnp.asarray(structure.token_tree_parents(tree), jnp.int32), (batch, len(tree)))


@dataclasses.dataclass(frozen=True)
class WeightlessProposer(Proposer):
    """A drafter without weights (n-gram lookup): params is None throughout."""

    needs_drafter: ClassVar[bool] = False

    @classmethod
    def load(cls, folder: Path, target: Any, dtype: str | None, model_shards: int) -> None:
        return None

    def check(self, params: Any, target_config: ModelConfig) -> None:
        if params is not None:
            raise ValueError(f"method {self.settings.spec.method!r} is weightless and takes no drafter weights: "
                             f"allowed drafter=None, got {type(params).__name__}")


def require_target_sizes(drafter: str, target_config: ModelConfig, **sizes: int) -> None:
    """Raises ValueError naming the first of `sizes` (field=value) that differs from the target's, for
    drafters that read the target's hidden states or share its vocabulary."""
    for field, value in sizes.items():
        expected = getattr(target_config, field)
        if value != expected:
            kind = "vocabularies" if field == "vocab_size" else "sizes"
            raise ValueError(f"{drafter} {field} {value} differs from the target's {expected}: allowed only equal {kind}")


PROPOSERS: dict[str, type[Proposer]] = {}


def register(name: str):
    """Class decorator: the proposer of method `name`."""
    def add(cls):
        if not (isinstance(cls, type) and issubclass(cls, Proposer)):
            raise TypeError(f"register({name!r}) needs a subclass of specjax.proposers.Proposer, got {cls!r}")
        PROPOSERS[name] = cls
        return cls

    return add


def proposer_class(method: str) -> type[Proposer]:
    """The class registered as method (SpecConfig.method); an unknown name is a ConfigError."""
    require(method in PROPOSERS, "SpecConfig", "method", method, f"one of {sorted(PROPOSERS)}")
    return PROPOSERS[method]


# The draft vocabulary of shaped drafters that have one (Proposer.shaped): the released Llama-3.1-8B EAGLE-3 head's.
SHAPED_DRAFT_VOCAB = 32000
# The off value of an option other methods ignore whatever it holds (Proposer.options).
OPTION_IGNORED = object()


def check_spec(spec: SpecConfig) -> type[Proposer]:
    """The class of spec.method, once the drafter options are checked: the method's own by its check_options,
    every other method's option at its off value (what SpecConfig leaves to the registry; a ConfigError
    naming the field, the value and what is allowed)."""
    cls = proposer_class(spec.method)
    for name, other in sorted(PROPOSERS.items()):
        for field, off in other.options.items():
            value = getattr(spec, field)
            if field in cls.options or off is OPTION_IGNORED or any(value is v for v in off):
                continue
            owners = " or ".join(repr(n) for n, c in sorted(PROPOSERS.items()) if field in c.options)
            allowed = " or ".join({None: "null", False: "false"}.get(v, repr(v)) for v in off)
            raise ConfigError(f"SpecConfig.{field} = {value!r} with method {spec.method!r} is invalid: allowed {allowed} "
                              f"(it is an option of method {owners})")
    cls.check_options(spec)
    return cls


def build_proposer(spec: SpecConfig, sampling: SamplingConfig | SamplingMode, cache_size: int,
                   drafter: Any = None) -> Proposer:
    """The proposer of spec.method, for rows whose sampling settings the mode covers (a SamplingConfig:
    its own mode). A proposer class whose static settings depend on its weights (EAGLE-3 reads the
    target layers its head fuses) defines `build(settings, drafter)`."""
    cls = check_spec(spec)
    if spec.speculative_token_tree is not None and not cls.drafts_trees:
        raise UnsupportedSpeculation(f"method {spec.method!r} drafts chains only: speculative_token_tree is allowed "
                                     f"with {sorted(name for name, c in PROPOSERS.items() if c.drafts_trees)}")
    if spec.total_tokens is not None and not cls.drafts_dynamic_trees:
        raise UnsupportedSpeculation(
            f"method {spec.method!r} drafts no dynamic trees: total_tokens / tree_top_k are allowed with "
            f"{sorted(name for name, c in PROPOSERS.items() if c.drafts_dynamic_trees)}")
    if spec.total_tokens == "auto":
        raise UnsupportedSpeculation("total_tokens 'auto' is a choice generate makes before the loop: pass the spec "
                                     "to specjax.decoding.generate, or a size chosen by trees.sizing.choose_tree_size")
    if isinstance(sampling, SamplingConfig):
        sampling = SamplingMode.of([sampling])
    settings = ProposerSettings(spec=spec, sampling=sampling, cache_size=cache_size)
    build = getattr(cls, "build", None)
    return build(settings, drafter) if build is not None else cls(settings)
