"""Tree verification (specjax.verify.tree) on its own: greedy is the longest argmax path; on a chain
recursive rejection sampling is the standard verifier and traversal verification the block verifier,
draw for draw; and at T > 0 the first three emitted tokens follow the target exactly (chi-square against
a Markov target) under both, for deterministic top-k, i.i.d. and without-replacement sibling drafts,
with negative controls that the same test catches."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.distributions import chi_square_pvalue

from specjax.trees import structure
from specjax.verify import block, standard
from specjax.verify.common import Draws, race_sample
from specjax.verify.tree import (deepest_path, make_tree_draws, bonus_weights, traversal_weights, verify_tree,
                                 verify_tree_greedy,
                                 verify_tree_traversal, verify_tree_traversal_with_draws, verify_tree_with_draws)
from specjax.verify.testing import random_verify_inputs

V = 5
ROOT = 0
ROWS = 65536
ALPHA = 1e-4  # as tests/test_lossless.py's LOSSLESS_ALPHA
# Two trees, parents before children: a full binary tree of depth 2, and a ragged one of depth 3 whose
# siblings are not contiguous.
TREES = {"binary": [-1, -1, 0, 0, 1, 1], "ragged": [-1, 0, -1, 1, 0, 2, -1, 3]}


def markov(seed: int, sharpness: float) -> np.ndarray:
    """[V, V]: row a is the distribution of the next token after a."""
    logits = sharpness * np.random.default_rng(seed).normal(size=(V, V))
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    return (probs / probs.sum(-1, keepdims=True)).astype(np.float32)


TARGET, DRAFT = markov(0, 1.5), markov(1, 1.5)


def sibling_ranks(parents):
    seen: dict[int, int] = {}
    ranks = []
    for parent in parents:
        ranks.append(seen.get(parent, 0))
        seen[parent] = ranks[-1] + 1
    return ranks


def draft_tree(parents, drafting: str, key):
    """tokens [R, N] and draft_probs [R, N, V] (None for deterministic top-k) drafted from DRAFT."""
    ranks = sibling_ranks(parents)
    draft = jnp.asarray(DRAFT)
    tokens, probs = [], []
    gumbels = jax.random.gumbel(key, (ROWS, len(parents) + 1, V))  # one race per parent (root last)
    for i, (parent, rank) in enumerate(zip(parents, ranks)):
        before = jnp.full((ROWS,), ROOT) if parent < 0 else tokens[parent]
        q = draft[before]  # [R, V]
        if drafting == "top_k":  # the rank-th most probable draft token (a table: no sort in the program)
            token = jnp.asarray(np.argsort(-DRAFT, axis=-1, kind="stable"))[before, rank]
        elif drafting == "iid":
            token = jax.random.categorical(jax.random.fold_in(key, i), jnp.log(q))
        else:  # without replacement: the rank-th of one Gumbel race per parent; q without earlier siblings
            order = jnp.argsort(-(jnp.log(q) + gumbels[:, parent]), axis=-1)
            token = order[:, rank]
            q = q * (1 - jax.nn.one_hot(order[:, :rank], V).sum(1))
            q = q / q.sum(-1, keepdims=True)
        tokens.append(token.astype(jnp.int32))
        probs.append(q)
    return jnp.stack(tokens, 1), None if drafting == "top_k" else jnp.stack(probs, 1)


def target_probs_for(tokens):
    """[R, N + 1, V]: the Markov target after the root and after each node."""
    context = jnp.concatenate([jnp.full((tokens.shape[0], 1), ROOT, jnp.int32), tokens], axis=1)
    return jnp.asarray(TARGET)[context]


EMITTED = 3  # tokens compared with the target's joint distribution


def first_emitted_tokens(tokens, path, length, next_token, key):
    """The first EMITTED tokens: the accepted path, the next token, then draws from the target."""
    rows = jnp.arange(tokens.shape[0])
    path_tokens = jnp.where(path >= 0, tokens[rows[:, None], jnp.maximum(path, 0)], -1)
    emitted = []
    for position, extra_key in enumerate(jax.random.split(key, EMITTED)):
        drafted = path_tokens[:, position] if position < path.shape[1] else -1
        token = jnp.where(length > position, drafted, jnp.where(length == position, next_token, -1))
        if position:  # past the next token, the target's own continuation
            token = jnp.where(token < 0, jax.random.categorical(extra_key, jnp.log(jnp.asarray(TARGET)[emitted[-1]])),
                              token)
        emitted.append(token)
    return emitted


@functools.partial(jax.jit, static_argnames=("parents", "drafting", "verifier"))
def emitted_tokens(parents, drafting, verifier, seed):
    key = jax.random.key(seed)
    draft_key, verify_key, extra_key = jax.random.split(key, 3)
    tokens, draft_probs = draft_tree(list(parents), drafting, draft_key)
    if verifier == "wrong_q":  # SpecInfer's i.i.d. rule applied to siblings drawn without replacement
        draft_probs = jnp.asarray(DRAFT)[jnp.concatenate(
            [jnp.full((ROWS, 1), ROOT), tokens], 1)[:, np.maximum(np.asarray(parents) + 1, 0)]]
    keys = jax.random.split(verify_key, ROWS)
    if verifier == "first_ranked":  # accepts the first child at every depth, then samples from the target
        path, length, next_token = first_ranked_path(parents, tokens, keys)
    elif verifier == "traversal_top_down":  # traversal's weights, but the first passing node in index order
        path, length, next_token = traversal_top_down(target_probs_for(tokens), tokens, jnp.asarray(parents)[None].repeat(
            ROWS, 0), draft_probs, keys)
    else:
        verify = verify_tree_traversal if verifier == "traversal" else verify_tree
        path, length, next_token = verify(target_probs_for(tokens), tokens, jnp.asarray(parents)[None].repeat(
            ROWS, 0), draft_probs, keys)
    return first_emitted_tokens(tokens, path, length, next_token, extra_key), length


def traversal_top_down(target_probs, tokens, parents, draft_probs, keys):
    """Deliberately wrong: tests the nodes parents first instead of leaves first."""
    uniforms, exponentials = make_tree_draws(keys, tokens.shape[1], V)
    weights, residuals = traversal_weights(target_probs, tokens, parents, draft_probs)
    passes = uniforms <= weights[:, 1:]
    first = jnp.where(passes.any(-1), jnp.argmax(passes, -1), -1)
    on_path = structure.ancestors(parents)[jnp.arange(ROWS), jnp.maximum(first, 0)] & (first >= 0)[:, None]
    path, length, node = deepest_path(parents, on_path)
    return path, length, race_sample(bonus_weights(target_probs, tokens, parents, residuals, node),
                                     exponentials)


def first_ranked_path(parents, tokens, keys):
    path, node = [], -1
    while node in parents:
        node = parents.index(node)
        path.append(node)
    length = jnp.full((ROWS,), len(path), jnp.int32)
    padded = jnp.asarray(path + [-1] * (len(parents) - len(path)), jnp.int32)[None].repeat(ROWS, 0)
    after = target_probs_for(tokens)[:, path[-1] + 1]
    return padded, length, jax.vmap(jax.random.categorical)(keys, jnp.log(after))


def emitted_pvalue(parents, drafting, verifier, seed=0):
    """The chi-square p-value of the first EMITTED tokens against the target, and the accepted lengths' counts."""
    emitted, length = emitted_tokens(tuple(parents), drafting, verifier, seed)
    cells = functools.reduce(lambda index, token: index * V + np.asarray(token), emitted, 0)
    exact = TARGET[ROOT]
    for _ in range(EMITTED - 1):  # P(a, b, c) = P(a | root) P(b | a) P(c | b)
        exact = (exact[..., None] * TARGET[np.arange(V)].reshape((1,) * (exact.ndim - 1) + (V, V)))
    counts = np.bincount(cells, minlength=V ** EMITTED)
    return chi_square_pvalue(counts, exact.ravel()), np.bincount(np.asarray(length), minlength=len(parents) + 1)


@pytest.mark.parametrize("verifier", ["recursive", "traversal"])
@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("drafting", ["top_k", "iid", "without_replacement"])
def test_tree_verification_is_lossless(tree, drafting, verifier):
    pvalue, lengths = emitted_pvalue(TREES[tree], drafting, verifier)
    assert lengths[0] > 0 and lengths[2:].sum() > 0, lengths  # rejections and accepted paths of depth >= 2
    assert pvalue > ALPHA, (pvalue, lengths)


@pytest.mark.parametrize("drafting, verifier", [("top_k", "first_ranked"), ("without_replacement", "wrong_q"),
                                               ("iid", "traversal_top_down")])
def test_negative_controls_fail_the_same_test(drafting, verifier):
    pvalue, _ = emitted_pvalue(TREES["binary"], drafting, verifier)
    assert pvalue < 1e-6, pvalue


def longest_argmax_path(parents, tokens, argmax):
    """Brute force: walk from the root, taking the first child whose token is the argmax."""
    path, node = [], -1
    while True:
        children = [i for i, p in enumerate(parents) if p == node and tokens[i] == argmax[node + 1]]
        if not children:
            return path, argmax[node + 1]
        node = children[0]
        path.append(node)


def test_greedy_is_the_longest_argmax_path_and_matches_the_sampling_rule_on_one_hot_targets():
    rng = np.random.default_rng(0)
    rows, num_nodes, vocab = 256, 12, 3  # a small vocabulary: long matching paths are common
    parents = np.stack([[-1] + [rng.integers(-1, i) for i in range(1, num_nodes)] for _ in range(rows)])
    tokens = rng.integers(0, vocab, (rows, num_nodes))
    argmax = rng.integers(0, vocab, (rows, num_nodes + 1))
    path, length, next_token = map(np.asarray, jax.jit(verify_tree_greedy)(
        jnp.asarray(argmax), jnp.asarray(tokens), jnp.asarray(parents)))
    one_hot = jax.nn.one_hot(argmax, vocab)
    same = [np.asarray(x) for x in jax.jit(verify_tree)(
        one_hot, jnp.asarray(tokens), jnp.asarray(parents), None, jax.random.split(jax.random.key(1), rows))]
    lengths = []
    for b in range(rows):
        expected_path, expected_next = longest_argmax_path(parents[b].tolist(), tokens[b].tolist(), argmax[b].tolist())
        lengths.append(len(expected_path))
        assert path[b, :length[b]].tolist() == expected_path and int(next_token[b]) == expected_next
        assert (path[b, length[b]:] == -1).all()
        for got, want in zip(same, (path, length, next_token)):
            np.testing.assert_array_equal(got[b], want[b])
    assert max(lengths) >= 3 and min(lengths) == 0


@functools.partial(jax.jit, static_argnames=("rows", "k"))
def random_chain(seed: int, rows: int = 512, k: int = 4):
    """(target [R, k + 1, V], draft [R, k, V], tokens drawn from the draft, uniforms, exponentials, chain parents)."""
    key = jax.random.key(seed)
    target = jax.nn.softmax(2 * jax.random.normal(key, (rows, k + 1, V)), -1)
    draft = jax.nn.softmax(2 * jax.random.normal(jax.random.fold_in(key, 1), (rows, k, V)), -1)
    tokens = jax.vmap(jax.vmap(jax.random.categorical))(jax.random.split(jax.random.fold_in(key, 2), (rows, k)),
                                                        jnp.log(draft)).astype(jnp.int32)
    uniforms, exponentials = make_tree_draws(jax.random.split(key, rows), k, V)
    return target, draft, tokens, uniforms, exponentials, jnp.broadcast_to(jnp.arange(-1, k - 1), (rows, k))


def assert_the_chain_verifier(tree_result, num_accepted, next_token):
    path, length, tree_next = tree_result
    np.testing.assert_array_equal(length, num_accepted)
    np.testing.assert_array_equal(tree_next, next_token)
    k = path.shape[1]
    np.testing.assert_array_equal(path, jnp.where(jnp.arange(k) < num_accepted[:, None], jnp.arange(k), -1))


@pytest.mark.parametrize("one_hot_drafts", [False, True])
def test_on_a_chain_it_is_the_standard_verifier_draw_for_draw(one_hot_drafts):
    target, draft, tokens, uniforms, exponentials, chain = random_chain(2)
    draft_probs = None if one_hot_drafts else draft
    n, next_token = jax.jit(standard.verify_with_draws)(target, tokens, draft_probs, Draws(uniforms, exponentials))
    tree_result = jax.jit(verify_tree_with_draws)(target, tokens, chain, draft_probs, uniforms, exponentials)
    assert_the_chain_verifier(tree_result, n, next_token)
    assert 0 < int(n.min()) or int(n.max()) > 0


def test_traversal_verification_of_a_chain_is_block_verification_draw_for_draw():
    target, draft, tokens, uniforms, exponentials, chain = random_chain(3)
    n, next_token = jax.jit(block.verify_with_draws)(target, tokens, draft, Draws(uniforms, exponentials))
    assert_the_chain_verifier(jax.jit(verify_tree_traversal_with_draws)(target, tokens, chain, draft, uniforms,
                                                                        exponentials), n, next_token)
    # Block verification accepts more than token by token on the same draws' tests (its reason to exist).
    standard_n = jax.jit(standard.verify_with_draws)(target, tokens, draft, Draws(uniforms, exponentials))[0]
    assert float(n.mean()) > float(standard_n.mean())


@pytest.mark.parametrize("drafting", [pytest.param("iid", marks=pytest.mark.slow), "without_replacement"])  # one fast
def test_traversal_verification_accepts_more_than_recursive_rejection_sampling_with_sampled_siblings(drafting):
    """Its reason to exist (arXiv 2505.12398 reports 2-6% longer accepted paths): on the ragged tree, about
    10% more tokens a step here; with deterministic top-k siblings the two accept the same (not asserted)."""
    recursive, traversal = (float(np.asarray(emitted_tokens(tuple(TREES["ragged"]), drafting, verifier, 0)[1]).mean())
                            for verifier in ("recursive", "traversal"))
    assert traversal > 1.05 * recursive, (traversal, recursive)


def test_traversal_with_one_hot_drafts_on_scalars_is_the_general_rule_with_one_hot_draft_probs():
    rng = np.random.default_rng(4)
    rows, num_nodes = 4096, 10
    parents = jnp.asarray([[-1] + [rng.integers(-1, i) for i in range(1, num_nodes)] for _ in range(rows)])
    tokens = jnp.asarray(rng.integers(0, V, (rows, num_nodes)), jnp.int32)  # repeated siblings included
    target = jax.nn.softmax(jnp.asarray(rng.normal(size=(rows, num_nodes + 1, V)), jnp.float32), -1)
    uniforms, exponentials = jax.jit(make_tree_draws, static_argnums=(1, 2))(jax.random.split(jax.random.key(5), rows),
                                                                             num_nodes, V)
    traversal = jax.jit(verify_tree_traversal_with_draws)
    fast = traversal(target, tokens, parents, None, uniforms, exponentials)
    general = traversal(target, tokens, parents, jax.nn.one_hot(tokens, V), uniforms, exponentials)
    for got, want in zip(fast, general):
        assert np.mean(np.asarray(got) == np.asarray(want)) > 0.999  # float32 rounding at a test's edge aside
    assert int(fast[1].max()) >= 3


def test_traversals_residual_update_is_in_place_at_batch_one():
    """The compiled pass copies the [1, N + 1, V] residuals once (from the input), not in every step: with
    the parent's row read in two fused consumers XLA copied it twice a step (docs/performance.md)."""
    num_nodes, vocab = 8, 64
    target, tokens, draft, _ = random_verify_inputs(1, num_nodes, vocab, seed=3)
    parents = jnp.asarray([[-1, 0, 0, 1, 1, 2, 3, 3]], jnp.int32)
    hlo = jax.jit(traversal_weights).lower(target, tokens, parents, draft).compile().as_text()
    assert len(re.findall(rf"f32\[1,{num_nodes + 1},{vocab}\]\{{[0-9,]*\}} copy\(", hlo)) == 1
