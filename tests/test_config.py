"""Configs refuse bad values with a message naming the field, the value and what is allowed."""

import dataclasses

import pytest
from support.checkpoints import REPO

from specjax.config import ConfigError, HeadTrainConfig, ModelConfig, RopeScaling, SamplingConfig, SpecConfig, \
    dtype_from_name
from specjax.proposers import build_proposer
from specjax.verify import check_method

BASE = dict(vocab_size=32, hidden_size=16, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=4,
            intermediate_size=32)


@pytest.mark.parametrize("changes, message", [
    (dict(num_kv_heads=3), r"ModelConfig.num_kv_heads = 3 is invalid: allowed a divisor of num_heads \(4\)"),
    (dict(num_layers=0), r"ModelConfig.num_layers = 0 is invalid: allowed an integer >= 1"),
    (dict(norm="batch"), r"ModelConfig.norm = 'batch' is invalid: allowed 'rms' or 'layer'"),
    (dict(dtype="float64"), r"ModelConfig.dtype = 'float64' is invalid: allowed \["),
    (dict(sliding_window=0), r"ModelConfig.sliding_window = 0 is invalid"),
    (dict(position="learned", rope_scaling=RopeScaling("linear", 2.0)), r"ModelConfig.rope_scaling = .* None when"),
])
def test_bad_model_config_names_the_field(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**BASE, **changes})


def test_rope_scaling_is_checked():
    with pytest.raises(ConfigError, match=r"RopeScaling.rope_type = 'yarn' is invalid"):
        RopeScaling("yarn", 2.0)
    with pytest.raises(ConfigError, match=r"RopeScaling.high_freq_factor = 1.0 is invalid"):
        RopeScaling("llama3", 8.0, low_freq_factor=1.0, high_freq_factor=1.0)


def test_configs_are_hashable_static_arguments():
    config = ModelConfig(**BASE)
    assert hash(config) == hash(dataclasses.replace(config))
    assert config.num_query_groups == 2
    assert dtype_from_name("bfloat16").__name__ == "bfloat16"


def test_head_train_config_takes_a_draft_vocabulary_for_either_eagle_kind():
    for kind in ("eagle1", "eagle3"):  # EAGLE-1: FR-Spec
        assert HeadTrainConfig(target="t", kind=kind, draft_vocab_size=200).draft_vocab_size == 200


@pytest.mark.parametrize("changes, message", [
    ({"kind": "eagle1", "fuse_layers": (0, 1, 2)},
     r"HeadTrainConfig.fuse_layers = \(0, 1, 2\) is invalid: allowed only with kind 'eagle3' \(kind is 'eagle1'\)"),
    ({"kind": "eagle3", "fuse_layers": (2, 3, 3)},
     r"HeadTrainConfig.fuse_layers = \(2, 3, 3\) is invalid: allowed None or three distinct target layers"),
    ({"kind": "medusa", "draft_vocab_size": 200},
     r"HeadTrainConfig.draft_vocab_size = 200 is invalid: allowed only with kind 'eagle1' or 'eagle3'"),
    ({"kind": "eagle1", "draft_vocab_size": 0}, r"HeadTrainConfig.draft_vocab_size = 0 is invalid: allowed None or"),
])
def test_bad_head_train_config_names_the_field(changes, message):
    with pytest.raises(ConfigError, match=message):
        HeadTrainConfig(target="t", **changes)


@pytest.mark.parametrize("changes, build, message", [
    (dict(method="lookahead"), lambda spec: build_proposer(spec, SamplingConfig(), cache_size=16),
     r"SpecConfig.method = 'lookahead' is invalid: allowed one of \['dflash', 'draft_model', 'dspark', 'eagle', "
     r"'eagle3', 'medusa', 'mtp', 'ngram'\]"),
    (dict(rejection_sample_method="typical"), check_method,
     r"SpecConfig.rejection_sample_method = 'typical' is invalid: allowed one of \('standard', 'block', "
     r"'synthetic'\)"),
])
def test_registry_names_are_checked_where_the_registries_are(changes, build, message):
    spec = SpecConfig(**changes)  # config.py imports no registry, so it cannot know the names
    with pytest.raises(ConfigError, match=message):
        build(spec)


def test_the_spec_validates_no_drafter_by_name():
    import inspect

    from specjax.proposers import PROPOSERS

    checks = inspect.getsource(SpecConfig.__post_init__) + inspect.getsource(SpecConfig.check_adaptive)
    assert not [name for name in PROPOSERS if f"'{name}'" in checks or f'"{name}"' in checks]
    # Each drafter's options are its proposer's: checked when a proposer is built, naming field, value and owner.
    with pytest.raises(ConfigError, match=r"SpecConfig.prompt_lookup_max = 1 is invalid: allowed an integer >= "
                                          r"prompt_lookup_min \(2\)"):
        build_proposer(SpecConfig(method="ngram", prompt_lookup_min=2, prompt_lookup_max=1), SamplingConfig(), 16)
    assert SpecConfig(method="eagle", prompt_lookup_min=2).prompt_lookup_min == 2  # n-gram's sizes ride along


def test_malformed_yaml_is_one_line_naming_the_file_line_and_column(tmp_path, capsys):
    from specjax import cli

    path = tmp_path / "broken.yaml"
    path.write_text("base:\n  target: default:target\n  spec: {method: eagle\ngrid: {}\n")
    assert cli.main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specjax sweep: error: {path}: malformed YAML at line 4, column 5: while parsing a flow "
                          "mapping: expected") and "<unicode" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_an_unknown_set_key_is_blamed_on_the_set(tmp_path):
    from specjax.config import load_yaml
    from specjax.experiments import RunConfig

    path = tmp_path / "run.yaml"
    path.write_text("target: default:target\n")
    with pytest.raises(ConfigError, match=r"^--set spec.num_draft_tokens=3: unknown key 'num_draft_tokens' in spec "
                                          r"\(SpecConfig\): allowed \["):
        load_yaml(RunConfig, path, ["spec.num_draft_tokens=3"])
    with pytest.raises(ConfigError, match=r"^--set max_tokens=3: unknown key 'max_tokens' \(RunConfig\)"):
        load_yaml(RunConfig, path, ["max_tokens=3"])
    assert load_yaml(RunConfig, path, ["spec.num_speculative_tokens=3"]).spec.num_speculative_tokens == 3


# A training config's trainer by the end of its name (scripts/train_default_models.sh names them so).
TRAINER_BY_SUFFIX = {"target": "train-lm", "draft": "train-lm", "lm": "train-lm", "eagle": "train-eagle",
                     "eagle1": "train-eagle", "eagle3": "train-eagle", "medusa": "train-medusa",
                     "dflash": "train-dflash", "dspark": "train-dspark", "mtp": "train-mtp"}


@pytest.mark.parametrize("path", sorted((REPO / "configs").rglob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_with_the_class_its_command_takes(path):
    """A broken shipped config fails here, not on the GPU machine (the code recipe's configs are run only there)."""
    from specjax import cli, config
    from specjax.experiments import load_run, load_sweep

    if path.parent.name == "train":
        config_class = cli.TRAINERS[TRAINER_BY_SUFFIX[path.stem.rsplit("_", 1)[1]]][0]
        loaded = config.load_yaml(getattr(config, config_class), path)
        assert type(loaded).__name__ == config_class
    else:
        loader = load_sweep if "grid" in path.read_text() else load_run
        assert loader(path) is not None
