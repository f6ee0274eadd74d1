"""The bundled default models: each loads by its `default:` name, each drafter is lossless on them
(greedy speculative tokens = greedy autoregressive tokens), the README's demo config runs end to end,
and the GPU sweep config is a valid grid."""

import collections
import json
import os

import numpy as np
import pytest
from support.checkpoints import REPO

from specjax import cli, default_models
from specjax.config import ConfigError, SpecConfig
from specjax.decoding import generate
from specjax.experiments import RunConfig, grid_points, load_models, load_prompts, load_sweep
from specjax.proposers import PROPOSERS

# The methods of the demo and K-sweep configs.
SWEPT = ["dflash", "draft_model", "eagle", "eagle3", "medusa", "mtp", "ngram"]
METHODS = SWEPT + ["dspark"]


@pytest.fixture(scope="module")
def target_and_prompts():
    target, tokenizer, _ = load_models(default_models.TARGET, dtype="float32")
    prompts = load_prompts(RunConfig(target=default_models.TARGET, num_prompts=6, prompt_len=48), tokenizer)
    return target, prompts, generate(target, prompts, max_new_tokens=24)


def test_the_card_matches_the_bundled_files():
    package = default_models.path("target").parent
    card = json.loads((package / "model_card.json").read_text())
    # What the package ships (the packed weights, not their unpacked copies), under its cap.
    assert card["size_MB"] == round(default_models.shipped_bytes(package) / 1e6, 2) <= 56
    assert card["vocab_size"] == load_models(default_models.TARGET)[0].config.vocab_size
    for name in default_models.NAMES:
        assert (default_models.path(name) / "eval.json").exists()


@pytest.mark.loop
@pytest.mark.parametrize("method", METHODS)
def test_every_bundled_drafter_is_lossless_at_temperature_zero(target_and_prompts, method):
    target, prompts, autoregressive = target_and_prompts
    _, _, drafter = load_models(default_models.TARGET, method, dtype="float32")
    result = generate(target, prompts, max_new_tokens=24, spec=SpecConfig(method=method, num_speculative_tokens=4),
                      drafter=drafter)
    assert result.sequences() == autoregressive.sequences()
    if method != "ngram":  # trained: an untrained drafter's first token is accepted about 1% of the time
        assert result.metrics.summary()["per_position_acceptance"][0] > 0.15


@pytest.fixture(scope="module")
def sixteen_ragged_rows_with_eos():
    """16 held-out prompts of 16 to 46 tokens with budgets of 24 to 36, the target's most frequent
    generated token as EOS (rows stop inside accepted paths), and the greedy autoregressive output with it: each
    row's plain greedy output up to its first EOS, kept (what decoding with that EOS emits; cut on the host, not
    decoded again with EOS as a static setting of its own program), and whether the row stopped there."""
    target, tokenizer, _ = load_models(default_models.TARGET, dtype="float32")
    prompts = load_prompts(RunConfig(target=default_models.TARGET, num_prompts=16, prompt_len=48), tokenizer)
    prompts = [prompt[:16 + 2 * row] for row, prompt in enumerate(prompts)]
    budgets = [24 + 4 * (row % 4) for row in range(16)]
    plain = generate(target, prompts, max_new_tokens=budgets).sequences()
    eos = collections.Counter(token for row in plain for token in row).most_common(1)[0][0]
    expected = [row[:row.index(eos) + 1] if eos in row else row for row in plain]
    return target, prompts, budgets, eos, expected, np.array([eos in row for row in plain])


@pytest.mark.loop
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_dynamic_trees_of_the_bundled_heads_are_lossless_at_temperature_zero(sixteen_ragged_rows_with_eos, method):
    """EAGLE-2 trees (depth 4, top-4, 16 nodes) drafted by the trained heads: paths several drafts deep are
    accepted, and the tokens are the autoregressive ones."""
    target, prompts, budgets, eos, expected, stopped = sixteen_ragged_rows_with_eos
    _, _, head = load_models(default_models.TARGET, method, dtype="float32")
    spec = SpecConfig(method=method, num_speculative_tokens=4, total_tokens=16, tree_top_k=4)
    result = generate(target, prompts, max_new_tokens=budgets, eos_token_ids=[eos], spec=spec, drafter=head)
    assert result.sequences() == expected
    assert (result.stopped_by_eos == stopped).all() and stopped.sum() >= 4
    histogram = result.metrics.summary()["length_histogram"]
    assert histogram[3] + histogram[4] > 0, histogram


def test_unknown_default_names_are_refused():
    with pytest.raises(ValueError, match="default model 'eagle2' does not exist: allowed"):
        default_models.resolve("default:eagle2")
    with pytest.raises(ConfigError, match=r"SpecConfig.method = 'lookahead' is invalid: allowed one of "
                                          r"\['dflash', 'draft_model', 'dspark', 'eagle', 'eagle3', 'medusa', "
                                          r"'mtp', 'ngram'\]"):
        load_models(default_models.TARGET, "lookahead")


def test_every_registered_method_has_its_bundled_drafter():
    assert sorted(PROPOSERS) == sorted(METHODS)
    for method, proposer in PROPOSERS.items():
        if proposer.needs_drafter:
            assert (default_models.resolve(proposer.default_drafter) / "config.json").exists(), method
        else:
            assert proposer.default_drafter is None and proposer.load("unused", None, None, 1) is None


@pytest.mark.e2e
def test_the_demo_config_runs_end_to_end(tmp_path, capsys):
    """`make demo`'s sweep, on fewer and shorter prompts (its time on the CPU is docs/performance.md's): as many,
    as long (one prompt bucket) and as many new tokens as test_every_bundled_drafter_is_lossless_at_temperature_zero,
    so that its loops are the compiled ones of that test (persistent cache hits)."""
    assert cli.main(["sweep", str(REPO / "configs/demo.yaml"), "--set", f"output_dir={tmp_path}",
                     "--set", "base.num_prompts=6", "--set", "base.max_new_tokens=24"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted(row["method"] for row in rows) == sorted(SWEPT)
    assert all(row["greedy_identical_rows"] == row["prompts"] for row in rows)
    # The verifier that ran at T = 0 is the greedy one; DFlash drafts its whole block at K 4 by default.
    names = {method: method + {"dflash": " (full block)", "mtp": " (1 module)"}.get(method, "") for method in SWEPT}
    assert all(f"| {names[method]} | 4 | greedy | 0 | greedy |" in out for method in SWEPT), out
    # Understandable without the README: the AR tokens/s column, what rows = AR means, why speedups are below 1.
    assert "| AR tokens/s | tokens/s | speedup | rows = AR |" in out and "rows = AR: greedy rows whose" in out
    assert all(row["speedup"] >= 1 for row in rows) or "bound by kernel launches" in out
    assert "sweep: 100%" in captured.err and f"{len(SWEPT)}/{len(SWEPT)}" in captured.err
    assert {p.name for p in tmp_path.glob("*.png")} >= {"acceptance_vs_k.png", "speedup_vs_k.png"}


def test_the_k_sweep_config_is_the_full_grid():
    sweep = load_sweep(REPO / "configs/sweeps/k_sweep.yaml")
    assert sweep.grid["spec.num_speculative_tokens"] == list(range(1, 9))
    assert sorted(sweep.grid["spec.method"]) == sorted(SWEPT)
    with pytest.raises(ConfigError, match="k_sweep.yaml"):
        load_sweep(REPO / "configs/sweeps/k_sweep.yaml", ["grid.spec.method=[eagle, lookahead]"])


def test_the_eagle_tree_sweep_sets_a_trees_fields_together():
    """A grid value that is a mapping sets its config's fields at once (a dynamic tree's total_tokens and top_k
    are valid only together); a field it does not have is named."""
    points = grid_points(load_sweep(REPO / "configs/sweeps/eagle_tree.yaml"))
    trees = {(config.spec.total_tokens, config.spec.tree_top_k) for _, config in points}
    assert trees == {(None, None), (16, 2), (16, 4), (32, 3), (32, 4), (32, 8), (60, 4), (60, 8)}
    assert len(points) == 32 and {config.spec.num_speculative_tokens for _, config in points} == {6}
    with pytest.raises(ConfigError, match=r"grid key 'spec': SpecConfig has no field 'top_p': allowed \["):
        load_sweep(REPO / "configs/sweeps/eagle_tree.yaml", ["grid.spec=[{top_p: 0.5}]"])


@pytest.mark.e2e
def test_the_example_research_script_runs():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "scripts/example_research.py", "--prompts", "2", "--new-tokens", "8"],
                         cwd=REPO, check=True, capture_output=True, text=True)
    assert "2/2" in run.stdout and "block    mean acceptance length" in run.stdout


@pytest.mark.e2e
def test_a_sweep_records_points_the_drafter_cannot_run_and_goes_on(tmp_path):
    import yaml

    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump({
        "base": {"target": "default:target", "num_prompts": 2, "prompt_len": 16, "max_new_tokens": 8},
        "grid": {"spec.method": ["medusa"], "spec.num_speculative_tokens": [4, 5]}, "output_dir": str(tmp_path)}))
    assert cli.main(["sweep", str(config)]) == 0
    rows = {row["K"]: row for row in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    assert "skipped" not in rows[4] and rows[4]["greedy_identical_rows"] == 2
    assert rows[5]["skipped"] == "Medusa has 4 heads but num_speculative_tokens is 5: allowed K <= 4"
    assert "Skipped 1 points the drafter cannot run:\n- medusa K=5" in (tmp_path / "results.md").read_text()


def test_packed_weights_unpack_to_the_same_bytes_and_a_stale_copy_is_replaced(tmp_path):
    """The package ships its weights xz-packed (default_models.pack) and unpacks them at first use; an unpacked copy
    older than its packed file (a checkout brought new weights) is unpacked again."""
    weights = np.random.default_rng(0).standard_normal(1000).astype(np.float32).tobytes()
    (tmp_path / "model.safetensors").write_bytes(weights)
    default_models.pack(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    assert default_models.unpack(tmp_path) == tmp_path
    assert (tmp_path / "model.safetensors").read_bytes() == weights
    (tmp_path / "model.safetensors").write_bytes(b"stale")
    packed = tmp_path / "model.safetensors.xz"
    os.utime(packed, (packed.stat().st_atime, (tmp_path / "model.safetensors").stat().st_mtime + 10))
    default_models.unpack(tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == weights
    assert default_models.shipped_bytes(tmp_path) == packed.stat().st_size
