"""Frozen, validated configuration dataclasses.

Every config is a frozen (hashable) dataclass so that it can be a static argument of `jax.jit`. Values
are checked when the object is built: a bad value raises `ConfigError` naming the field, the value and
what is allowed, so nothing wrong gets as far as a trace. What a drafter's own options allow its proposer
checks (specjax.proposers.check_spec): this package imports no registry, so a config alone loads no model code.
"""

from specjax.config._checks import (DTYPES, ConfigError, dtype_from_name, require, require_choice,
                                    require_dtype_names, require_float, require_optional_positive_ints,
                                    require_positive_ints)
from specjax.config._model import (ATTENTION_IMPLS, EXECUTION_FIELDS, MATMUL_PRECISIONS, REMAT_POLICIES, ModelConfig,
                                   RopeScaling, matmul_precision_for)
from specjax.config._spec import (AUTO_TREE_SIZES, DRAFT_SAMPLE_METHODS, TREE_REJECTION_SAMPLE_METHODS, VERIFY_IMPLS,
                                  SamplingConfig, SpecConfig, check_token_tree)
from specjax.config._training import (COMPUTE_DTYPES, DFLASH_LOSS_DECAY, DataConfig, DFlashTrainConfig,
                                      DrafterTrainingRun, DSparkTrainConfig, HeadTrainConfig, MeshConfig,
                                      MTPTrainConfig, OptimizerConfig, OwnTextTrainingRun, TrainConfig, TrainingRun)
from specjax.config._yaml import check_field_path, from_dict, load_yaml, parse_yaml, with_overrides

__all__ = ["ATTENTION_IMPLS", "AUTO_TREE_SIZES", "COMPUTE_DTYPES", "DFLASH_LOSS_DECAY", "DRAFT_SAMPLE_METHODS", "DTYPES",
           "EXECUTION_FIELDS", "MATMUL_PRECISIONS", "REMAT_POLICIES", "TREE_REJECTION_SAMPLE_METHODS", "VERIFY_IMPLS",
           "ConfigError", "DataConfig", "DFlashTrainConfig", "DrafterTrainingRun", "DSparkTrainConfig",
           "HeadTrainConfig", "MeshConfig", "ModelConfig", "MTPTrainConfig", "OptimizerConfig", "OwnTextTrainingRun",
           "RopeScaling", "SamplingConfig", "SpecConfig", "TrainConfig", "TrainingRun", "check_field_path",
           "check_token_tree", "dtype_from_name", "from_dict", "load_yaml", "matmul_precision_for", "parse_yaml",
           "require", "require_choice", "require_dtype_names", "require_float", "require_optional_positive_ints",
           "require_positive_ints", "with_overrides"]
