"""DSpark (`method: dspark`): DeepSpec's checkpoint layout, draft probabilities that are the distributions
the drafts were drawn from (against DFlash's on the same backbone, with the Markov bias of the previous
draft, top-k restricted or not), greedy output equal to autoregressive (K 4 and 15, ragged prompts, EOS
inside blocks), losslessness by chi-square with standard and block verification in one program and its
negative control, training (loss falls, a stopped run resumes exactly), and bad settings refused."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.block_training import drafts_losslessly, stopped_run_resumes
from support.checkpoints import REPO, drafter_run_config, train_through_cli
from support.distributions import TINY, chi_square_pvalue, exact_joint, joint_counts_by_sampling, tiny_pair
from support.models import EOS, dflash_config, dspark_drafter, forward, target_and_drafts
from support.requests import autoregressive_outputs, ragged_requests
from safetensors.numpy import load_file, save_file

from specjax.config import ConfigError, DSparkTrainConfig, SamplingConfig, SpecConfig
from specjax.decoding import generate
from specjax.models import hf
from specjax.models.dspark import load_dspark, save_dspark
from specjax.proposers import Context, TargetOutput, UnsupportedSpeculation, build_proposer, check_spec
from specjax.training import dflash as block_training
from specjax.training.confidence import confidence_against_margin, held_out_steps
from specjax.training.evaluation import held_out_prompts
from specjax.training.loop import read_metrics

T1 = SamplingConfig(temperature=1.0)


# ---------------------------------------------------------------------------------- DeepSpec's layout

def test_the_checkpoint_has_deepspecs_names_and_round_trips(tmp_path):
    target, _ = target_and_drafts()
    drafter = dspark_drafter(target.config, block_size=8, rank=4, head="gated")
    save_dspark(drafter, tmp_path / "d")
    tensors = load_file(tmp_path / "d/model.safetensors")
    vocab, hidden = target.config.vocab_size, target.config.hidden_size
    assert tensors["markov_head.markov_w1.weight"].shape == (vocab, 4)
    assert tensors["markov_head.markov_w2.weight"].shape == (vocab, 4)  # a torch Linear(r, V)
    assert tensors["confidence_head.proj.weight"].shape == (1, hidden + 4)
    assert tensors["confidence_head.proj.bias"].shape == (1,)
    assert tensors["markov_head.gate_proj.weight"].shape == (4, hidden + 4)  # the gated head's Linear(D + r, r)
    assert tensors["markov_head.gate_proj.bias"].shape == (4,)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= tensors.keys()
    raw = json.loads((tmp_path / "d/config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"]
    assert (raw["markov_rank"], raw["markov_head_type"]) == (4, "gated")
    assert raw["enable_confidence_head"] and raw["confidence_head_with_markov"] and raw["sample_from_anchor"]
    loaded = load_dspark(tmp_path / "d", target.config)
    assert loaded.config == drafter.config
    del raw["dflash_config"]  # DeepSpec writes its fields at the top level only
    (tmp_path / "d/config.json").write_text(json.dumps(raw))
    assert load_dspark(tmp_path / "d").config == drafter.config
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(drafter), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # DeepSpec's checkpoints carry copies of the target's embedding and LM head: not read; anything else is refused.
    tensors["embed_tokens.weight"] = np.zeros((vocab, hidden), np.float32)
    save_file(tensors, tmp_path / "d/model.safetensors", metadata={"format": "pt"})
    load_dspark(tmp_path / "d")
    tensors["markov_head.gate.weight"] = np.zeros((4,), np.float32)
    save_file(tensors, tmp_path / "d/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(hf.CheckpointError, match=r"not used by a DSpark drafter: \['markov_head.gate.weight'\]"):
        load_dspark(tmp_path / "d")


# ----------------------------------------------------------------------------- the drafts' distributions

def first_propose(drafter, target, prompt, spec):
    """(drafts [K], draft_probs [K, V], draft_confidence [K]) of the first propose after the prefill, at T 1."""
    proposer = build_proposer(spec, T1, 64, drafter)
    params = proposer.bind(drafter, target)
    logits, hidden, _ = forward(target, jnp.asarray([prompt]), jnp.arange(len(prompt))[None],
                                hidden_layers=proposer.hidden_layers)
    committed = jnp.asarray([prompt + [int(jnp.argmax(logits[0, -1]))]])
    lengths = jnp.asarray([committed.shape[1]])
    state = jax.jit(proposer.init)(params, committed, lengths, TargetOutput(logits=logits, hidden=hidden))
    drafts, probs, state = jax.jit(proposer.propose)(params, state, Context.of(committed, lengths, T1),
                                                     jax.random.split(jax.random.key(0), 1))
    confidence = getattr(state, "draft_confidence", None)  # DFlash keeps none
    confidence = None if confidence is None else np.asarray(confidence[0])
    return np.asarray(drafts[0]), np.asarray(probs[0], np.float64), confidence, int(committed[0, -1])


@pytest.mark.parametrize("topk", [None, 5])
def test_each_draft_probability_is_dflashs_with_the_markov_bias_of_the_draft_before(topk):
    """With the anchor-slot layout off, DSpark's backbone drafts as DFlash (same weights): draft k's probabilities
    are softmax(log q_k + W2 . W1[x_(k-1)]) over DFlash's q_k, restricted to q_k's top-k ids, x_0 the anchor and
    x_(k-1) the draft drawn before it; its confidence is the head's sigmoid on [h_k, W1[x_(k-1)]]."""
    target, _ = target_and_drafts()
    drafter = dspark_drafter(target.config, block_size=8, rank=4, sample_from_anchor=False, scale=1.0)
    prompt = [5, 17, 3, 99, 42]
    spec = SpecConfig(method="dspark", num_speculative_tokens=5, draft_sample_method="probabilistic",
                      dspark_draft_topk=topk)
    drafts, probs, confidence, anchor = first_propose(drafter, target, prompt, spec)
    base_spec = SpecConfig(method="dflash", num_speculative_tokens=5, draft_sample_method="probabilistic")
    _, base, _, _ = first_propose(dflash_of(drafter), target, prompt, base_spec)  # the backbone alone
    previous = np.concatenate([[anchor], drafts[:-1]])
    w1, w2 = (np.asarray(getattr(drafter, name)[...], np.float64) for name in ("markov_w1", "markov_w2"))
    logits = np.log(base) + w1[previous] @ w2
    if topk is not None:
        kth = np.sort(base, axis=-1)[:, -topk][:, None]
        logits = np.where(base >= kth, logits, -np.inf)
    expected = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(probs, expected / expected.sum(-1, keepdims=True), atol=2e-5, rtol=0)
    assert (probs[np.arange(5), drafts] > 0).all()
    assert not np.allclose(probs, base, atol=1e-3)  # the bias matters here
    assert confidence.shape == (5,) and ((0 < confidence) & (confidence < 1)).all()


def dflash_of(drafter):
    """A DFlashDrafter over the DSpark drafter's backbone arrays."""
    from specjax.models.dflash import DFlashConfig, init_dflash

    config = DFlashConfig(**{f.name: getattr(drafter.config, f.name) for f in dataclasses.fields(DFlashConfig)})
    plain = init_dflash(config)
    for name in ("fc", "hidden_norm", "layers", "final_norm"):
        setattr(plain, name, getattr(drafter, name))
    return plain


# ---------------------------------------------------------------------------- greedy = autoregressive

@pytest.mark.loop
@pytest.mark.parametrize("num_draft, head, options", [(4, "vanilla", {}), (8, "vanilla", {}),
                                                     (15, "gated", {"dspark_draft_topk": 6})],
                         ids=["K4", "K8", "K15-gated-top6"])
def test_greedy_speculative_output_is_identical_to_autoregressive(num_draft, head, options):
    """56 ragged prompts, budgets of 1-24 tokens, some rows ending at an EOS inside a block; block 16 with the
    anchor's slot drafting, part of the block (K 4, 8) and all of it (K 15 of its 16, the gated head drafting
    from its top 6), random heads: drafts are accepted now and then. (K is a shape: each case is its own
    program; issue 39 names K 4, 8 and 15.)"""
    target, _ = target_and_drafts()
    drafter = dspark_drafter(target.config, block_size=16, rank=8, head=head)
    expected = autoregressive_outputs()
    prompts, budgets = ragged_requests()
    spec = SpecConfig(method="dspark", num_speculative_tokens=num_draft, **options)
    result = generate(target, prompts, max_new_tokens=budgets, eos_token_ids=[EOS], spec=spec, drafter=drafter)
    assert result.sequences() == expected.sequences()
    assert (result.stopped_by_eos == expected.stopped_by_eos).all() and expected.stopped_by_eos.any()
    assert 0 < result.metrics.summary()["acceptance_rate"] < 1


# ------------------------------------------------------------------------------- exact distribution

LOSSLESS_ALPHA = 1e-4  # test_lossless.py's threshold
GREEDY_ROWS = 64
SAMPLINGS = (T1, SamplingConfig(temperature=1.0, top_k=5))


def tiny_dspark():
    """A gated DSpark drafter for tiny_pair()'s target (8 ids, one layer), Markov bias large enough to matter
    (the vanilla head's draft probabilities are checked exactly above)."""
    return dspark_drafter(TINY, block_size=4, rank=4, scale=1.0, layer_ids=(0,), seed=6, head="gated")


def tiny_spec(verifier: str) -> SpecConfig:
    return SpecConfig(method="dspark", num_speculative_tokens=2, rejection_sample_method=verifier,
                      draft_sample_method="probabilistic", dspark_draft_topk=6)


@pytest.mark.slow
def test_speculative_sampling_is_lossless_with_standard_and_block_verification():
    """Probabilistic drafting from the top-6 candidates with the gated Markov bias, T 1 and top-k 5 rows beside
    greedy rows; standard and block verification are one program (the rule is data: verify.method_index)."""
    target = tiny_pair()[0]
    for verifier in ("standard", "block"):
        counts, metrics, greedy_tokens = joint_counts_by_sampling(tiny_spec(verifier), SAMPLINGS, tiny_dspark(),
                                                                  greedy_rows=GREEDY_ROWS)
        assert 0 < metrics.summary()["acceptance_rate"] < 1
        assert (greedy_tokens == generate(target, [[1, 5, 2]], max_new_tokens=3).tokens[0]).all()
        for sampling, sampling_counts in zip(SAMPLINGS, counts):
            p_value = chi_square_pvalue(sampling_counts, exact_joint(target, sampling))
            assert p_value > LOSSLESS_ALPHA, (verifier, sampling, p_value)


@pytest.mark.slow
def test_negative_control_draft_probabilities_without_the_markov_bias_fail(monkeypatch):
    """The same check catches a DSpark whose reported q leaves out the Markov bias it drew with."""
    import specjax.proposers.dspark as dspark_proposer

    draw = dspark_proposer.draw_draft_tokens
    bias = {}

    def biased(self, *args):
        bias["last"] = original(self, *args)
        return bias["last"]

    def mislabelled(logits, keys, settings, sampling):
        tokens, _ = draw(logits, keys, settings, sampling)
        return tokens, draw(logits - bias["last"], keys, settings, sampling)[1]

    original = dspark_proposer.DSparkDrafter.markov_bias
    monkeypatch.setattr(dspark_proposer.DSparkDrafter, "markov_bias", biased)
    monkeypatch.setattr(dspark_proposer, "draw_draft_tokens", mislabelled)
    jax.clear_caches()  # traced again with the patch; the program is not kept for other tests
    try:
        counts, _, _ = joint_counts_by_sampling(tiny_spec("standard"), SAMPLINGS[:1], tiny_dspark())
    finally:
        jax.clear_caches()
    assert chi_square_pvalue(counts[0], exact_joint(tiny_pair()[0], T1)) < 1e-6


# ------------------------------------------------------------------------------------------ training

CONFIG, TOTAL_STEPS = REPO / "configs/train/tiny_dspark.yaml", 40  # its steps; it checkpoints every 20
run_config = functools.partial(drafter_run_config, DSparkTrainConfig, CONFIG)  # (target_dir, output_dir, *overrides)


@pytest.fixture(scope="module")
def dspark_run(trained_tiny_target, tmp_path_factory):
    """Trained through the CLI (`specjax train-dspark`), as a user would."""
    return train_through_cli("train-dspark", CONFIG, trained_tiny_target, tmp_path_factory.mktemp("dspark"))


@pytest.mark.train
def test_the_drafter_trains_with_both_heads_and_drafts_losslessly(trained_tiny_target, dspark_run):
    records = read_metrics(dspark_run / "metrics.jsonl")
    losses = [r["loss"] for r in records]
    assert len(losses) == TOTAL_STEPS and np.mean(losses[-5:]) < np.mean(losses[:5])
    target = hf.load(trained_tiny_target)
    drafter = load_dspark(dspark_run / "drafter", target.config)
    assert drafter.config.markov_rank == 16 and drafter.config.sample_from_anchor
    assert np.abs(np.asarray(drafter.markov_w2[...])).max() > 0  # trained away from its zero start
    drafts_losslessly(target, drafter, dspark_run, "dspark", 8)
    evaluation = json.loads((dspark_run / "drafter/eval.json").read_text())
    assert evaluation["kind"] == "dspark" and evaluation["final_loss"] == losses[-1]
    assert evaluation["mean_acceptance_length"] > 1


@pytest.mark.train
def test_the_trained_confidence_head_ranks_accepted_drafts_above_rejected_ones(trained_tiny_target, dspark_run):
    """On held-out steps (specjax.training.confidence: the target's greedy continuations of held-out prompts,
    each draft given the ones before it accepted) the trained head's AUC is well above a zero head's 0.5
    (about 4,600 scored drafts: one standard error is about 0.01)."""
    target = hf.load(trained_tiny_target)
    drafter = load_dspark(dspark_run / "drafter", target.config)
    held_out = np.memmap(dspark_run / "tokens_held_out.bin", np.uint32, "r")
    steps = held_out_steps(target, drafter, held_out_prompts(held_out, 64, 16, seed=1), 48, batch=16)
    scores = confidence_against_margin(steps)
    print(scores)
    assert scores["scored_drafts"] > 2000 and 0.2 < scores["accepted_fraction"] < 0.95
    assert scores["auc_confidence_head"] > 0.6


def test_the_confidence_heads_labels_are_each_drafts_acceptance_given_the_ones_before():
    """observed_acceptance on a hand-made block of 4 drafts (DSpark's layout: slot j drafts j + 1): drafts 1, 2
    and 4 equal the target's argmax, 3 does not; draft 4 is outside the population (3 was rejected)."""
    vocab = 5
    wanted, drafted = np.array([1, 2, 3, 4]), np.array([1, 2, 0, 4])
    outputs = {"logits": jnp.asarray(np.eye(vocab)[drafted][None, None]),
               "target_logits": jnp.asarray(np.eye(vocab)[wanted][None, None]), "draft_index": np.arange(4) + 1}
    accepted, conditioned = block_training.observed_acceptance(outputs)
    np.testing.assert_array_equal(np.asarray(accepted)[0, 0], [1, 1, 0, 1])
    np.testing.assert_array_equal(np.asarray(conditioned)[0, 0], [1, 1, 1, 0])


@pytest.mark.train
def test_a_stopped_run_resumes_to_the_uninterrupted_result(trained_tiny_target, dspark_run, tmp_path, monkeypatch):
    """Stopped at step 27, the run restarts from its step-20 checkpoint and ends where the uninterrupted one
    did: the same losses and confidence losses step by step, the same weights, heads included (resume_check)."""
    stopped_run_resumes(monkeypatch, run_config(trained_tiny_target, tmp_path), dspark_run, load_dspark, TOTAL_STEPS,
                        keys=("loss", "confidence_loss"))


# ------------------------------------------------------------------------------------ bad settings

def test_bad_settings_are_refused(tmp_path):
    target, _ = target_and_drafts()
    drafter = dspark_drafter(target.config, block_size=8, rank=4)
    with pytest.raises(ConfigError, match=r"DSparkConfig.markov_rank = -1 is invalid: allowed an integer >= 0"):
        dataclasses.replace(drafter.config, markov_rank=-1)
    with pytest.raises(ConfigError, match=r"DSparkConfig.markov_head_type = 'rnn' is invalid: allowed one of "
                                          r"\['vanilla', 'gated'\]"):
        dataclasses.replace(drafter.config, markov_head_type="rnn")
    with pytest.raises(ConfigError, match=r"SpecConfig.dspark_draft_topk = 0 is invalid: allowed null, or an integer "
                                          r">= 1"):
        check_spec(SpecConfig(method="dspark", dspark_draft_topk=0))
    with pytest.raises(ConfigError, match=r"dspark_draft_topk = 4 with method 'dflash' is invalid: allowed null"):
        check_spec(SpecConfig(method="dflash", dspark_draft_topk=4))
    vocab = target.config.vocab_size
    with pytest.raises(ValueError, match=rf"dspark_draft_topk = {vocab + 1} is invalid: allowed null or 1..{vocab}"):
        generate(target, [[3, 4]], max_new_tokens=2, drafter=drafter,
                 spec=SpecConfig(method="dspark", dspark_draft_topk=vocab + 1))
    # K past the block: 8 with the anchor's slot drafting, 7 without.
    with pytest.raises(UnsupportedSpeculation, match=r"num_speculative_tokens = 9 .*allowed 1..8 \(block_size\)"):
        generate(target, [[3, 4]], max_new_tokens=2, drafter=drafter,
                 spec=SpecConfig(method="dspark", num_speculative_tokens=9))
    dflash_layout = dspark_drafter(target.config, block_size=8, rank=4, sample_from_anchor=False)
    with pytest.raises(UnsupportedSpeculation, match=r"num_speculative_tokens = 8 .*allowed 1..7 \(block_size - 1\)"):
        generate(target, [[3, 4]], max_new_tokens=2, drafter=dflash_layout,
                 spec=SpecConfig(method="dspark", num_speculative_tokens=8))
    with pytest.raises(ValueError, match=r"method 'dspark' needs a DSparkDrafter as drafter, got DFlashDrafter"):
        generate(target, [[3, 4]], max_new_tokens=2, drafter=dflash_of(drafter), spec=SpecConfig(method="dspark"))
    for override, message in (("markov_rank=-2", r"DSparkTrainConfig.markov_rank = -2 is invalid"),
                              ("confidence_head_alpha=-1", r"DSparkTrainConfig.confidence_head_alpha = -1"),
                              ("data.seq_len=8", r"DSparkTrainConfig.data.seq_len = 8 is invalid: allowed an integer "
                                                 r">= 9 \(block_size \+ 1 with sample_from_anchor\)")):
        with pytest.raises(ConfigError, match=message):
            run_config("unused", tmp_path, override)
