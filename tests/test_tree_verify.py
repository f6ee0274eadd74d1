"""Tree verification (specjax.verify.tree) on its own: greedy is the longest argmax path; on a chain the
tree verifier is the standard one, draw for draw; and at T > 0 the first two emitted tokens follow the
target exactly (chi-square against a Markov target) for deterministic top-k, i.i.d. and
without-replacement sibling drafts, with negative controls that the same test catches."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import chi_square_pvalue

from specjax.verify import standard
from specjax.verify.common import Draws
from specjax.verify.tree import make_tree_draws, verify_tree, verify_tree_greedy, verify_tree_with_draws

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


def first_two_tokens(tokens, path, length, next_token, key):
    """The first two emitted tokens; when only one was emitted, the second is drawn from the target."""
    rows = jnp.arange(tokens.shape[0])
    path_tokens = jnp.where(path >= 0, tokens[rows[:, None], jnp.maximum(path, 0)], -1)
    first = jnp.where(length >= 1, path_tokens[:, 0], next_token)
    second = jnp.where(length >= 2, path_tokens[:, 1], jnp.where(length == 1, next_token, -1))
    extra = jax.random.categorical(key, jnp.log(jnp.asarray(TARGET)[first]))
    return first, jnp.where(second < 0, extra, second)


@functools.partial(jax.jit, static_argnames=("parents", "drafting", "verifier"))
def emitted_pairs(parents, drafting, verifier, seed):
    key = jax.random.key(seed)
    draft_key, verify_key, extra_key = jax.random.split(key, 3)
    tokens, draft_probs = draft_tree(list(parents), drafting, draft_key)
    if verifier == "wrong_q":  # SpecInfer's i.i.d. rule applied to siblings drawn without replacement
        draft_probs = jnp.asarray(DRAFT)[jnp.concatenate(
            [jnp.full((ROWS, 1), ROOT), tokens], 1)[:, np.maximum(np.asarray(parents) + 1, 0)]]
    keys = jax.random.split(verify_key, ROWS)
    if verifier == "first_ranked":  # accepts the first child at every depth, then samples from the target
        path, length, next_token = first_ranked_path(parents, tokens, keys)
    else:
        path, length, next_token = verify_tree(target_probs_for(tokens), tokens, jnp.asarray(parents)[None].repeat(
            ROWS, 0), draft_probs, keys)
    return first_two_tokens(tokens, path, length, next_token, extra_key), length


def first_ranked_path(parents, tokens, keys):
    path, node = [], -1
    while node in parents:
        node = parents.index(node)
        path.append(node)
    length = jnp.full((ROWS,), len(path), jnp.int32)
    padded = jnp.asarray(path + [-1] * (len(parents) - len(path)), jnp.int32)[None].repeat(ROWS, 0)
    after = target_probs_for(tokens)[:, path[-1] + 1]
    return padded, length, jax.vmap(jax.random.categorical)(keys, jnp.log(after))


def pair_pvalue(parents, drafting, verifier, seed=0):
    (first, second), length = emitted_pairs(tuple(parents), drafting, verifier, seed)
    counts = np.bincount(np.asarray(first) * V + np.asarray(second), minlength=V * V)
    exact = (TARGET[ROOT][:, None] * TARGET).ravel()
    return chi_square_pvalue(counts, exact), np.bincount(np.asarray(length), minlength=len(parents) + 1)


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("drafting", ["top_k", "iid", "without_replacement"])
def test_tree_verification_is_lossless(tree, drafting):
    pvalue, lengths = pair_pvalue(TREES[tree], drafting, "recursive")
    assert lengths[0] > 0 and lengths[2:].sum() > 0, lengths  # rejections and accepted paths of depth >= 2
    assert pvalue > ALPHA, (pvalue, lengths)


@pytest.mark.parametrize("drafting, verifier", [("top_k", "first_ranked"), ("without_replacement", "wrong_q")])
def test_negative_controls_fail_the_same_test(drafting, verifier):
    pvalue, _ = pair_pvalue(TREES["binary"], drafting, verifier)
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
    path, length, next_token = verify_tree_greedy(jnp.asarray(argmax), jnp.asarray(tokens), jnp.asarray(parents))
    one_hot = jax.nn.one_hot(argmax, vocab)
    same = verify_tree(one_hot, jnp.asarray(tokens), jnp.asarray(parents), None, jax.random.split(jax.random.key(1), rows))
    lengths = []
    for b in range(rows):
        expected_path, expected_next = longest_argmax_path(parents[b].tolist(), tokens[b].tolist(), argmax[b].tolist())
        lengths.append(len(expected_path))
        assert np.asarray(path[b, :length[b]]).tolist() == expected_path and int(next_token[b]) == expected_next
        assert (np.asarray(path[b, length[b]:]) == -1).all()
        for got, want in zip(same, (path, length, next_token)):
            np.testing.assert_array_equal(np.asarray(got[b]), np.asarray(want[b]))
    assert max(lengths) >= 3 and min(lengths) == 0


@pytest.mark.parametrize("one_hot_drafts", [False, True])
def test_on_a_chain_it_is_the_standard_verifier_draw_for_draw(one_hot_drafts):
    rows, k = 512, 4
    key = jax.random.key(2)
    target = jax.nn.softmax(2 * jax.random.normal(key, (rows, k + 1, V)), -1)
    draft = jax.nn.softmax(2 * jax.random.normal(jax.random.fold_in(key, 1), (rows, k, V)), -1)
    tokens = jax.vmap(jax.vmap(jax.random.categorical))(jax.random.split(jax.random.fold_in(key, 2), (rows, k)),
                                                        jnp.log(draft)).astype(jnp.int32)
    draft_probs = None if one_hot_drafts else draft
    uniforms, exponentials = make_tree_draws(jax.random.split(key, rows), k, V)
    n, next_token = standard.verify_with_draws(target, tokens, draft_probs, Draws(uniforms, exponentials))
    chain = jnp.broadcast_to(jnp.arange(-1, k - 1), (rows, k))
    path, length, tree_next = verify_tree_with_draws(target, tokens, chain, draft_probs, uniforms, exponentials)
    np.testing.assert_array_equal(length, n)
    np.testing.assert_array_equal(tree_next, next_token)
    np.testing.assert_array_equal(path, jnp.where(jnp.arange(k) < n[:, None], jnp.arange(k), -1))
    assert 0 < int(n.min()) or int(n.max()) > 0
