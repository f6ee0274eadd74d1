"""Checks the drafters' training tests share (DFlash and DSpark; the resume check also MTP)."""

import jax
import numpy as np
import pytest

from specjax.config import SpecConfig
from specjax.decoding import generate
from specjax.training import dflash as block_training
from specjax.training.evaluation import held_out_prompts
from specjax.training.loop import Checkpoints, read_metrics


def stopped_run_resumes(monkeypatch, config, reference_dir, load, total_steps: int, keys=("loss",), *,
                        trainer=block_training, draw_name="sample_anchors", train_name="train_dflash",
                        folder="drafter") -> None:
    """Stopped at step 27 (an exception in the batch pipeline: `trainer.draw_name`, called once a step), the run
    of `config` (`trainer.train_name`) restarts from its step-20 checkpoint and ends where the uninterrupted one
    in reference_dir did: the same metrics `keys` step by step, the same weights (`load` reads `folder`)."""
    output_dir = config.output_dir
    draw, train = getattr(trainer, draw_name), getattr(trainer, train_name)
    calls = []

    def stops_at_27(*args):
        calls.append(1)
        if len(calls) == 27:
            raise KeyboardInterrupt("stopped")
        return draw(*args)

    monkeypatch.setattr(trainer, draw_name, stops_at_27)
    with pytest.raises(KeyboardInterrupt):
        train(config)
    assert Checkpoints(f"{output_dir}/checkpoints").latest_step() == 20
    monkeypatch.setattr(trainer, draw_name, draw)
    train(config)

    resumed, reference = read_metrics(f"{output_dir}/metrics.jsonl"), read_metrics(reference_dir / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, total_steps + 1))
    for key in keys:
        assert [r[key] for r in resumed] == [r[key] for r in reference], key
    ours, theirs = load(f"{output_dir}/{folder}"), load(reference_dir / folder)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def drafts_losslessly(target, drafter, run_dir, method: str, num_draft: int) -> None:
    """Greedy speculative output with the trained drafter on 3 held-out prompts of the run is the target's."""
    held_out = np.memmap(run_dir / "tokens_held_out.bin", np.uint32, "r")
    prompts = held_out_prompts(held_out, 3, 24, seed=1)
    spec = SpecConfig(method=method, num_speculative_tokens=num_draft)
    assert generate(target, prompts, max_new_tokens=20, spec=spec, drafter=drafter).sequences() == \
        generate(target, prompts, max_new_tokens=20).sequences()
