"""Speculative decoding (SpecConfig, vLLM's names) and how tokens are drawn (SamplingConfig)."""

from __future__ import annotations

import dataclasses

from specjax.config._checks import ConfigError, dtype_from_name, require, require_positive_ints


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How a token is drawn from logits: temperature, then top-k, then top-p (vLLM's order).

    temperature 0 is greedy decoding (argmax; top-k and top-p are then irrelevant). top_k 0 and
    top_p 1.0 switch those filters off.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        require(self.temperature >= 0.0, "SamplingConfig", "temperature", self.temperature,
                "a float >= 0 (0 means greedy)")
        require(isinstance(self.top_k, int) and self.top_k >= 0, "SamplingConfig", "top_k", self.top_k,
                "an integer >= 0 (0 disables top-k)")
        require(0.0 < self.top_p <= 1.0, "SamplingConfig", "top_p", self.top_p,
                "a float in (0, 1] (1 disables top-p)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
VERIFY_IMPLS = ("auto", "pallas", "xla")
# The dynamic tree sizes `SpecConfig.total_tokens: auto` chooses from (specjax.trees.sizing).
AUTO_TREE_SIZES = (8, 16, 24, 32, 48, 64)
# Trees are verified by recursive rejection sampling ('standard'), traversal verification ('block': block
# verification generalised to trees), or in the benchmark mode (specjax.verify.tree).
TREE_REJECTION_SAMPLE_METHODS = ("standard", "block", "synthetic")


def check_token_tree(tree, depth: int) -> tuple[tuple[int, ...], ...]:
    """speculative_token_tree as tuples, or a ConfigError naming what is wrong with it."""
    def invalid(allowed: str):
        raise ConfigError(f"SpecConfig.speculative_token_tree = {tree!r} is invalid: allowed {allowed}")

    if not isinstance(tree, (list, tuple)) or not tree:
        invalid("a non-empty list of paths of top-k ranks, e.g. [[0], [1], [0, 0]]")
    paths = []
    for path in tree:
        if (not isinstance(path, (list, tuple)) or not path
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path)):
            invalid(f"paths of integers >= 0, got {path!r}")
        path = tuple(path)
        if path in paths:
            invalid(f"each path once, got {path!r} twice")
        if len(path) > 1 and path[:-1] not in paths:
            invalid(f"every path after its parent, got {path!r} before {path[:-1]!r}")
        paths.append(path)
    if max(map(len, paths)) != depth:
        invalid(f"a deepest path of num_speculative_tokens = {depth} ranks, got {max(map(len, paths))}")
    return tuple(paths)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding, with vLLM's `SpeculativeConfig` names and meanings.

    method: the drafter, a name in `specjax.proposers.PROPOSERS` (checked when the proposer is built:
      this module imports no registry, so a config alone loads no model code).
    num_speculative_tokens: K, tokens drafted per step.
    rejection_sample_method: 'standard' (Leviathan et al.), 'block' (Sun et al.'s joint prefix
      ratio) or 'synthetic' (benchmark mode, not lossless): a name in
      `specjax.verify.REJECTION_SAMPLE_METHODS`, checked when the verifier is chosen. At temperature 0
      the greedy verifier runs whatever is chosen here, except 'synthetic'.
    synthetic_acceptance_rates: unconditional acceptance rate of each draft position (K values,
      non-increasing, in [0, 1]).
    synthetic_acceptance_length: or a mean acceptance length L in [1, K + 1], turned into rates as vLLM
      does. Exactly one of them with 'synthetic', neither otherwise.
    draft_sample_method: 'greedy' drafts the argmax (the draft is one-hot to the verifier);
      'probabilistic' samples the processed draft distribution and verifies against it.
    kv_cache_dtype: the drafter's KV cache dtype ('bfloat16', 'float8_e4m3fn', ...); None inherits
      the drafter's compute dtype.
    verify_impl: 'pallas' runs block verification of probabilistic drafts as the one-sweep Pallas
      kernel (interpreted on the CPU; where it cannot compile, e.g. a JAX without Pallas's GPU
      lowering, the jnp reference runs instead, with a warning), 'xla' the jnp reference; 'auto'
      takes whichever is faster on the backend (specjax.verify.AUTO_PALLAS_BACKENDS; today jnp
      everywhere). Both give the same tokens from the same draws.
    speculative_token_tree: a static draft tree as vLLM's former option wrote it, one tuple of top-k
      ranks per node, e.g. ((0,), (1,), (0, 0), (0, 1)): node (0, 1) is the second-ranked candidate of
      depth 2 under the first-ranked one of depth 1. Every node's parent (its path less the last rank)
      comes before it; the deepest path is num_speculative_tokens long. The target scores the whole
      tree in one forward (specjax.trees) and recursive rejection sampling verifies it
      (specjax.verify.tree; rejection_sample_method 'standard'). Drafters whose proposer drafts_trees draft them.
    total_tokens, tree_top_k: a dynamic draft tree (EAGLE-2), rebuilt every step from the drafter's own
      confidences: the root's tree_top_k children, then at each depth the tree_top_k frontier nodes (by the
      product of draft probabilities along their path) each expanded to their tree_top_k children, for
      num_speculative_tokens depths; the total_tokens candidates of highest path probability are kept,
      parents before children. Drafts are each node's top-k (deterministic: q = 1 to the verifier, as
      EAGLE's rule). Both or neither; not with speculative_token_tree. Drafters whose proposer
      drafts_dynamic_trees draft them.
      (EAGLE's config calls tree_top_k top_k, vLLM has no name for it: here top_k is sampling's.)
      total_tokens 'auto': the size of AUTO_TREE_SIZES (those the depth and tree_top_k can fill) that
      `specjax.decoding.generate` predicts fastest for this device, batch and drafter, from a short
      calibration run (specjax.trees.sizing); the cache has room for the largest.
    prompt_lookup_min / prompt_lookup_max: the n-gram lengths prompt lookup tries, longest first.
    use_heterogeneous_vocab: draft and target with different tokenizers (vLLM's TLI).
    dflash_full_block: whether a block drafter drafts its whole trained block (null: auto).
    dspark_draft_topk: each draft drawn from this many candidates of highest base logit (null: all).
    mtp_hidden_state: what feeds each multi-token-prediction module after the first (null: the checkpoint's).
      These five are drafter options (vLLM's names): each belongs to the drafters that read it, whose
      proposer says what it means and allows (`Proposer.options`, `Proposer.check_options`); other
      methods take only its off value. specjax.proposers.check_spec checks them when the proposer is built.
    enable_adaptive_verification: vLLM's option: each step the loop chooses how many of the K drafts every
      row verifies, the width with the most expected tokens per second (specjax.adaptive): expected tokens
      from per-position acceptance estimates kept in the loop (each row's discounted counts of what its
      drafts had accepted, under a prior from its batch mates'; DSpark's confidence head where its drafts are
      deterministic), seconds from the device's cost curve. Lossless whatever it chooses (the choice is made
      before the target's scores are seen, and never from a sampled draft). Chains only (not with
      speculative_token_tree or total_tokens).
    adaptive_verify_widths: the verify widths (drafts scored per row) compiled into the loop, from which
      adaptive verification chooses each step by a `lax.switch` over target forwards of width + 1
      positions; increasing, in 0..K, with K last. null: every width up to 4, then from K down, each at most
      1.5x the next (K 15: 0-5, 7, 10, 15), so that the best width rounded to a compiled one loses a few
      percent at most (docs/design.md, "Adaptive verification"). Width 0 is an
      autoregressive step: the drafter then drafts nothing (Proposer.skips_drafting). [K] alone
      verifies the whole block with per-row masks, which saves nothing (docs/design.md, "Adaptive
      verification"). Only with enable_adaptive_verification.
    """

    method: str = "draft_model"
    num_speculative_tokens: int = 4
    rejection_sample_method: str = "standard"
    synthetic_acceptance_rates: tuple[float, ...] | None = None
    synthetic_acceptance_length: float | None = None
    draft_sample_method: str = "greedy"
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    use_heterogeneous_vocab: bool = False
    kv_cache_dtype: str | None = None
    verify_impl: str = "auto"
    speculative_token_tree: tuple[tuple[int, ...], ...] | None = None
    total_tokens: int | str | None = None
    tree_top_k: int | None = None
    dflash_full_block: bool | None = None
    dspark_draft_topk: int | None = None
    mtp_hidden_state: str | None = None
    enable_adaptive_verification: bool = False
    adaptive_verify_widths: tuple[int, ...] | None = None

    @property
    def verify_widths(self) -> tuple[int, ...]:
        """The verify widths compiled into the loop: adaptive_verify_widths (or its default) with adaptive
        verification, else K alone."""
        k = self.num_speculative_tokens
        if not self.enable_adaptive_verification:
            return (k,)
        if self.adaptive_verify_widths is not None:
            return self.adaptive_verify_widths
        widths, width = {k, *range(min(k, 4) + 1)}, k
        while width > 4:
            width = max(4, -(-width * 2 // 3))  # two thirds, rounded up: neighbours at most 1.5x apart
            widths.add(width)
        return tuple(sorted(widths))

    @property
    def auto_tree_sizes(self) -> tuple[int, ...]:
        """The sizes `total_tokens: auto` chooses from: those of AUTO_TREE_SIZES that tree_top_k over the depth
        fills (tree_top_k + (depth - 1) * tree_top_k^2 candidates), or that number alone when none fits."""
        most = self.tree_top_k + (self.num_speculative_tokens - 1) * self.tree_top_k ** 2
        return tuple(size for size in AUTO_TREE_SIZES if size <= most) or (most,)

    @property
    def num_draft_nodes(self) -> int:
        """Drafts scored per step: the tree's nodes (the largest size `auto` may choose), or K for a chain."""
        if self.total_tokens == "auto":
            return self.auto_tree_sizes[-1]
        if self.total_tokens is not None:
            return self.total_tokens
        return self.num_speculative_tokens if self.speculative_token_tree is None else len(self.speculative_token_tree)

    @property
    def drafts_tree(self) -> bool:
        """Whether each step drafts a tree (static or dynamic) rather than a chain."""
        return self.speculative_token_tree is not None or self.total_tokens is not None

    def __post_init__(self):
        require_positive_ints(self, "num_speculative_tokens")
        k = self.num_speculative_tokens
        if self.speculative_token_tree is not None:
            object.__setattr__(self, "speculative_token_tree", check_token_tree(self.speculative_token_tree, k))
            require(self.rejection_sample_method in TREE_REJECTION_SAMPLE_METHODS, "SpecConfig",
                    "rejection_sample_method", self.rejection_sample_method,
                    f"one of {TREE_REJECTION_SAMPLE_METHODS} with speculative_token_tree")
        if (self.total_tokens is None) != (self.tree_top_k is None):
            raise ConfigError(f"SpecConfig.total_tokens = {self.total_tokens!r} and tree_top_k = {self.tree_top_k!r}: "
                              "allowed both (a dynamic draft tree) or neither")
        if self.total_tokens is not None:
            require_positive_ints(self, "tree_top_k")
            if self.total_tokens != "auto":
                require(isinstance(self.total_tokens, int) and not isinstance(self.total_tokens, bool)
                        and self.total_tokens > 0, "SpecConfig", "total_tokens", self.total_tokens,
                        "a positive integer or 'auto'")
            require(self.speculative_token_tree is None, "SpecConfig", "total_tokens", self.total_tokens,
                    "None with speculative_token_tree (a tree is static or dynamic, not both)")
            candidates = self.tree_top_k + (k - 1) * self.tree_top_k ** 2
            require(self.num_draft_nodes <= candidates, "SpecConfig", "total_tokens", self.total_tokens,
                    f"at most the {candidates} candidates that tree_top_k {self.tree_top_k} over num_speculative_tokens "
                    f"{k} depths makes (tree_top_k + (depth - 1) * tree_top_k^2)")
            require(self.rejection_sample_method in TREE_REJECTION_SAMPLE_METHODS, "SpecConfig",
                    "rejection_sample_method", self.rejection_sample_method,
                    f"one of {TREE_REJECTION_SAMPLE_METHODS} with a dynamic tree")
            require(self.draft_sample_method == "greedy", "SpecConfig", "draft_sample_method", self.draft_sample_method,
                    "'greedy' with a dynamic tree: its drafts are each node's top-k, chosen by their own "
                    "probabilities, which a sampled tree's verification cannot condition on")
        require(self.draft_sample_method in DRAFT_SAMPLE_METHODS, "SpecConfig", "draft_sample_method",
                self.draft_sample_method, f"one of {DRAFT_SAMPLE_METHODS}")
        require(self.verify_impl in VERIFY_IMPLS, "SpecConfig", "verify_impl", self.verify_impl,
                f"one of {VERIFY_IMPLS}")
        if self.kv_cache_dtype is not None:
            dtype_from_name(self.kv_cache_dtype, "SpecConfig.kv_cache_dtype")
        self.check_adaptive()
        rates, length = self.synthetic_acceptance_rates, self.synthetic_acceptance_length
        if self.rejection_sample_method != "synthetic":
            if rates is not None or length is not None:
                raise ConfigError(
                    f"SpecConfig.rejection_sample_method = {self.rejection_sample_method!r} cannot be combined "
                    "with synthetic_acceptance_rates / synthetic_acceptance_length: allowed only with "
                    "rejection_sample_method 'synthetic'")
            return
        if (rates is None) == (length is None):
            raise ConfigError("SpecConfig with rejection_sample_method 'synthetic' needs exactly one of "
                              f"synthetic_acceptance_rates (got {rates!r}) and synthetic_acceptance_length "
                              f"(got {length!r})")
        if rates is not None:
            object.__setattr__(self, "synthetic_acceptance_rates", tuple(float(r) for r in rates))
            rates = self.synthetic_acceptance_rates
            require(len(rates) == k, "SpecConfig", "synthetic_acceptance_rates", rates,
                     f"{k} values (one per draft position, num_speculative_tokens = {k})")
            require(all(0.0 <= r <= 1.0 for r in rates), "SpecConfig", "synthetic_acceptance_rates", rates,
                     "values in [0, 1]")
            require(all(a >= b for a, b in zip(rates, rates[1:])), "SpecConfig", "synthetic_acceptance_rates",
                     rates, "non-increasing values (position i cannot be accepted more often than i - 1)")
        else:
            require(1.0 <= length <= k + 1, "SpecConfig", "synthetic_acceptance_length", length,
                     f"a mean acceptance length in [1, num_speculative_tokens + 1 = {k + 1}]")

    def check_adaptive(self) -> None:
        adaptive, widths, k = self.enable_adaptive_verification, self.adaptive_verify_widths, self.num_speculative_tokens
        require(isinstance(adaptive, bool), "SpecConfig", "enable_adaptive_verification", adaptive, "true or false")
        if adaptive and self.drafts_tree:
            field = "speculative_token_tree" if self.speculative_token_tree is not None else "total_tokens"
            raise ConfigError(f"SpecConfig.enable_adaptive_verification = True with {field} = "
                              f"{getattr(self, field)!r} is invalid: adaptive verification cuts chains (allowed: "
                              f"enable_adaptive_verification with {field} = null)")
        if widths is None:
            return
        require(adaptive, "SpecConfig", "adaptive_verify_widths", widths,
                "null without enable_adaptive_verification = true")
        ok = (isinstance(widths, (tuple, list)) and all(isinstance(w, int) and not isinstance(w, bool) for w in widths)
              and len(widths) > 0 and list(widths) == sorted(set(widths)) and widths[0] >= 0 and widths[-1] == k)
        require(ok, "SpecConfig", "adaptive_verify_widths", widths,
                f"null, or increasing integers in 0..num_speculative_tokens ending with it ({k})")
        object.__setattr__(self, "adaptive_verify_widths", tuple(widths))

    @property
    def synthetic_rates(self) -> tuple[float, ...]:
        """Unconditional per-position acceptance rates: given, or from the mean length L as vLLM does
        (floor(L - 1) ones, then the fractional part, then zeros; their sum is L - 1)."""
        if self.synthetic_acceptance_rates is not None:
            return self.synthetic_acceptance_rates
        extra = self.synthetic_acceptance_length - 1.0
        whole = int(extra)
        rates = [1.0] * whole + [extra - whole]
        return tuple((rates + [0.0] * self.num_speculative_tokens)[:self.num_speculative_tokens])

