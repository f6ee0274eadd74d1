"""Head training from stored target features (offline) against the target in the step (online): the same loss
and gradients for the same batch; and scripts/bench_train_head.py end to end on the tiny shape."""

import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.models import eagle_config, target_and_drafts

from specjax.models.eagle import init_eagle
from specjax.training.eagle import (TargetVocabulary, eagle1_head_loss, eagle1_loss, eagle3_head_loss, eagle3_loss,
                                    target_hidden)

ROOT = Path(__file__).resolve().parents[1]


def losses_and_grads(version: int, stored_batch_seed: int):
    """(online, offline) (loss, grads) of a head on one batch; offline reads the target's hidden states of the
    batch drawn with stored_batch_seed, computed by a separate program and kept as host arrays."""
    target, _ = target_and_drafts()
    batch = jnp.asarray(np.random.default_rng(5).integers(0, 100, (2, 17)), jnp.int32)
    stored_batch = jnp.asarray(np.random.default_rng(stored_batch_seed).integers(0, 100, (2, 17)), jnp.int32)
    config = eagle_config(target.config, version, **({} if version == 1 else {"draft_vocab_size": 100}))
    head = init_eagle(config, seed=3)
    if version == 3:  # a draft vocabulary that is not the first ids, so that a misplaced column would show
        head.draft_to_target.set_value(jnp.asarray(np.sort(np.random.default_rng(1).choice(
            target.config.vocab_size, 100, replace=False)), jnp.int32))
    stored = jax.device_get(jax.jit(target_hidden, static_argnums=2)(target, stored_batch, config.fuse_layers))
    vocabulary = TargetVocabulary.of(target)
    noise = jnp.asarray(np.random.default_rng(2).uniform(-0.1, 0.1, (2, 16, target.config.hidden_size)), jnp.float32)
    if version == 1:
        online = lambda h: eagle1_loss(h, target, batch, noise)[0]  # noqa: E731
        offline = lambda h: eagle1_head_loss(h, vocabulary, batch, stored, noise)[0]  # noqa: E731
    else:
        online = lambda h: eagle3_loss(h, target, batch, 3, 0.8)[0]  # noqa: E731
        offline = lambda h: eagle3_head_loss(h, vocabulary, batch, stored, 3, 0.8)[0]  # noqa: E731
    graphdef, params, rest = nnx.split(head, nnx.Param, ...)
    return [jax.jit(jax.value_and_grad(lambda p, f=f: f(nnx.merge(graphdef, p, rest))))(params)
            for f in (online, offline)]


@pytest.mark.train
@pytest.mark.parametrize("version", [1, 3])
def test_offline_head_loss_and_gradients_equal_online(version):
    (loss, grads), (offline_loss, offline_grads) = losses_and_grads(version, stored_batch_seed=5)
    np.testing.assert_allclose(offline_loss, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(offline_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # negative control: features stored for another batch give another loss
    (loss, _), (other_loss, _) = losses_and_grads(version, stored_batch_seed=6)
    assert abs(float(other_loss) - float(loss)) > 1e-3 * abs(float(loss)), (other_loss, loss)


@pytest.mark.e2e
def test_bench_train_head_runs_on_the_tiny_shape(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_train_head", ROOT / "scripts" / "bench_train_head.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--shape", "tiny", "--seq-len", "16", "--batch-sizes", "2", "--warmup", "1", "--pool", "2",
            "--unroll-steps", "2", "--in-process", "--out", str(tmp_path), "--profile-steps", "1"]
    with pytest.raises(SystemExit):  # the profiled step 6 and the step that ends its trace are not timed
        bench.main(argv + ["--steps", "8"])
    assert "--steps 8 must exceed 8" in capsys.readouterr().err
    out = bench.main(argv + ["--steps", "9"])
    rows = {row["mode"]: row for row in out["rows"]}
    assert set(rows) == {"online", "offline"} and not any("error" in row for row in rows.values()), rows
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["step_ms"] > 0 and row["head_gflop_per_token"] > 0
        assert row["peak_gib"] == "n/a"  # the CPU reports no device memory statistics
        # the CPU has no device kernels: the profile says so, and which trace it read
        assert "no device kernels" in row["profile"], row["profile"]
        profile = json.loads((tmp_path / f"profile_{row['mode']}_b2_layer.json").read_text())
        assert (profile["first_step"], profile["steps"]) == (6, 1) and "perfetto_trace" in profile["trace"]
    assert rows["online"]["target_gflop_per_token"] > 0 == rows["offline"]["target_gflop_per_token"]
    # the same batch, the same initial head: the first step's loss is the same from stored features
    np.testing.assert_allclose(rows["offline"]["first_loss"], rows["online"]["first_loss"], rtol=1e-3)
    text = (tmp_path / "results.md").read_text()
    assert "SpecForge" in text and "--shape tiny" in text
