"""MTP drafting (method 'mtp'): parity with MiMo's own PyTorch code (golden files of
scripts/make_mtp_fixtures.py), losslessness (greedy = autoregressive, chi-square with standard and block
verification and a negative control), the modules' caches after rejections, checkpoints, refusals."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import FIXTURES, fixture_dir, golden
from support.distributions import PROMPT, chi_square_pvalue, exact_joint, joint_counts_by_sampling, tiny_pair
from support.jaxpr import primitives, speculative_loop_args
from support.models import (EOS, assert_float32_close, forward, mtp_logits, mtp_modules, positions_like, target_and_drafts,
                            tiny_mtp_modules)
from support.requests import REQUESTS, autoregressive_outputs

from specjax import verify as verify_registry
from specjax.config import ConfigError, SamplingConfig, SpecConfig
from specjax.decoding import generate, speculative_loop
from specjax.engine import Engine, EngineConfig, Request
from specjax.experiments import recognized_method
from specjax.models import hf
from specjax.models.mtp import load_mtp, save_mtp
from specjax.models.transformer import Hidden
from specjax.proposers import Context, TargetOutput, build_proposer, check_spec, proposer_class
from specjax.verify import standard

T1 = SamplingConfig(temperature=1.0)


def mimo(num_modules: int):
    """The MiMo-layout fixture's target (a Qwen2 LM) and its MTP modules."""
    folder = FIXTURES / "mtp" / f"mimo{num_modules}"
    target = hf.load(folder)
    return target, load_mtp(folder, target.config)


# --------------------------------------------------------------------------- parity with MiMo's code

@pytest.mark.parametrize("num_modules", [1, 3])
def test_module_logits_equal_mimos_torch_code(num_modules):
    """Each module's logits over a sequence, chained and fed the target's hidden state, as MiMo's
    MiMoMTPLayers give them (float32, <= 1e-4); the target itself as MiMoForCausalLM's."""
    target, modules = mimo(num_modules)
    expected = golden(f"mtp{num_modules}")
    assert modules.config.num_modules == num_modules
    assert modules.config.hidden_state == "target"  # MiMo's default (sglang-jax PR #1256)
    ids = jnp.asarray(expected["input_ids"])
    logits, hidden, _ = forward(target, ids, positions_like(ids))
    np.testing.assert_allclose(logits, expected["logits"], atol=1e-4)
    for hidden_state in ("chained", "target"):
        module_logits = mtp_logits(modules, target, ids, hidden.final, hidden_state=hidden_state)
        np.testing.assert_allclose(module_logits, expected[f"module_logits_{hidden_state}"], atol=1e-4)


@pytest.mark.loop
@pytest.mark.parametrize("num_modules, num_draft", [(1, 3), (3, 3)])
def test_greedy_speculative_output_equals_mimos_greedy_output(num_modules, num_draft):
    """One module applied three times and three modules chained emit the torch target's greedy tokens."""
    target, modules = mimo(num_modules)
    expected = golden(f"mtp{num_modules}")
    prompts = [expected[f"prompt_{i}"].tolist() for i in range(3)]
    result = generate(target, prompts, max_new_tokens=16, drafter=modules,
                      spec=SpecConfig(method="mtp", num_speculative_tokens=num_draft))
    assert result.sequences() == [expected[f"greedy_{i}"].tolist() for i in range(3)]


# ------------------------------------------------------------------------------------ losslessness

@functools.cache
def greedy_modules():
    return mtp_modules(target_and_drafts()[0].config, num_modules=3)


@pytest.mark.loop
@pytest.mark.parametrize("num_draft, hidden_state", [(1, "chained"), (3, "target"), (5, "chained")])
def test_greedy_speculative_output_is_identical_to_autoregressive(num_draft, hidden_state):
    """Ragged prompts, EOS inside blocks; K 1 the first of the three modules, K 3 each once, K 5 all three and
    then the last twice more on its own output (issue 40's K 1, 3, 5)."""
    target = target_and_drafts()[0]
    prompts, budgets = REQUESTS["ragged"]()
    expected = autoregressive_outputs("ragged")
    spec = SpecConfig(method="mtp", num_speculative_tokens=num_draft, mtp_hidden_state=hidden_state)
    result = generate(target, prompts, max_new_tokens=budgets, eos_token_ids=[EOS], spec=spec, drafter=greedy_modules())
    assert result.sequences() == expected.sequences()
    assert (result.stopped_by_eos == expected.stopped_by_eos).all() and expected.stopped_by_eos.any()
    assert 0 < result.metrics.summary()["acceptance_rate"] < 1


def accept_all(target_probs, draft_tokens, draft_probs, keys):
    """Deliberately wrong: accepts every draft (then samples the bonus token from the target)."""
    n = jnp.full(draft_tokens.shape[:1], draft_tokens.shape[1], jnp.int32)
    return n, standard.verify(target_probs, draft_tokens, draft_probs, keys)[1]


@pytest.mark.slow
@pytest.mark.parametrize("verifier", ["standard", "block", "accept_all"])
def test_sampled_output_follows_the_target_distribution(verifier, monkeypatch):
    """Two chained modules drafting K 2 probabilistically: the first three tokens' joint distribution is the
    target's (chi-square) under standard and block verification; a verifier that accepts every draft (the
    negative control) fails the same test."""
    monkeypatch.setitem(verify_registry.VERIFIERS, "accept_all", verify_registry.Verifier(chain=accept_all, tree=None))
    spec = SpecConfig(method="mtp", num_speculative_tokens=2, rejection_sample_method=verifier,
                      draft_sample_method="probabilistic")
    counts, metrics, _ = joint_counts_by_sampling(spec, [T1], tiny_mtp_modules())
    p_value = chi_square_pvalue(counts[0], exact_joint(tiny_pair()[0], T1, PROMPT))
    if verifier == "accept_all":
        assert p_value < 1e-6
    else:
        assert 0 < metrics.summary()["acceptance_rate"] < 1
        assert p_value > 1e-4


@pytest.mark.loop
def test_generation_is_one_program_with_one_while_loop():
    target = target_and_drafts()[0]
    spec = SpecConfig(method="mtp", num_speculative_tokens=5, draft_sample_method="probabilistic")
    args, static = speculative_loop_args(target, greedy_modules(), [[1, 2, 3], [4] * 9], 10, spec, T1,
                                         eos_token_ids=(2,))
    prims = primitives(jax.make_jaxpr(functools.partial(speculative_loop, **static))(*args).jaxpr)
    assert [name for name, depth in prims if name == "while" and depth == 1] == ["while"]
    assert not [name for name, _ in prims if "callback" in name or "feed" in name]


# ------------------------------------------------------------------------------ caches after rejections

def test_module_caches_after_rejections_equal_a_fresh_prefill():
    """A step whose drafts are rejected (rows accept 0, 2 and all 3 of them, each with a correction token unlike
    the draft) leaves stale entries in the later modules' caches; the next propose repairs them: every module's
    entries of committed tokens then equal those of the modules prefilled afresh over the committed tokens."""
    target = target_and_drafts()[0]
    modules = greedy_modules()
    num_draft, size = 3, 40
    proposer = build_proposer(SpecConfig(method="mtp", num_speculative_tokens=num_draft), SamplingConfig(), size,
                              modules)
    params = proposer.bind(modules, target)
    init, jitted_propose, accept = (jax.jit(f) for f in (proposer.init, proposer.propose, proposer.accept))
    rng = np.random.default_rng(1)
    lengths = np.array([9, 14, 11])
    tokens = np.zeros((3, size), np.int32)
    tokens[:, :14] = rng.integers(0, 128, (3, 14))

    def hidden(rows):  # the target's final hidden states over each row's tokens (no cache: a full forward)
        rows = jnp.asarray(rows)
        return forward(target, rows, positions_like(rows))[1].final

    def fresh(tokens, lengths):
        return init(params, jnp.asarray(tokens), jnp.asarray(lengths),
                    TargetOutput(logits=None, hidden=Hidden(final=hidden(tokens), layers=None)))

    def propose(state, tokens, lengths):
        context = Context.of(jnp.asarray(tokens), jnp.asarray(lengths))
        return jitted_propose(params, state, context, jax.random.split(jax.random.key(0), 3))

    drafts, _, state = propose(fresh(tokens, lengths), tokens, lengths)
    drafts = np.asarray(drafts)
    accepted = np.array([0, 2, 3])
    block = tokens.copy()  # [..., x_n, d_1 .. d_K]: the verify block's hidden states are h_n .. h_{n+K}
    for row, n in enumerate(lengths - 1):
        block[row, n + 1:n + 1 + num_draft] = drafts[row]
    verify_hidden = np.asarray(hidden(block))
    verify_hidden = jnp.asarray(np.stack([verify_hidden[row, n:n + num_draft + 1]
                                          for row, n in enumerate(lengths - 1)]))
    next_token = np.array([(drafts[row, a] + 1) % 128 if a < num_draft else 5 for row, a in enumerate(accepted)])
    state = accept(state, jnp.asarray(accepted), jnp.asarray(next_token),
                   TargetOutput(logits=None, hidden=Hidden(final=verify_hidden, layers=None)))
    committed = tokens.copy()
    for row, (n, a) in enumerate(zip(lengths - 1, accepted)):
        committed[row, n + 1:n + 1 + a] = drafts[row, :a]
        committed[row, n + 1 + a] = next_token[row]
    new_lengths = lengths + accepted + 1
    stale = state.cache
    _, _, state = propose(state, committed, new_lengths)
    expected = fresh(committed, new_lengths).cache

    def entries(cache, module, row):  # module's entries of committed tokens: slots s with s + module + 1 <= n
        count = new_lengths[row] - 1 - module
        return np.concatenate([np.asarray(cache.k)[module, row, :count], np.asarray(cache.v)[module, row, :count]])

    differs = False
    for module in range(modules.config.num_modules):
        for row in range(3):
            assert_float32_close(entries(state.cache, module, row), entries(expected, module, row))
            differs |= not np.allclose(entries(stale, module, row), entries(expected, module, row), atol=1e-3)
    assert differs  # the rejections did leave stale entries, which the propose repaired


# ------------------------------------------------------------------------------------- checkpoints

def test_modules_save_and_load_in_mimos_layout(tmp_path):
    target, modules = mimo(3)
    save_mtp(modules, tmp_path / "mtp")
    loaded = load_mtp(tmp_path / "mtp", target.config)
    assert loaded.config == modules.config
    for a, b in zip(jax.tree.leaves(modules), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(a, b)
    assert recognized_method(tmp_path / "mtp") == "mtp"
    assert recognized_method(FIXTURES / "mtp" / "mimo3") == "mtp"  # a MiMo checkpoint: its MTP modules
    assert not proposer_class("mtp").recognizes(fixture_dir("qwen2"))


# ------------------------------------------------------------------------------------------ refusals

def test_bad_input_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"SpecConfig.num_speculative_tokens = 0 is invalid: allowed an integer >= 1"):
        SpecConfig(method="mtp", num_speculative_tokens=0)
    with pytest.raises(ConfigError, match=r"SpecConfig.mtp_hidden_state = 'first' is invalid"):
        check_spec(SpecConfig(method="mtp", mtp_hidden_state="first"))
    with pytest.raises(ConfigError, match=r"mtp_hidden_state = 'target' with method 'eagle' is invalid: allowed null"):
        check_spec(SpecConfig(method="eagle", mtp_hidden_state="target"))
    target = hf.load(fixture_dir("qwen2"))
    with pytest.raises(hf.CheckpointError, match=r"num_nextn_predict_layers = 0: a checkpoint for method 'mtp' needs "
                                                 r"MTP modules"):
        proposer_class("mtp").load(fixture_dir("qwen2"), target, None, 1)
    wide = mtp_modules(dataclasses.replace(target.config, hidden_size=32, head_dim=8), num_modules=1)
    with pytest.raises(ValueError, match=r"MTP modules hidden_size 32 differs from the target's 64"):
        generate(target, [[1, 2]], max_new_tokens=2, spec=SpecConfig(method="mtp"), drafter=wide)


# ------------------------------------------------------------------------------------------- the engine

@pytest.mark.loop
def test_the_engine_serves_arriving_requests_their_autoregressive_output():
    """Requests admitted a few at a time into 3 slots (rows leave and join while the modules' caches and
    hidden-state windows of the others go on) get the target's greedy tokens, with three modules at K 5."""
    target = target_and_drafts()[0]
    prompts, budgets = (x[:12] for x in REQUESTS["ragged"]())
    requests = [Request.make(f"r{i}", prompt, budget) for i, (prompt, budget) in enumerate(zip(prompts, budgets))]
    config = EngineConfig(max_num_seqs=3, max_model_len=64, spec=SpecConfig(method="mtp", num_speculative_tokens=5),
                          eos_token_ids=(EOS,), steps_per_visit=2, max_prefill_batch=2)
    engine, outputs, pending = Engine(target, config, drafter=greedy_modules()), {}, list(requests)
    while pending or engine.has_work():
        for _ in range(2):
            if pending:
                engine.add_request(pending.pop(0))
        outputs.update({o.request_id: list(o.tokens) for o in engine.step()})
    expected = generate(target, prompts, max_new_tokens=budgets, eos_token_ids=[EOS]).sequences()
    assert [outputs[r.request_id] for r in requests] == expected
