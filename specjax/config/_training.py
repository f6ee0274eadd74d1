"""Training runs: data, optimizer, mesh, and the run configs of each trainer (LM, heads, block drafters, MTP)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from specjax.config._checks import (require, require_choice, require_float, require_optional_positive_ints,
                                    require_positive_ints)
from specjax.config._model import REMAT_POLICIES, ModelConfig


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Corpus, tokenizer and batches. corpus_dir None is the running interpreter's standard library
    (tests excluded); tokenizer None trains a byte-level BPE of vocab_size on the training split."""

    corpus_dir: str | None = None
    pattern: str = "*.py"
    max_files: int | None = None  # the first N files in path order (quick runs, tests)
    held_out_fraction: float = 0.05
    tokenizer: str | None = None
    vocab_size: int = 4096
    seq_len: int = 256
    batch_size: int = 32
    # Where the prepared corpus (tokenizer/ and token files) lives, e.g. the target run's folder to
    # reuse its tokenization; prepared there when absent. None: the run's output_dir.
    cache_dir: str | None = None

    def __post_init__(self):
        require(0.0 < self.held_out_fraction < 1.0, "DataConfig", "held_out_fraction", self.held_out_fraction,
                "a float in (0, 1)")
        require_positive_ints(self, "seq_len", "batch_size", "vocab_size")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup and cosine decay to min_lr_ratio * lr, global-norm clipping."""

    lr: float = 3e-4
    warmup_steps: int = 100
    total_steps: int = 1000
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0

    def __post_init__(self):
        require_positive_ints(self, "total_steps")
        require(0 <= self.warmup_steps <= self.total_steps, "OptimizerConfig", "warmup_steps", self.warmup_steps,
                f"an integer in [0, total_steps = {self.total_steps}]")
        require_float(self, "lr", 0, low_open=True)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """A (data, model) device mesh (specjax.sharding): data=-1 takes every device the model axis leaves."""

    data: int = -1
    model: int = 1

    def __post_init__(self):
        require(self.data == -1 or self.data >= 1, "MeshConfig", "data", self.data, "-1 or an integer >= 1")
        require_positive_ints(self, "model")


# Dtypes a training run may compute in (TrainingRun.compute_dtype).
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingRun:
    """What every training run has: data, optimizer, where it writes, how often it saves and logs."""

    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    output_dir: str = "runs/train"
    seed: int = 0
    checkpoint_every: int = 200
    log_every: int = 10
    # Devices: batches split over mesh.data; weights split over mesh.model by specjax.sharding's rules
    # and, with fsdp, also over mesh.data (each device keeps a slice of weights and optimizer state).
    mesh: MeshConfig = MeshConfig()
    fsdp: bool = False
    # Rematerialisation of the trained module's layers (and the frozen target's, which has no backward
    # pass and is unaffected): ModelConfig.remat's policies, REMAT_POLICIES.
    remat: str = "none"
    # Each step's batch runs as grad_accum_steps micro-batches of data.batch_size / grad_accum_steps rows
    # (a lax.scan inside the step) whose gradients are averaged: the big batch's step in less memory.
    grad_accum_steps: int = 1
    # The dtype activations and matrix products of the trained module and of the frozen target run in
    # ('bfloat16', 'float16', 'float32'); the trained weights and optimizer state stay float32 (master
    # weights). None: the module's own config decides (an LM's model.dtype, a head's its target's).
    compute_dtype: str | None = None
    # Steps traced with JAX's profiler, from the PROFILE_AFTER-th step after the run's start (compiled and warm) on,
    # into output_dir/profile (a perfetto trace); what the trace says (the device's busy share, its kernel time by
    # kind and the kernels that took the most: specjax.profiling) goes to output_dir/profile.json. 0: none.
    profile_steps: int = 0

    def __post_init__(self):
        require_positive_ints(self, "checkpoint_every", "log_every", "grad_accum_steps")
        require(isinstance(self.profile_steps, int) and self.profile_steps >= 0, type(self).__name__,
                "profile_steps", self.profile_steps, "an integer >= 0")
        name = type(self).__name__
        require(self.remat in REMAT_POLICIES, name, "remat", self.remat, f"one of {list(REMAT_POLICIES)}")
        require(self.data.batch_size % self.grad_accum_steps == 0, name, "grad_accum_steps", self.grad_accum_steps,
                f"a divisor of data.batch_size ({self.data.batch_size})")
        require(self.compute_dtype in (None, *COMPUTE_DTYPES), name, "compute_dtype", self.compute_dtype,
                f"None or one of {list(COMPUTE_DTYPES)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig(TrainingRun):
    """One LM training run; everything it writes goes under output_dir."""

    model: ModelConfig
    eval_batches: int = 16

    def __post_init__(self):
        super().__post_init__()
        # One place for the policy: the run's remat, which train_lm writes into the model's config.
        require(self.model.remat == "none", "TrainConfig", "model.remat", self.model.remat,
                "'none' (set the run's remat instead)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterTrainingRun(TrainingRun):
    """What every drafter's training run has: the frozen target and the closing acceptance eval's prompts."""

    # The target's Hugging Face folder or default:target (its tokenizer tokenizes the corpus).
    target: str
    # The closing acceptance eval: held-out prompts, greedy.
    eval_prompts: int = 32
    eval_prompt_len: int = 64
    eval_new_tokens: int = 64

    def __post_init__(self):
        super().__post_init__()
        require_positive_ints(self, "eval_prompts", "eval_prompt_len", "eval_new_tokens")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadTrainConfig(DrafterTrainingRun):
    """Training draft heads (EAGLE or Medusa) on a frozen target."""

    kind: Literal["eagle1", "eagle3", "medusa"]
    # Medusa: heads, residual blocks per head, and whether heads project with the target's LM head
    # instead of a copy each.
    num_heads: int = 4
    num_layers: int = 1
    shared_lm_head: bool = False
    # EAGLE-3: the target layers whose inputs are fused, three distinct ones (None: layers 2, L//2, L-3, or on
    # targets under 7 layers, where that repeats one, 1, L//2, L-1: models.eagle.default_fuse_layers).
    fuse_layers: tuple[int, ...] | None = None
    # EAGLE-1 or EAGLE-3: the most frequent training ids that drafts are drawn from (None: the target's
    # vocabulary). EAGLE-3 trains its own LM head over them; EAGLE-1 is trained as without one and
    # drafts with those rows of the target's LM head (FR-Spec).
    draft_vocab_size: int | None = None
    # EAGLE-3's training-time test (draft steps fed their own output, loss weights step_decay^i) and
    # Medusa's per-head loss weights (step_decay^k).
    unroll_steps: int = 7
    step_decay: float = 0.8
    # EAGLE-1's uniform noise on target features.
    feature_noise: float = 0.1
    # The closing acceptance eval's K.
    eval_num_speculative_tokens: int = 4

    def __post_init__(self):
        super().__post_init__()
        require_choice(self, "kind", ("eagle1", "eagle3", "medusa"))
        require_float(self, "step_decay", 0, 1, low_open=True)
        require(self.fuse_layers is None or self.kind == "eagle3", "HeadTrainConfig", "fuse_layers",
                self.fuse_layers, f"only with kind 'eagle3' (kind is {self.kind!r}), else None")
        require(self.fuse_layers is None or len(set(self.fuse_layers)) == len(self.fuse_layers) == 3,
                "HeadTrainConfig", "fuse_layers", self.fuse_layers,
                "None or three distinct target layers (a repeated layer adds no information to the fused feature)")
        require(self.draft_vocab_size is None or self.kind in ("eagle1", "eagle3"), "HeadTrainConfig",
                "draft_vocab_size", self.draft_vocab_size,
                f"only with kind 'eagle1' or 'eagle3' (kind is {self.kind!r}), else None")
        require_optional_positive_ints(self, "draft_vocab_size")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OwnTextTrainingRun(DrafterTrainingRun):
    """What drafters trained on the target's own text share (DFlash, MTP): the distillation mix and the
    regenerated sequences."""

    # 0: cross-entropy against the sequence's tokens (the recipes'); 1: against the target's distribution
    # of the same tokens (distillation); between: the mix.
    distill_weight: float = 0.0
    # 0: train on corpus windows. N > 0: on N sequences the target writes itself (EAGLE-3's and DFlash's
    # "data regenerated by the target"): a corpus window of regenerate_prompt_len tokens continued by the
    # target to data.seq_len + 1 tokens, at regenerate_temperature (0: greedy). Saved as regenerated.npy.
    regenerate_sequences: int = 0
    regenerate_prompt_len: int = 32
    regenerate_temperature: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        require(self.regenerate_sequences >= 0, name, "regenerate_sequences", self.regenerate_sequences,
                "an integer >= 0 (0: train on the corpus)")
        require(1 <= self.regenerate_prompt_len <= self.data.seq_len, name, "regenerate_prompt_len",
                self.regenerate_prompt_len, f"an integer in [1, data.seq_len = {self.data.seq_len}]")
        require_float(self, "regenerate_temperature", 0, note=" (0: greedy)")
        require_float(self, "distill_weight", 0, 1)


# The recipe's loss decay for a block size (DFlash, SpecForge): gamma 7 for 16, 5 for 10, 4 for 8.
DFLASH_LOSS_DECAY = {16: 7.0, 10: 5.0, 8: 4.0}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DFlashTrainConfig(OwnTextTrainingRun):
    """Training a DFlash block drafter on a frozen target (specjax.training.dflash)."""

    # Drafter layers: Qwen3 layers of the target's width, heads and head size.
    num_layers: int = 1
    # The drafter's MLP width (None: the target's); narrower layers buy depth within a size budget.
    intermediate_size: int | None = None
    # Target layers whose outputs make the context feature (None: spread from 1 to L - 3, as z-lab's).
    target_layer_ids: tuple[int, ...] | None = None
    # The block: the anchor and block_size - 1 masked slots, each predicting the token at its position.
    block_size: int = 16
    causal: bool = False
    # The token that fills the masked slots (None: the target's pad_token_id, else its last id).
    mask_token_id: int | None = None
    # Blocks per training sequence, at distinct random anchors whose whole block lies inside it.
    num_anchors: int = 32
    # Weight of block slot k >= 1: exp(-(k - 1) / loss_decay_gamma) (None: DFLASH_LOSS_DECAY, else 7).
    loss_decay_gamma: float | None = None
    # The closing eval's K (None: block_size - 1).
    eval_num_speculative_tokens: int | None = None

    def __post_init__(self):
        super().__post_init__()
        require_positive_ints(self, "num_layers", "num_anchors")
        require(self.block_size >= 2, "DFlashTrainConfig", "block_size", self.block_size, "an integer >= 2")
        require_optional_positive_ints(self, "intermediate_size")
        require(self.data.seq_len >= self.block_size, "DFlashTrainConfig", "data.seq_len", self.data.seq_len,
                f"an integer >= block_size ({self.block_size}): every block lies inside its sequence")
        if self.loss_decay_gamma is not None:
            require_float(self, "loss_decay_gamma", 0, low_open=True, note=" or None")
        k = self.eval_num_speculative_tokens
        require(k is None or 1 <= k <= self.block_size - 1, "DFlashTrainConfig", "eval_num_speculative_tokens", k,
                f"None or an integer in [1, block_size - 1 = {self.block_size - 1}]")

    @property
    def decay_gamma(self) -> float:
        return self.loss_decay_gamma or DFLASH_LOSS_DECAY.get(self.block_size, 7.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DSparkTrainConfig(DFlashTrainConfig):
    """Training a DSpark drafter (specjax.models.dspark): DFlashTrainConfig's backbone and recipe, with the
    Markov head trained jointly and the confidence head on the acceptance each block observes
    (specjax.training.dflash; `specjax train-dspark`)."""

    # The Markov head's rank (0: none, a DFlash drafter in DSpark's layout) and type.
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    # The anchor's slot drafts the first token (DeepSpec's layout); False: the slot after it (DFlash's).
    sample_from_anchor: bool = True
    # Weight of the confidence head's loss (DeepSpec's name; 0: no confidence head).
    confidence_head_alpha: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        require(isinstance(self.markov_rank, int) and not isinstance(self.markov_rank, bool) and self.markov_rank >= 0,
                "DSparkTrainConfig", "markov_rank", self.markov_rank, "an integer >= 0 (0: no Markov head)")
        require_choice(self, "markov_head_type", ("vanilla", "gated"))
        require_float(self, "confidence_head_alpha", 0, note=" (0: no confidence head)")
        span = self.block_size + self.sample_from_anchor  # the anchor's slot predicts the token after it
        require(self.data.seq_len >= span, "DSparkTrainConfig", "data.seq_len", self.data.seq_len,
                f"an integer >= {span} (block_size{' + 1 with sample_from_anchor' if self.sample_from_anchor else ''}):"
                " every block's labels lie inside its sequence")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MTPTrainConfig(OwnTextTrainingRun):
    """Training multi-token prediction modules on a frozen target (specjax.training.mtp)."""

    # Modules: module m (0-based) predicts the token m + 2 after each position (specjax.models.mtp).
    num_modules: int = 1
    # The modules' MLP width (None: the target's).
    intermediate_size: int | None = None
    # What feeds module m > 0, 'chained' or 'target' (specjax.models.mtp); the saved default of decoding.
    hidden_state: str = "chained"
    # DeepSeek-V3's loss over depths: sum over modules of weight_m * cross-entropy_m; None: 1 / num_modules each.
    loss_weights: tuple[float, ...] | None = None
    # The closing eval's K (None: num_modules).
    eval_num_speculative_tokens: int | None = None

    def __post_init__(self):
        super().__post_init__()
        name = "MTPTrainConfig"
        require_positive_ints(self, "num_modules")
        require_optional_positive_ints(self, "intermediate_size", "eval_num_speculative_tokens")
        require_choice(self, "hidden_state", ("chained", "target"))
        weights = self.loss_weights
        require(weights is None or (len(weights) == self.num_modules and all(w >= 0 for w in weights)
                                    and sum(weights) > 0), name, "loss_weights", weights,
                f"None or {self.num_modules} non-negative weights (one per module), not all 0")
        require(self.data.seq_len >= self.num_modules + 2, name, "data.seq_len", self.data.seq_len,
                f"an integer >= num_modules + 2 ({self.num_modules + 2}): the last module's labels lie inside it")

    @property
    def depth_weights(self) -> tuple[float, ...]:
        return self.loss_weights or (1.0 / self.num_modules,) * self.num_modules
