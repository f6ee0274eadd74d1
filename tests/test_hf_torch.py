"""Live parity against PyTorch transformers, where torch is installed (it is not a specjax
dependency: CI skips this file; the GPU machine and scripts/make_hf_fixtures.py's environment have it)."""

import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import fixture_dir
from support.models import positions_like

torch = pytest.importorskip("torch", reason="torch is not installed (it is not a specjax dependency)")
transformers = pytest.importorskip("transformers")

from specjax.decoding import generate  # noqa: E402
from specjax.models import hf  # noqa: E402


def _torch_model(folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager")
    return model.eval()


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def test_fresh_random_inputs_match_transformers(hf_fixture):
    tokens = np.random.default_rng(7).integers(0, 128, size=(3, 17))
    ours = hf.load(fixture_dir(hf_fixture))
    logits, _, _ = ours(jnp.asarray(tokens), positions_like(tokens))
    np.testing.assert_allclose(np.asarray(logits), _torch_logits(_torch_model(fixture_dir(hf_fixture)), tokens),
                               atol=1e-4, rtol=0)


def test_exported_checkpoint_loads_in_transformers_with_the_same_logits(hf_fixture, tmp_path):
    ours = hf.load(fixture_dir(hf_fixture))
    hf.save(ours, tmp_path)
    tokens = np.random.default_rng(8).integers(0, 128, size=(2, 11))
    logits, _, _ = ours(jnp.asarray(tokens), positions_like(tokens))
    np.testing.assert_allclose(np.asarray(logits), _torch_logits(_torch_model(tmp_path), tokens),
                               atol=1e-4, rtol=0)


@pytest.mark.loop
def test_greedy_generate_matches_transformers_live():
    folder = fixture_dir("llama_gqa")
    prompt = [5, 17, 99, 3, 42]
    model = _torch_model(folder)
    model.generation_config = transformers.GenerationConfig()  # no EOS: exactly max_new_tokens
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16,
                                  min_new_tokens=16)[0, len(prompt):].tolist()
    assert generate(hf.load(folder), [prompt], max_new_tokens=16).sequences()[0] == expected
