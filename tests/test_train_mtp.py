"""Training MTP modules on a tiny trained target (`specjax train-mtp`): the loss falls, the saved modules
(MiMo's tensor names) load, draft losslessly and accept more than untrained ones, and a run stopped mid-way
resumes to the uninterrupted result."""

import functools
import json

import numpy as np
import pytest
from support.block_training import stopped_run_resumes
from support.checkpoints import REPO, drafter_run_config, train_through_cli

from specjax.config import ConfigError, MTPTrainConfig, SpecConfig
from specjax.decoding import generate
from specjax.models import hf
from specjax.models.mtp import init_mtp, load_mtp
from specjax.training import mtp as mtp_training
from specjax.training.evaluation import held_out_prompts
from specjax.training.loop import read_metrics

pytestmark = pytest.mark.train  # each test trains modules or reads trained ones (tests/conftest.py: tiers)

CONFIG, TOTAL_STEPS = REPO / "configs/train/tiny_mtp.yaml", 40  # the config's steps; it checkpoints every 20
run_config = functools.partial(drafter_run_config, MTPTrainConfig, CONFIG)  # (target_dir, output_dir, *overrides)


@pytest.fixture(scope="module")
def mtp_run(trained_tiny_target, tmp_path_factory):  # trained through the CLI, as a user would
    return train_through_cli("train-mtp", CONFIG, trained_tiny_target, tmp_path_factory.mktemp("mtp"))


def test_the_modules_train_load_draft_losslessly_and_beat_untrained_ones(trained_tiny_target, mtp_run):
    records = read_metrics(mtp_run / "metrics.jsonl")
    losses = [record["loss"] for record in records]
    assert len(losses) == TOTAL_STEPS and np.mean(losses[-5:]) < np.mean(losses[:5])
    assert {"accuracy_1", "accuracy_2"} <= set(records[-1])  # each depth's accuracy
    target = hf.load(trained_tiny_target)
    modules = load_mtp(mtp_run / "mtp", target.config)
    assert modules.config.num_modules == 2 and modules.config.hidden_state == "chained"

    held_out = np.memmap(mtp_run / "tokens_held_out.bin", np.uint32, "r")
    prompts = held_out_prompts(held_out, 3, 24, seed=1)
    spec = SpecConfig(method="mtp", num_speculative_tokens=3)
    assert generate(target, prompts, max_new_tokens=20, spec=spec, drafter=modules).sequences() == \
        generate(target, prompts, max_new_tokens=20).sequences()

    evaluation = json.loads((mtp_run / "mtp/eval.json").read_text())
    assert evaluation["final_loss"] == losses[-1] and evaluation["loss_weights"] == [0.6, 0.4]
    config = run_config(trained_tiny_target, mtp_run)
    untrained = init_mtp(modules.config, seed=1)
    baseline = mtp_training.closing_eval(config, target, untrained, held_out)["mean_acceptance_length"]
    print(f"MTP mean acceptance length: trained {evaluation['mean_acceptance_length']:.3f}, untrained {baseline:.3f}")
    assert evaluation["mean_acceptance_length"] > baseline


def test_a_stopped_run_resumes_to_the_uninterrupted_result(trained_tiny_target, mtp_run, tmp_path, monkeypatch):
    """Stopped at step 27 (an exception in the batch pipeline), the run restarts from its step-20
    checkpoint and ends where the uninterrupted one (the CLI's) did: the same losses step by step, the same
    weights."""
    target_config = hf.load_config(trained_tiny_target)
    stopped_run_resumes(monkeypatch, run_config(trained_tiny_target, tmp_path / "stopped"), mtp_run,
                        lambda folder: load_mtp(folder, target_config), TOTAL_STEPS, trainer=mtp_training,
                        draw_name="batch_rows", train_name="train_mtp", folder="mtp")


def test_bad_loss_weights_are_refused(trained_tiny_target, tmp_path):
    with pytest.raises(ConfigError, match=r"MTPTrainConfig.loss_weights = \(1.0,\) is invalid: allowed None or 2 "):
        run_config(trained_tiny_target, tmp_path, "loss_weights=[1.0]")
