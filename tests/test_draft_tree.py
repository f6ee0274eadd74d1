"""Draft-tree structure (specjax.trees): ancestors and depths against a brute force; one target
forward over [root, nodes] with the tree's mask and positions gives every node the logits of a plain
forward over its own path; after the accepted path is moved into contiguous slots the cache equals
the one a plain forward over the committed tokens builds (keys, values, lengths), in both layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import fixture_dir
from support.models import assert_float32_close, forward, positions_like

from specjax.trees import masks, structure
from specjax.models import hf
from specjax.models.transformer import to_decoding_layout

ROWS, NODES, CACHE = 3, 9, 32
PROMPT_LENGTHS = (6, 9, 4)


def random_trees(rng, rows=ROWS, nodes=NODES):
    return np.stack([[-1] + [int(rng.integers(-1, i)) for i in range(1, nodes)] for _ in range(rows)]).astype(np.int32)


def path_to(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_ancestors_and_depths_match_a_brute_force_and_a_chain_is_causal():
    parents = random_trees(np.random.default_rng(0), rows=16, nodes=12)
    got, depth = (np.asarray(jax.jit(f)(jnp.asarray(parents))) for f in (structure.ancestors, structure.depths))
    for b in range(16):
        for i in range(12):
            assert set(np.flatnonzero(got[b, i])) == set(path_to(parents[b], i)) and depth[b, i] == len(path_to(parents[b], i))
    chain = structure.chain_parents(2, 5)
    mask = np.asarray(jax.jit(masks.attention_mask, static_argnums=2)(chain, jnp.asarray([3, 7]), 16))
    slots = np.arange(16)
    for b, level in enumerate((3, 7)):
        np.testing.assert_array_equal(mask[b], slots[None, :] <= level + np.arange(6)[:, None])


@pytest.fixture(scope="module")
def setup():
    """The llama_gqa fixture, ragged prompts prefilled up to their last token (the root), and random trees."""
    model = hf.load(fixture_dir("llama_gqa"))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    parents = random_trees(rng)
    tokens = rng.integers(0, model.config.vocab_size, (ROWS, NODES)).astype(np.int32)
    return model, prompts, parents, tokens


def padded_forward(model, sequences, cache=None, width=CACHE - 8):
    """Logits [R, width, V] and cache of one forward over the sequences right-padded to width."""
    padded = np.zeros((len(sequences), width), np.int32)
    for b, sequence in enumerate(sequences):
        padded[b, :len(sequence)] = sequence
    logits, _, cache = forward(model, jnp.asarray(padded), positions_like(padded), cache)
    return logits, cache


def prefilled(model, prompts):
    """A cache holding each prompt but its last token (the root, which the tree forward writes)."""
    width = max(len(p) for p in prompts)
    padded = np.zeros((len(prompts), width), np.int32)
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = p
    _, _, cache = forward(model, jnp.asarray(padded), positions_like(padded),
                          model.create_cache(len(prompts), CACHE))
    return cache.with_lengths(jnp.asarray([len(p) - 1 for p in prompts])), padded


@pytest.mark.parametrize("layout", ["stacked", "decoding"])
def test_a_tree_forward_gives_each_node_its_own_paths_logits_and_the_moved_path_is_a_plain_cache(setup, layout):
    model, prompts, parents, tokens = setup
    if layout == "decoding":
        model = to_decoding_layout(model)
    cache, padded = prefilled(model, prompts)
    fill = cache.lengths
    roots = jnp.asarray([p[-1] for p in prompts])
    block = jnp.concatenate([roots[:, None], jnp.asarray(tokens)], axis=1)
    mask = masks.attention_mask(jnp.asarray(parents), fill, CACHE)
    logits, _, tree_cache = forward(model, block, masks.block_positions(jnp.asarray(parents), fill), cache,
                                    attention_mask=mask)
    # References: one batched forward over every node's own path, right-padded (the model is causal).
    sequences = [(b, i, prompt + [int(tokens[b, j]) for j in path_to(parents[b], i)])
                 for b, prompt in enumerate(prompts) for i in range(-1, NODES)]
    alone, _ = padded_forward(model, [sequence for _, _, sequence in sequences])
    logits, alone = np.asarray(logits), np.asarray(alone)  # indexed on the host: no program per index
    for row, (b, i, sequence) in enumerate(sequences):
        assert_float32_close(logits[b, i + 1], alone[row, len(sequence) - 1], err_msg=f"row {b} node {i}")

    # Accept the path to each row's deepest node, move it, and compare with a plain prefill of the result.
    leaves = np.asarray(structure.depths(jnp.asarray(parents))).argmax(1)
    paths = [path_to(parents[b], int(leaves[b])) for b in range(ROWS)]
    length = jnp.asarray([len(p) for p in paths])
    path = jnp.asarray([p + [-1] * (NODES - len(p)) for p in paths])
    moved = jax.jit(masks.move_path)(tree_cache, fill, path, length).with_lengths(fill + 1 + length)
    sequences = [prompt + [int(tokens[b, j]) for j in paths[b]] for b, prompt in enumerate(prompts)]
    _, plain = padded_forward(model, sequences, model.create_cache(ROWS, CACHE))
    np.testing.assert_array_equal(moved.lengths, fill + 1 + length)
    for b, sequence in enumerate(sequences):
        n = len(sequence)
        for layer in range(model.config.num_layers):
            for got, want in zip(moved.layer(layer), plain.layer(layer)):
                assert_float32_close(np.asarray(got)[b, :n], np.asarray(want)[b, :n])


def test_preorder_keeps_parents_first_siblings_in_rank_order_and_the_first_ranked_path_at_the_front():
    from specjax.verify.tree import first_ranked_path

    parents = random_trees(np.random.default_rng(3), rows=16, nodes=12)
    ranks = np.array([[sum(parents[b, j] == parents[b, i] for j in range(i)) for i in range(12)] for b in range(16)])
    preorder = jax.jit(structure.preorder, static_argnames="max_depth")
    order = np.asarray(preorder(jnp.asarray(parents), jnp.asarray(ranks), max_depth=12))
    tokens, new_parents = (np.asarray(x) for x in jax.jit(structure.permute)(jnp.arange(12)[None].repeat(16, 0),
                                                                              jnp.asarray(parents), jnp.asarray(order)))
    for b in range(16):
        assert sorted(order[b]) == list(range(12)) and (tokens[b] == order[b]).all()
        new_index = {int(old): new for new, old in enumerate(order[b])}
        for new, old in enumerate(order[b]):  # the same tree, relabelled
            assert new_parents[b, new] == (-1 if parents[b, old] < 0 else new_index[int(parents[b, old])])
            assert new_parents[b, new] < new
        for j in range(1, 12):  # preorder: the next node hangs below the previous one's path
            assert new_parents[b, j] == -1 or new_parents[b, j] in path_to(new_parents[b], j - 1)
        siblings = [[j for j in range(12) if new_parents[b, j] == p] for p in range(-1, 12)]
        assert all(list(order[b][s]) == sorted(order[b][s]) for s in siblings)  # rank order kept
    path, length = map(np.asarray, jax.jit(first_ranked_path)(jnp.asarray(new_parents)))
    for b in range(16):
        assert path[b, :length[b]].tolist() == list(range(int(length[b])))


def test_moving_a_path_already_in_place_leaves_the_cache_as_it_is(setup):
    model, prompts, _, _ = setup
    cache, _ = prefilled(model, prompts)
    fill, length = cache.lengths, jnp.asarray([3, 0, 2])
    in_place = jnp.asarray([[0, 1, 2, -1], [-1] * 4, [0, 1, -1, -1]])
    move_path = jax.jit(masks.move_path)
    for got, want in zip(jax.tree.leaves(move_path(cache, fill, in_place, length)), jax.tree.leaves(cache)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    moved = move_path(cache, fill, jnp.asarray([[1, 2, 3, -1], [-1] * 4, [0, 1, -1, -1]]), length)
    first = int(fill[0])
    np.testing.assert_array_equal(np.asarray(moved.layer(0)[0])[0, first + 1],
                                  np.asarray(cache.layer(0)[0])[0, first + 2])
