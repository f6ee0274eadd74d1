"""Tiny trained weights the test suite uses, written under tests/fixtures/trained/ (committed: the suite
loads them instead of training them). Deterministic on one machine; from the repository root:

    PYTHONPATH=.:tests python scripts/make_test_fixtures.py [--only tiny_lm|dflash_llama_gqa]

- tiny_lm/: configs/train/tiny_lm.yaml trained for 800 steps of batch 8 (its own 40 steps give a target
  whose greedy output is one repeated token): the target the draft-training tests train for.
- dflash_llama_gqa/: a DFlash drafter (block 16, reading both layers of the llama_gqa fixture), trained
  for 300 steps on that target's greedy continuations of random prompts; the greedy-equality tests
  decode with it (tests/support/models.py::trained_dflash).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parent.parent


def make_tiny_lm(out: Path) -> None:
    from specjax.config import TrainConfig, load_yaml
    from specjax.training.lm import train_lm

    with tempfile.TemporaryDirectory() as run:
        overrides = ["optimizer.total_steps=800", "data.batch_size=8", "checkpoint_every=800", "log_every=100",
                     f"output_dir={run}"]
        train_lm(load_yaml(TrainConfig, REPO / "configs/train/tiny_lm.yaml", overrides))
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(Path(run) / "model", out)


def make_dflash(out: Path) -> None:
    import optax
    from flax import nnx
    from support.models import dflash_config, target_and_drafts

    from specjax.decoding import generate
    from specjax.models.dflash import init_dflash, load_dflash, save_dflash
    from specjax.training.dflash import dflash_loss, sample_anchors

    target, _ = target_and_drafts()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, 4).tolist() for _ in range(64)]
    text = np.asarray(generate(target, prompts, max_new_tokens=60).tokens)  # [64, 60]: greedy
    tokens = np.concatenate([np.asarray(prompts), text], axis=1)
    drafter = init_dflash(dflash_config(target.config, (0, 1), block_size=16), seed=0)
    graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
    optimizer = optax.adam(3e-3)

    @jax.jit
    def train_step(params, opt_state, batch, anchors):
        loss = lambda p: dflash_loss(nnx.merge(graphdef, p, rest), target, batch, anchors, 7.0, 1.0)[0]  # noqa: E731
        grads = jax.grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = optimizer.init(params)
    for _ in range(300):
        rows = rng.choice(len(tokens), 16, replace=False)
        anchors = sample_anchors(rng, 16, tokens.shape[1], 16, 8)
        params, opt_state = train_step(params, opt_state, jnp.asarray(tokens[rows]), jnp.asarray(anchors))
    trained = nnx.merge(graphdef, params, rest)
    shutil.rmtree(out, ignore_errors=True)
    save_dflash(trained, out)
    loaded = load_dflash(out, target.config)  # the file holds exactly the trained weights
    assert loaded.config == trained.config, (loaded.config, trained.config)
    for a, b in zip(jax.tree.leaves(nnx.state(loaded)), jax.tree.leaves(nnx.state(trained))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


FIXTURES = {"tiny_lm": make_tiny_lm, "dflash_llama_gqa": make_dflash}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=sorted(FIXTURES))
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "trained")
    args = parser.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")  # as the suite runs (tests/conftest.py)
    for name, make in FIXTURES.items():
        if args.only in (None, name):
            make(args.out / name)
            size = sum(f.stat().st_size for f in (args.out / name).rglob("*") if f.is_file())
            print(f"{args.out / name}: {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
