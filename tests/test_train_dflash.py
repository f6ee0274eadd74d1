"""Training a DFlash drafter on a tiny trained target (`specjax train-dflash`): the loss falls, the
saved drafter (z-lab's layout) loads and drafts losslessly and accepts more than an untrained one,
a run stopped mid-way resumes to the uninterrupted result, and a corrupt checkpoint is refused."""

import json

import numpy as np
import pytest
from support.block_training import drafts_losslessly, stopped_run_resumes
from support.checkpoints import REPO, drafter_run_config, train_through_cli

from specjax.config import DFlashTrainConfig
from specjax.models import hf
from specjax.models.dflash import init_dflash, load_dflash
from specjax.training import dflash as dflash_training
from specjax.training.loop import CheckpointCorrupted, read_metrics

pytestmark = pytest.mark.train  # each test trains a drafter or reads a trained one (tests/conftest.py: tiers)

CONFIG = REPO / "configs/train/tiny_dflash.yaml"
TOTAL_STEPS = 40  # the config's; it checkpoints every 20


def run_config(target_dir, output_dir, *overrides) -> DFlashTrainConfig:
    return drafter_run_config(DFlashTrainConfig, CONFIG, target_dir, output_dir, *overrides)


@pytest.fixture(scope="module")
def dflash_run(trained_tiny_target, tmp_path_factory):
    """Trained through the CLI, as a user would."""
    return train_through_cli("train-dflash", CONFIG, trained_tiny_target, tmp_path_factory.mktemp("dflash"))


def test_the_drafter_trains_loads_drafts_losslessly_and_beats_an_untrained_one(trained_tiny_target, dflash_run):
    losses = [record["loss"] for record in read_metrics(dflash_run / "metrics.jsonl")]
    assert len(losses) == TOTAL_STEPS and np.mean(losses[-5:]) < np.mean(losses[:5])
    target = hf.load(trained_tiny_target)
    drafter = load_dflash(dflash_run / "drafter", target.config)
    assert drafter.config.block_size == 8 and drafter.config.target_layer_ids == (0,)
    drafts_losslessly(target, drafter, dflash_run, "dflash", 7)
    held_out = np.memmap(dflash_run / "tokens_held_out.bin", np.uint32, "r")
    evaluation = json.loads((dflash_run / "drafter/eval.json").read_text())
    assert evaluation["final_loss"] == losses[-1] and evaluation["num_speculative_tokens"] == 7
    config = run_config(trained_tiny_target, dflash_run)
    assert dflash_training.closing_eval(config, target, drafter, held_out)["mean_acceptance_length"] == \
        evaluation["mean_acceptance_length"]
    untrained = init_dflash(drafter.config, seed=1)
    baseline = dflash_training.closing_eval(config, target, untrained, held_out)["mean_acceptance_length"]
    print(f"DFlash mean acceptance length: trained {evaluation['mean_acceptance_length']:.3f}, untrained {baseline:.3f}")
    assert evaluation["mean_acceptance_length"] > baseline


def test_the_training_sequences_are_the_targets_own_greedy_continuations(trained_tiny_target, dflash_run):
    """regenerated.npy: each row is an 8-token corpus prompt continued by the target's argmax; a full forward
    over a row picks every continuation token (up to a near-tie between the two top logits)."""
    sequences = np.load(dflash_run / "regenerated.npy")
    assert sequences.shape == (64, 33)
    target = hf.load(trained_tiny_target)
    positions = np.broadcast_to(np.arange(32), (64, 32))
    logits = np.asarray(target(sequences[:, :32], positions)[0], np.float32)
    chosen = np.take_along_axis(logits, sequences[:, 1:, None], -1)[..., 0]
    gap = logits.max(-1) - chosen  # [B, 32]; position p - 1 predicts token p
    assert np.all(gap[:, 7:] <= 1e-4), gap[:, 7:].max()
    assert np.mean(gap[:, :7] > 1e-4) > 0.2  # the corpus prompts are not the target's argmax


def test_a_stopped_run_resumes_to_the_uninterrupted_result(trained_tiny_target, dflash_run, tmp_path, monkeypatch):
    """Stopped at step 27, the run restarts from its step-20 checkpoint and ends where the uninterrupted one
    did: the same losses step by step, the same weights (resume_check)."""
    stopped_run_resumes(monkeypatch, run_config(trained_tiny_target, tmp_path), dflash_run, load_dflash, TOTAL_STEPS)


def test_a_corrupt_checkpoint_is_refused(trained_tiny_target, dflash_run, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(dflash_run, copy)
    state = copy / "checkpoints" / str(TOTAL_STEPS) / "state"
    victim = sorted(p for p in state.rglob("*") if p.is_file() and p.stat().st_size > 1000)[0]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorrupted, match=rf"checkpoint .*{TOTAL_STEPS}"):
        dflash_training.train_dflash(run_config(trained_tiny_target, copy, f"optimizer.total_steps={TOTAL_STEPS + 1}"))


def test_the_drafters_depth_and_mlp_width_follow_the_config_and_a_bad_width_is_refused(trained_tiny_target, tmp_path):
    target_config = hf.load_config(trained_tiny_target)
    config = run_config(trained_tiny_target, tmp_path, "num_layers=3", "intermediate_size=40")
    shape = dflash_training.drafter_config(config, target_config, mask_token_id=0).layer
    assert (shape.num_layers, shape.intermediate_size, shape.hidden_size) == (3, 40, target_config.hidden_size)
    default = dflash_training.drafter_config(run_config(trained_tiny_target, tmp_path), target_config, 0).layer
    assert default.intermediate_size == target_config.intermediate_size
    with pytest.raises(ValueError, match="intermediate_size.*0.*None or an integer >= 1"):
        run_config(trained_tiny_target, tmp_path, "intermediate_size=0")
