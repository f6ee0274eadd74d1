"""Medusa head training on a frozen tiny target: the loss falls, the heads load in the public layout
and draft losslessly, and they are accepted more often than the untrained heads."""

import numpy as np
import pytest
from support.checkpoints import REPO

from specjax.config import HeadTrainConfig, SpecConfig, TrainConfig, load_yaml
from specjax.decoding import generate
from specjax.models import hf
from specjax.models.medusa import load_medusa
from specjax.training.evaluation import held_out_prompts
from specjax.training.lm import train_lm
from specjax.training.loop import read_metrics
from specjax.training.medusa import train_medusa

pytestmark = pytest.mark.train  # each test trains heads or reads trained ones (tests/conftest.py: tiers)

LM_CONFIG = REPO / "configs/train/tiny_lm.yaml"
MEDUSA_CONFIG = REPO / "configs/train/tiny_medusa.yaml"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("medusa")
    # A longer-trained tiny target than the kill test's, so that its continuations have structure.
    train_lm(load_yaml(TrainConfig, LM_CONFIG, [f"output_dir={root / 'lm'}", "optimizer.total_steps=150"]))
    config = load_yaml(HeadTrainConfig, MEDUSA_CONFIG, [f"target={root / 'lm' / 'model'}",
                                                        f"output_dir={root / 'medusa'}"])
    return root, config, train_medusa(config)


def test_the_loss_falls(trained):
    root, _, _ = trained
    losses = [record["loss"] for record in read_metrics(root / "medusa" / "metrics.jsonl")]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.2


def test_trained_heads_are_accepted_more_than_untrained_ones(trained):
    _, _, summary = trained
    print(summary)
    assert summary["mean_acceptance_length"] > summary["untrained_mean_acceptance_length"]
    assert summary["mean_acceptance_length"] > 1.0


def test_saved_heads_load_and_draft_losslessly(trained):
    root, config, _ = trained
    target = hf.load(config.target)
    heads = load_medusa(root / "medusa" / "heads")
    from specjax.data.dataset import prepare

    _, _, held_out = prepare(config.data, root / "medusa")
    prompts = held_out_prompts(held_out, 6, 16)
    expected = generate(target, prompts, max_new_tokens=16).sequences()
    result = generate(target, prompts, max_new_tokens=16, drafter=heads,
                      spec=SpecConfig(method="medusa", num_speculative_tokens=3))
    assert result.sequences() == expected


def test_a_second_call_resumes_at_the_end(trained):
    root, config, summary = trained
    assert train_medusa(config) == summary
