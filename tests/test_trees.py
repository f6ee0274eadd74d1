"""Draft trees in the speculative loop (SpecConfig.speculative_token_tree; Medusa's sparse trees): greedy
output identical to autoregressive on a ragged batch of 16 rows with EOS inside accepted paths (one
while_loop: tests/test_speculative.py); at T > 0 the first three tokens follow the target exactly (chi-square), with the negative
control that a verifier accepting the first-ranked path fails the same test. A chi-square case holds all its sampling
settings in one batch and runs it with both verifiers, recursive rejection sampling and traversal verification,
through one compiled loop (asserted)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.distributions import check_lossless, first_ranked_pvalue, tiny_pair, tree_joint_counts
from support.models import EOS, forward, head_for, medusa_for, target_and_drafts
from support.requests import REQUESTS, autoregressive_outputs

from specjax.trees import sizing
from specjax.config import ConfigError, SamplingConfig, SpecConfig
from specjax.decoding import generate, speculative_loop
from specjax.proposers import UnsupportedSpeculation, build_proposer

# Medusa-style sparse trees: 2 candidates at depth 1, 2 + 1 under them, one more level under the best.
TREE = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
SMALL_TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0))


def tree_spec(tree=TREE, method="medusa", **options):
    return SpecConfig(method=method, num_speculative_tokens=max(map(len, tree)), speculative_token_tree=tree, **options)


@pytest.mark.loop
@pytest.mark.parametrize("method", ["medusa", "draft_model"])
def test_greedy_tree_output_is_identical_to_autoregressive(method):
    target, drafts = target_and_drafts()
    drafter = medusa_for(target, num_heads=3, num_layers=2, scale=0.05) if method == "medusa" else drafts["perturbed"]
    prompts, budgets = REQUESTS["ragged16"]()
    expected = autoregressive_outputs("ragged16")
    result = generate(target, prompts, max_new_tokens=budgets, eos_token_ids=[EOS], spec=tree_spec(method=method),
                      drafter=drafter)
    assert result.sequences() == expected.sequences()
    assert (result.stopped_by_eos == expected.stopped_by_eos).all() and expected.stopped_by_eos.any()
    histogram = result.metrics.summary()["length_histogram"]
    assert sum(histogram[2:]) > 0, histogram  # paths of depth >= 2 were accepted


SAMPLINGS = (SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7), SamplingConfig(temperature=1.0, top_k=2))


@functools.cache  # built once for the chi-square cases and the negative control
def tiny_heads():
    return medusa_for(tiny_pair()[0], num_heads=2, scale=0.5)


@pytest.mark.loop
@pytest.mark.slow
@pytest.mark.parametrize("drafting", ["greedy", "probabilistic"])
def test_tree_sampling_is_lossless(drafting):
    """Recursive rejection sampling ('standard') and traversal verification ('block') at T 1, T 0.7 and top-k 2,
    one batch per verifier. Greedy drafting: each head's top-k (q one-hot); probabilistic: draws without
    replacement (with top-k 2, a third sibling's draw has no probability left and is fixed)."""
    heads = tiny_heads()
    check_lossless(tree_joint_counts(tree_spec(SMALL_TREE, draft_sample_method=drafting), SAMPLINGS, heads), SAMPLINGS)


@pytest.mark.loop
@pytest.mark.slow
def test_draft_model_tree_sampling_is_lossless():
    """A draft model's tree (its top-k at each node, written into its own cache and moved after acceptance), at
    T 1 and T 0.7 with top-k 5, with either verifier."""
    samplings = (SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=5))
    counts = tree_joint_counts(tree_spec(SMALL_TREE, method="draft_model"), samplings, tiny_pair()[1])
    check_lossless(counts, samplings)


@pytest.mark.loop
@pytest.mark.slow
def test_negative_control_accepting_the_first_ranked_path_fails(monkeypatch):
    heads = tiny_heads()
    assert first_ranked_pvalue(monkeypatch, tree_spec(SMALL_TREE), heads) < 1e-6


def test_trees_are_refused_where_they_are_not_built():
    with pytest.raises(ConfigError, match="rejection_sample_method"):
        tree_spec(rejection_sample_method="typical")
    target, _ = target_and_drafts()
    with pytest.raises(UnsupportedSpeculation, match="drafts chains only"):
        generate(target, [[1, 2]], max_new_tokens=4,
                 spec=SpecConfig(method="ngram", num_speculative_tokens=1, speculative_token_tree=((0,), (1,))))
    # A tree deeper than the drafter drafts: three levels for two Medusa heads.
    with pytest.raises(UnsupportedSpeculation, match=r"Medusa has 2 heads but num_speculative_tokens is 3: allowed K <= 2"):
        generate(target, [[1, 2]], max_new_tokens=4, spec=tree_spec(), drafter=medusa_for(target, num_heads=2))


@pytest.mark.parametrize("tree, message", [
    ([[0, 0]], "every path after its parent"), ([[0], [0]], "each path once"), ([[0], [1]], "deepest path of"),
    ([[0], [-1]], "integers >= 0"), ([], "non-empty list")])
def test_a_malformed_tree_is_a_config_error_naming_the_problem(tree, message):
    with pytest.raises(ConfigError, match=message):
        SpecConfig(method="medusa", num_speculative_tokens=2, speculative_token_tree=tree)


@pytest.mark.loop
def test_a_new_prompt_length_in_the_same_bucket_does_not_recompile():
    target, _ = target_and_drafts()
    heads = medusa_for(target, num_heads=3, scale=0.05)
    first = generate(target, [[3, 9, 27, 4, 1], [5, 1]], max_new_tokens=6, spec=tree_spec(), drafter=heads)
    compiled = speculative_loop._cache_size()
    second = generate(target, [[3, 9, 27, 4, 1, 8, 2], [6]], max_new_tokens=6, spec=tree_spec(), drafter=heads)
    assert speculative_loop._cache_size() == compiled
    assert first.sequences() != second.sequences()


@pytest.mark.e2e
def test_a_sweep_over_trees_plots_acceptance_against_tree_size(tmp_path):
    from specjax.experiments import plot

    rows = [dict(method="medusa", K=3, rejection_sample_method="standard", draft_sample_method="greedy", temperature=t,
                 tree_nodes=nodes, mean_acceptance_length=1 + 0.1 * (nodes or 3), speedup=1.0,
                 per_position_acceptance=[0.5, 0.3, 0.1]) for t in (0.0, 1.0) for nodes in (None, 6, 15)]
    trees, chains = tmp_path / "trees", tmp_path / "chains"
    trees.mkdir(), chains.mkdir()
    plot(rows, trees)
    assert (trees / "acceptance_vs_tree_size.png").stat().st_size > 10_000
    plot([row for row in rows if row["tree_nodes"] is None], chains)
    assert not (chains / "acceptance_vs_tree_size.png").exists()  # chains only: no tree plot


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_the_draft_models_cache_after_the_accepted_path_is_a_plain_prefill(tree):
    """propose writes the tree into the draft's cache (a static tree's node i at tree slot i, a dynamic tree's
    frontier at its draft slots); accept with a path moves it: the entries then equal those of a plain forward
    over the committed tokens and the path (keys, values), up to the path's last node, which (as the last
    committed token of a chain) the next propose writes again."""
    from specjax.proposers import Context, TargetOutput, build_proposer

    target, drafts = target_and_drafts()
    draft = drafts["perturbed"]
    spec = (tree_spec(method="draft_model") if tree == "static" else
            SpecConfig(method="draft_model", num_speculative_tokens=3, total_tokens=10, tree_top_k=2))  # every candidate
    proposer = build_proposer(spec, SamplingConfig(), 32, draft)
    committed = jnp.asarray([[5, 9, 2, 7, 1, 3]])
    hidden = forward(target, committed[:, :-1], jnp.arange(5)[None])[1]
    state = jax.jit(proposer.init)(draft, committed, jnp.asarray([6]), TargetOutput(None, hidden))
    tokens, _, state = jax.jit(proposer.propose)(draft, state, Context.of(committed, jnp.asarray([6])),
                                                 jax.random.key(0)[None])
    parents = np.asarray(proposer.tree_parents(state, 1))[0].tolist()
    depths = [len(path_of(parents, i)) for i in range(len(parents))]
    path = path_of(parents, int(np.argmax(depths)))  # to a deepest node
    assert len(path) == spec.num_speculative_tokens
    padded = jnp.asarray([path + [-1] * (spec.num_speculative_tokens - len(path))])
    state = jax.jit(proposer.accept)(state, jnp.asarray([len(path)]), jnp.asarray([0]),
                                     TargetOutput(None, hidden, path=padded))
    sequence = jnp.concatenate([committed, tokens[:, jnp.asarray(path)]], axis=1)  # [1, 6 + depth]
    _, _, plain = forward(draft, sequence, jnp.arange(sequence.shape[1])[None], draft.create_cache(1, 32))
    n = sequence.shape[1] - 1
    for layer in range(draft.config.num_layers):
        for got, want in zip(state.cache.layer(layer), plain.layer(layer)):
            np.testing.assert_allclose(np.asarray(got)[0, :n], np.asarray(want)[0, :n], atol=1e-5, rtol=0)


def path_of(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's child down to node."""
    path = []
    while node >= 0:
        path.insert(0, node)
        node = parents[node]
    return path


def test_a_draft_model_tree_must_be_listed_by_depth():
    target, drafts = target_and_drafts()
    with pytest.raises(UnsupportedSpeculation, match="by depth"):
        generate(target, [[1, 2]], max_new_tokens=4, drafter=drafts["perturbed"],
                 spec=tree_spec(((0,), (0, 0), (1,)), method="draft_model"))


@functools.partial(jax.jit, static_argnums=0)
def chain_step(proposer, params, feature, tokens, positions, cache):
    """The head's log-probabilities at `feature`, and one pair (feature, token) through the head as a chain."""
    out, cache = params.head(tokens.reshape(-1, 1), feature[:, None], positions[:, None], cache, params.embed)
    return jax.nn.log_softmax(proposer.logits(params, feature)), (out[:, 0], cache)


@jax.jit
def pending_pairs(params, state):
    """The head's output at each row's last pending pair (the root's feature), its cache holding the pending
    pairs, and its fill level: the pending pairs through the head the plain way."""
    head, width = params.head, state.tokens.shape[1]
    positions = state.committed[:, None] + jnp.arange(width)[None]
    out, cache = head(state.tokens, head.fuse(state.hidden), positions, state.cache.with_lengths(state.committed),
                      params.embed)
    fill = state.committed + state.num_pending
    return out[jnp.arange(out.shape[0]), state.num_pending - 1], cache.with_lengths(fill), fill


def dynamic_tree_and_reference(name: str, tree_top_k: int, total_tokens: int, depth: int = 3):
    """One dynamic tree drafted by an EAGLE head for two ragged rows, and, per node, the head's
    log-probabilities at its parent computed the plain way: the pending pairs, then the node's path
    fed as a chain (one pair at a time, each seeing the committed pairs and the path before it)."""
    from specjax.proposers import Context, TargetOutput, build_proposer

    target, _ = target_and_drafts()
    spec = SpecConfig(method=name, num_speculative_tokens=depth, total_tokens=total_tokens, tree_top_k=tree_top_k)
    proposer = build_proposer(spec, SamplingConfig(), 64, head_for(name))
    params = proposer.bind(head_for(name), target)
    committed, lengths = jnp.asarray([[5, 9, 2, 7, 1, 3], [4, 4, 8, 1, 0, 0]]), jnp.asarray([6, 4])
    hidden = forward(target, committed[:, :-1], jnp.arange(5)[None].repeat(2, 0),
                     hidden_layers=proposer.hidden_layers)[1]
    state = jax.jit(proposer.init)(params, committed, lengths, TargetOutput(None, hidden))
    tokens, probs, drafted = jax.jit(proposer.propose)(params, state, Context.of(committed, lengths),
                                                       jax.random.key(0)[None])
    assert probs is None  # top-k drafts: q = 1 to the verifier
    root, cache, fill = pending_pairs(params, state)
    tokens, parents = np.asarray(tokens), np.asarray(drafted.parents)
    reference = np.zeros((2, tokens.shape[1], TINY_VOCAB))  # [b, i]: log-probabilities at node i's parent
    for i in range(tokens.shape[1]):
        paths = []
        for b in range(2):
            path, node = [], int(parents[b, i])
            while node >= 0:
                path.insert(0, node)
                node = int(parents[b, node])
            paths.append(path)
        feature, row_cache = root, cache
        for step in range(max(map(len, paths)) + 1):
            step_tokens = np.asarray([tokens[b, paths[b][step]] if step < len(paths[b]) else 0 for b in range(2)])
            log_probs, (feature, row_cache) = chain_step(proposer, params, feature, step_tokens, fill + step, row_cache)
            for b in range(2):
                if step == len(paths[b]):
                    reference[b, i] = np.asarray(log_probs)[b]
    return tokens, parents, reference


TINY_VOCAB = 128  # target_and_drafts()'s


@pytest.mark.parametrize("name", ["eagle", "eagle3"])
def test_a_dynamic_tree_drafts_each_nodes_top_k_as_the_head_computes_it_along_the_nodes_path(name):
    """Every node is one of the tree_top_k tokens of the head's distribution at its parent (computed without the tree
    mask), siblings differ, parents come first; with tree_top_k 1 the tree is the chain the head drafts."""
    tokens, parents, reference = dynamic_tree_and_reference(name, tree_top_k=2, total_tokens=8)
    for b in range(2):
        for i in range(tokens.shape[1]):
            assert parents[b, i] < i
            # Depth-first preorder: a node hangs below the path from the root to the node before it.
            above, node = {-1}, i - 1
            while node >= 0:
                above.add(node)
                node = int(parents[b, node])
            assert i == 0 or parents[b, i] in above
            assert tokens[b, i] in np.argsort(-reference[b, i])[:2], (b, i)
        for parent in set(parents[b].tolist()):
            siblings = tokens[b][parents[b] == parent]
            assert len(set(siblings.tolist())) == len(siblings)
    tokens, parents, reference = dynamic_tree_and_reference(name, tree_top_k=1, total_tokens=3)
    assert (parents == [[-1, 0, 1]] * 2).all()
    assert (tokens == reference.argmax(-1)).all()


@pytest.mark.parametrize("options, message", [
    (dict(total_tokens=8), r"total_tokens = 8 and tree_top_k = None: allowed both"),
    (dict(total_tokens=21, tree_top_k=2), r"total_tokens = 21 is invalid: allowed at most the 14 candidates"),
    (dict(total_tokens=4, tree_top_k=0), r"tree_top_k = 0 is invalid: allowed an integer >= 1"),
    (dict(total_tokens=4, tree_top_k=2, draft_sample_method="probabilistic"),
     r"draft_sample_method .* 'greedy' with a dynamic"),
    (dict(total_tokens=4, tree_top_k=2, rejection_sample_method="typical"), r"rejection_sample_method .* with a dynamic tree"),
    (dict(total_tokens=4, tree_top_k=2, speculative_token_tree=((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))),
     r"total_tokens = 4 is invalid: allowed None with speculative_token_tree"),
    (dict(total_tokens="big", tree_top_k=2), r"total_tokens = 'big' is invalid: allowed a positive integer or 'auto'"),
    (dict(total_tokens=0, tree_top_k=2), r"total_tokens = 0 is invalid: allowed a positive integer or 'auto'")])
def test_a_malformed_dynamic_tree_is_a_config_error_naming_the_field(options, message):
    with pytest.raises(ConfigError, match=message):
        SpecConfig(method="eagle", num_speculative_tokens=4, **options)


def test_dynamic_trees_are_refused_where_they_are_not_built_or_do_not_fit():
    target, drafts = target_and_drafts()
    with pytest.raises(UnsupportedSpeculation,
                       match=r"drafts no dynamic trees: .* allowed with \['draft_model', 'eagle', 'eagle3', 'mtp'\]"):
        generate(target, [[1, 2]], max_new_tokens=4, drafter=medusa_for(target, num_heads=2),
                 spec=SpecConfig(method="medusa", num_speculative_tokens=2, total_tokens=4, tree_top_k=2))
    spec = SpecConfig(method="eagle", num_speculative_tokens=4, total_tokens=40, tree_top_k=4)
    with pytest.raises(ValueError, match=r"\+ drafts scored per step \+ 1 \(41\) = 51 does not fit cache_size 48"):
        generate(target, [[1, 2]], max_new_tokens=8, cache_size=48, spec=spec, drafter=head_for("eagle"))


@pytest.mark.loop
@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_synthetic_acceptance_of_a_tree_accepts_the_first_ranked_path_to_the_set_length(method):
    """The benchmark mode: rates (1, 1, 0) accept exactly two nodes of the first-ranked path every step,
    whatever the drafts are (a static tree that holds (0, 0), and a dynamic one: top-1 twice is kept first)."""
    target, _ = target_and_drafts()
    if method == "medusa":
        spec, drafter = tree_spec(rejection_sample_method="synthetic", synthetic_acceptance_rates=(1.0, 1.0, 0.0)), \
            medusa_for(target, num_heads=3, scale=0.05)
    else:
        spec = SpecConfig(method="eagle", num_speculative_tokens=3, total_tokens=10, tree_top_k=3,
                          rejection_sample_method="synthetic", synthetic_acceptance_rates=(1.0, 1.0, 0.0))
        drafter = head_for("eagle")
    result = generate(target, [[3, 9, 27], [5, 1, 4, 4, 2]], max_new_tokens=[31, 13], spec=spec, drafter=drafter)
    assert result.metrics.summary()["length_histogram"] == [0, 0, 14, 0]  # (31 - 1) / 3 + (13 - 1) / 3 steps
    assert result.num_generated.tolist() == [31, 13]


def test_auto_tree_sizes_are_those_the_depth_and_tree_top_k_fill_and_the_cache_has_room_for_the_largest():
    assert SpecConfig(method="eagle", num_speculative_tokens=3, total_tokens="auto", tree_top_k=3).auto_tree_sizes == (8, 16)
    spec = SpecConfig(method="eagle", num_speculative_tokens=6, total_tokens="auto", tree_top_k=8)
    assert spec.auto_tree_sizes == (8, 16, 24, 32, 48, 64) and spec.num_draft_nodes == 64
    assert SpecConfig(method="eagle", num_speculative_tokens=2, total_tokens="auto", tree_top_k=2).auto_tree_sizes == (6,)


def test_the_tree_size_of_highest_predicted_rate_is_chosen():
    """tau / (T_verify + T_rest), T_rest the step less its T_verify at both ends (0.5 at 8 nodes, 1.0 at 32),
    linear between (0.666.. at 16): 2 / 1.5, 3 / 1.866.., 3.5 / 3."""
    choice = sizing.choose((8, 16, 32), (2.0, 3.0, 3.5), (1.0, 1.2, 2.0), step_s=(1.5, 3.0), batch=2)
    assert choice.total_tokens == 16
    np.testing.assert_allclose(choice.rest_s, (0.5, 0.5 + 0.5 / 3, 1.0))
    np.testing.assert_allclose(choice.predicted_tok_s, (2 * 2 / 1.5, 2 * 3 / (1.2 + 0.5 + 0.5 / 3), 2 * 3.5 / 3))
    assert "| **16** | 3.00 | 1200.00 | 666.67 |" in choice.table()


def test_estimated_acceptance_sums_the_best_nodes_confidences_scaled_to_the_measured_length():
    """Rows [0.5, 0.25, 0.25] and [0.5, 0.5, 0]: 1 + cumulative mean = 1.5, 1.875, 2; measured 3 at 3 nodes
    doubles every gain over 1."""
    log_probs = np.log(np.array([[0.5, 0.25, 0.25], [0.5, 0.5, 1e-30]]))
    np.testing.assert_allclose(sizing.estimated_acceptance(log_probs, (1, 2, 3), measured=3.0), (2.0, 2.75, 3.0))


@pytest.mark.loop
@pytest.mark.parametrize("method", ["eagle", "draft_model"])
def test_total_tokens_auto_chooses_a_size_and_its_output_is_the_autoregressive_one(method):
    """The calibration (at the largest of 8 and 16 nodes) and the choice; greedy output = autoregressive."""
    target, drafts = target_and_drafts()
    prompts, budgets = REQUESTS["ragged16"]()
    spec = SpecConfig(method=method, num_speculative_tokens=3, total_tokens="auto", tree_top_k=3)
    drafter = head_for("eagle") if method == "eagle" else drafts["perturbed"]
    result = generate(target, prompts, max_new_tokens=budgets, eos_token_ids=[EOS], spec=spec, drafter=drafter)
    assert result.sequences() == autoregressive_outputs("ragged16").sequences()
    choice = result.tree_size_choice
    assert choice.sizes == (8, 16) and choice.total_tokens in choice.sizes and choice.batch == 16
    assert all(t > 0 for t in choice.verify_s) and 1.0 <= choice.acceptance[0] <= choice.acceptance[1]
    with pytest.raises(UnsupportedSpeculation, match="total_tokens 'auto' is a choice generate makes"):
        build_proposer(spec, SamplingConfig(), 64, drafter)
