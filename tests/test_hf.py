"""Hugging Face checkpoints: logit parity with transformers (golden outputs), export / load round
trips, sharded checkpoints, and clear errors for bad checkpoints."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import fixture_dir, golden
from support.models import positions_like
from safetensors.numpy import load_file

from specjax.decoding import generate
from specjax.models import hf


def _forward_all(model, tokens):
    tokens = jnp.asarray(tokens)
    layers = tuple(range(model.config.num_layers))
    return model(tokens, positions_like(tokens), None, hidden_layers=layers)


def test_logits_and_hidden_states_match_transformers(hf_fixture):
    ref = golden(hf_fixture)
    model = hf.load(fixture_dir(hf_fixture))
    logits, hidden, _ = _forward_all(model, ref["input_ids"])
    np.testing.assert_allclose(np.asarray(logits), ref["logits"], atol=1e-4, rtol=0)
    # transformers' hidden_states: [embeddings, layer outputs...], the last one after the final norm.
    num_layers = model.config.num_layers
    np.testing.assert_allclose(np.asarray(hidden.layers), ref["hidden_states"][:num_layers], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(hidden.final), ref["hidden_states"][num_layers], atol=1e-4, rtol=0)


@pytest.mark.loop
def test_greedy_generate_matches_transformers(hf_fixture):
    ref = golden(hf_fixture)
    model = hf.load(fixture_dir(hf_fixture))
    prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)]
    result = generate(model, prompts, max_new_tokens=12)  # one ragged batch
    for i, tokens in enumerate(result.sequences()):
        assert tokens == ref[f"greedy_{i}"].tolist(), f"prompt {i}"


def test_export_writes_the_checkpoint_transformers_wrote(hf_fixture, tmp_path):
    """load -> save gives back the transformers-written tensors bit for bit, and a config.json that
    specjax reads as the same model; with identical tensors transformers computes identical logits
    (tests/test_hf_torch.py checks that live where torch is installed)."""
    source = fixture_dir(hf_fixture)
    model = hf.load(source)
    hf.save(model, tmp_path, max_shard_bytes=100_000)
    original = {}
    for path in source.glob("*.safetensors"):
        original.update(load_file(path))
    exported = {}
    for path in tmp_path.glob("*.safetensors"):
        exported.update(load_file(path))
    assert exported.keys() == original.keys()
    for key in original:
        np.testing.assert_array_equal(exported[key], original[key], err_msg=key)
    assert hf.load_config(tmp_path) == hf.load_config(source)


def test_save_then_load_gives_identical_params(hf_fixture, tmp_path):
    model = hf.load(fixture_dir(hf_fixture))
    hf.save(model, tmp_path)
    reloaded = hf.load(tmp_path)
    assert reloaded.config == model.config
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(reloaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sharded_checkpoint_loads_as_the_single_file_one():
    assert (fixture_dir("llama_sharded") / hf.INDEX_FILE).exists()
    sharded, single = hf.load(fixture_dir("llama_sharded")), hf.load(fixture_dir("llama_gqa"))
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_export_round_trips(tmp_path):
    model = hf.load(fixture_dir("llama_gqa"), param_dtype="bfloat16")
    hf.save(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = hf.load(tmp_path)
    assert reloaded.config.param_dtype == "bfloat16"
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(reloaded), strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# ------------------------------------------------------------------------------------ bad checkpoints

def _copy(name, tmp_path):
    target = tmp_path / name
    shutil.copytree(fixture_dir(name), target)
    return target


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def _rewrite_tensors(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    from safetensors.numpy import save_file
    save_file(tensors, path, metadata={"format": "pt"})


def test_unsupported_architecture_names_it_and_the_allowed_ones(tmp_path):
    folder = _copy("llama_gqa", tmp_path)
    _edit_config(folder, architectures=["BertForMaskedLM"])
    with pytest.raises(hf.CheckpointError, match=r"'BertForMaskedLM' is not supported: allowed .*LlamaForCausalLM"):
        hf.load(folder)


def test_config_missing_a_field_names_the_field_and_file(tmp_path):
    folder = _copy("qwen2", tmp_path)
    _edit_config(folder, num_hidden_layers=None)
    with pytest.raises(hf.CheckpointError, match=r"config.json: field 'num_hidden_layers' is missing"):
        hf.load(folder)


def test_unsupported_rope_type_is_refused(tmp_path):
    folder = _copy("llama3_rope", tmp_path)
    _edit_config(folder, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(hf.CheckpointError, match=r"rope type 'yarn' is not supported: allowed"):
        hf.load(folder)


def test_missing_tensor_is_named(tmp_path):
    folder = _copy("llama_gqa", tmp_path)
    _rewrite_tensors(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(hf.CheckpointError, match=r"tensor 'model.layers.1.mlp.up_proj.weight' is missing"):
        hf.load(folder)


def test_misshaped_tensor_names_both_shapes(tmp_path):
    folder = _copy("gpt2", tmp_path)
    _rewrite_tensors(folder, lambda t: t.update({"transformer.h.0.attn.c_attn.weight": np.zeros((64, 190), np.float32)}))
    with pytest.raises(hf.CheckpointError, match=r"'transformer.h.0.attn.c_attn.weight' has shape \(64, 190\); expected \(64, 192\)"):
        hf.load(folder)


def test_unexpected_tensor_is_refused(tmp_path):
    folder = _copy("llama_gqa", tmp_path)
    _rewrite_tensors(folder, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((96, 64), np.float32)}))
    with pytest.raises(hf.CheckpointError, match=r"tensors not used by LlamaForCausalLM: \['model.layers.2"):
        hf.load(folder)


def test_corrupt_safetensors_file_is_detected(tmp_path):
    folder = _copy("llama_gqa", tmp_path)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])  # truncated download
    with pytest.raises(hf.CheckpointError, match=r"model.safetensors"):
        hf.load(folder)


def test_missing_shard_is_named(tmp_path):
    folder = _copy("llama_sharded", tmp_path)
    (folder / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(hf.CheckpointError, match=r"model-00002-of-00004.safetensors: shard named in"):
        hf.load(folder)


def test_folder_without_weights_or_config_is_refused(tmp_path):
    with pytest.raises(hf.CheckpointError, match="no config.json|no model.safetensors"):
        hf.load(tmp_path)


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa", "llama_sharded", "qwen3", "mistral"])
def test_every_supported_lm_checkpoint_is_recognized_as_a_draft_model_only(name):
    """`specjax generate --draft FOLDER` without --method: each proposer's `recognizes` (tensor names and
    config.json), here on the LM fixtures (GPT-2's embedding is `wte`, sharded ones go through the index)."""
    from specjax.experiments import recognized_method
    from specjax.proposers import PROPOSERS

    assert [m for m, proposer in PROPOSERS.items() if proposer.recognizes(fixture_dir(name))] == ["draft_model"]
    assert recognized_method(fixture_dir(name)) == "draft_model"
    assert hf.tensor_names(fixture_dir(name) / "nowhere") == set()
    assert hf.config_json_or_empty(fixture_dir(name) / "nowhere") == {}


@pytest.mark.parametrize("method, folder, message", [
    ("eagle", "default:eagle3", "drafter folder default:eagle3 holds an EAGLE-3 head, not an EAGLE-1 head: use "
                                "spec.method eagle3"),
    ("eagle3", "default:dflash", "drafter folder default:dflash holds a DFlash drafter, not an EAGLE-3 head: use "
                                 "spec.method dflash"),
    ("medusa", "default:eagle1", "drafter folder default:eagle1 holds an EAGLE-1 head, not Medusa heads: use "
                                 "spec.method eagle"),
    ("eagle", "/nonexistent/eagle", "drafter folder /nonexistent/eagle does not exist"),
])
def test_a_drafter_folder_of_another_kind_is_named_before_any_tensor_shape(method, folder, message):
    """Runs and the CLI load drafters through experiments.load_drafter: a folder another method recognizes is
    refused naming that method, not with a tensor-shape error (issue 35)."""
    from specjax.config import ConfigError
    from specjax.experiments import load_drafter

    with pytest.raises(ConfigError) as error:
        load_drafter(method, folder, target=None)
    assert str(error.value) == message
