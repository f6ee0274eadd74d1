"""MTP modules in DeepSeek-V3's checkpoint layout (a hand-built checkpoint against a numpy reference of vLLM's
DeepSeekMultiTokenPredictorLayer; MiMo's modules saved in DeepSeek-V3's names and back; refusals of its MLA and
MoE layers), and MTP drafting EAGLE-2 dynamic trees (each node the ranked child of the modules' distribution
along its path; greedy output = autoregressive; chi-square with standard and block verification and the
first-ranked-path negative control)."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from support.checkpoints import FIXTURES
from support.distributions import check_lossless, first_ranked_pvalue, tree_joint_counts
from support.models import EOS, forward, mtp_logits, mtp_modules, positions_like, target_and_drafts, tiny_mtp_modules
from support.requests import REQUESTS, autoregressive_outputs

from specjax.config import SamplingConfig, SpecConfig
from specjax.decoding import generate
from specjax.experiments import recognized_method
from specjax.models import hf
from specjax.models.mtp import load_mtp, save_mtp
from specjax.models.transformer import Hidden, init_model
from specjax.proposers import Context, TargetOutput, build_proposer, proposer_class


def shared_of(target):
    return target.embed[...], None if target.lm_head is None else target.lm_head[...]


# ------------------------------------------------------------------------- DeepSeek-V3's layout

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
         "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
         "hidden_act": "silu", "tie_word_embeddings": False}


def deepseek_checkpoint(folder, num_modules: int = 2, **config_changes):
    """A Llama target with `num_modules` MTP modules in DeepSeek-V3's names (model.layers.{2 + k}.*, with copies of
    the target's embedding and LM head), written tensor by tensor with numpy; returns (target, module weights
    {k: {name: array}}) for the reference."""
    target = init_model(hf.config_from_hf(LLAMA), seed=5)
    hf.save(target, folder)
    tensors = load_file(folder / hf.SINGLE_FILE)
    rng = np.random.default_rng(7)
    D, H, K, E, F = 32, 4, 2, 8, 48
    shapes = {"enorm.weight": (D,), "hnorm.weight": (D,), "eh_proj.weight": (D, 2 * D),
              "input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
              "self_attn.q_proj.weight": (H * E, D), "self_attn.k_proj.weight": (K * E, D),
              "self_attn.v_proj.weight": (K * E, D), "self_attn.o_proj.weight": (D, H * E),
              "mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D), "mlp.down_proj.weight": (D, F),
              "shared_head.norm.weight": (D,)}
    weights = {}
    for k in range(num_modules):
        weights[k] = {name: (1 + 0.3 * rng.standard_normal(shape) if len(shape) == 1 else
                             0.3 * rng.standard_normal(shape)).astype(np.float32) for name, shape in shapes.items()}
        weights[k]["embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
        weights[k]["shared_head.head.weight"] = tensors["lm_head.weight"]
        tensors.update({f"model.layers.{2 + k}.{name}": w for name, w in weights[k].items()})
    save_file(tensors, folder / hf.SINGLE_FILE, metadata={"format": "pt"})
    raw = {**json.loads((folder / hf.CONFIG_FILE).read_text()), "num_nextn_predict_layers": num_modules, **config_changes}
    (folder / hf.CONFIG_FILE).write_text(json.dumps(raw))
    return target, weights


def rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, positions, theta=10000.0):  # x [T, N, E], the rotate-half convention
    half = x.shape[-1] // 2
    angles = positions[:, None] / theta ** (np.arange(half) * 2 / x.shape[-1])
    cos, sin = np.cos(np.concatenate([angles] * 2, -1))[:, None], np.sin(np.concatenate([angles] * 2, -1))[:, None]
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def llama_layer(x, w):
    """One Llama decoder layer over [T, D] (causal GQA attention, SwiGLU MLP), as transformers writes it."""
    T, heads, kv_heads, E = x.shape[0], 4, 2, 8
    h = rms(x, w["input_layernorm.weight"])
    q = rope((h @ w["self_attn.q_proj.weight"].T).reshape(T, heads, E), np.arange(T))
    k = rope((h @ w["self_attn.k_proj.weight"].T).reshape(T, kv_heads, E), np.arange(T))
    v = (h @ w["self_attn.v_proj.weight"].T).reshape(T, kv_heads, E)
    k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)
    scores = np.einsum("the,she->hts", q, k) / np.sqrt(E)
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    attn = np.einsum("hts,she->the", probs / probs.sum(-1, keepdims=True), v).reshape(T, heads * E)
    x = x + attn @ w["self_attn.o_proj.weight"].T
    h = rms(x, w["post_attention_layernorm.weight"])
    gate = h @ w["mlp.gate_proj.weight"].T
    return x + (gate / (1 + np.exp(-gate)) * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T


def deepseek_reference(weights, tokens, hidden, hidden_state):
    """Each module's logits over a sequence, vLLM's DeepSeekMultiTokenPredictorLayer then compute_logits: module k
    at position s reads x_{s+k+1}'s embedding and the target's hidden state (module 0, or every module with
    hidden_state 'target') or module k - 1's decoder-layer output before shared_head.norm."""
    T, logits, previous = hidden.shape[0], [], hidden
    for k, w in weights.items():
        shifted = np.pad(tokens[k + 1:k + 1 + T], (0, max(0, T - len(tokens[k + 1:k + 1 + T]))))
        embedded = w["embed_tokens.weight"][shifted]
        fed = hidden if hidden_state == "target" else previous
        x = np.concatenate([rms(embedded, w["enorm.weight"]), rms(fed, w["hnorm.weight"])], -1) @ w["eh_proj.weight"].T
        previous = llama_layer(x, w)
        logits.append(rms(previous, w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].T)
    return np.stack(logits)


@pytest.mark.parametrize("hidden_state", ["chained", "target"])
def test_a_deepseek_v3_named_checkpoint_computes_the_reference_formula(tmp_path, hidden_state):
    """A Llama target with two modules in DeepSeek-V3's names: the target loads without them, the modules load
    from the same folder (chained before shared_head.norm by default) and give the numpy reference's logits."""
    target, weights = deepseek_checkpoint(tmp_path)
    loaded = hf.load(tmp_path)
    for a, b in zip(jax.tree.leaves(target), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(a, b)
    modules = load_mtp(tmp_path, loaded.config, shared_of(loaded))
    assert modules.config.num_modules == 2 and modules.config.hidden_state == "chained"
    assert not modules.config.chain_after_final_norm
    assert recognized_method(tmp_path) == "mtp"
    rng = np.random.default_rng(0)
    tokens, hidden = rng.integers(0, 64, 12), rng.standard_normal((12, 32)).astype(np.float32)
    logits = np.asarray(mtp_logits(modules, loaded, jnp.asarray(tokens)[None], jnp.asarray(hidden)[None],
                                      hidden_state=hidden_state))[:, 0]
    np.testing.assert_allclose(logits, deepseek_reference(weights, tokens, hidden, hidden_state), atol=2e-4, rtol=1e-4)


def test_mimos_modules_saved_in_deepseek_v3_names_load_back_with_identical_logits(tmp_path):
    """MiMo's three modules (chained after final_layernorm, fed the target's hidden state by default) written in
    DeepSeek-V3's names, numbered after the target's layers with copies of its embedding and LM head: the same
    config, weights and logits either way of feeding; the folder is an MTP drafter's, not a draft model's."""
    folder = FIXTURES / "mtp" / "mimo3"
    target = hf.load(folder)
    modules = load_mtp(folder, target.config)
    save_mtp(modules, tmp_path, layout="deepseek_v3", target=target)
    names = hf.tensor_names(tmp_path)
    first = target.config.num_layers
    assert {f"model.layers.{first + 2}.eh_proj.weight", f"model.layers.{first}.shared_head.head.weight"} <= names
    assert not any(name.startswith(hf.MTP_TENSOR_PREFIX) for name in names)
    loaded = load_mtp(tmp_path, target.config, shared_of(target))
    assert loaded.config == modules.config
    for a, b in zip(jax.tree.leaves(modules), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(a, b)
    ids = jnp.asarray([[3, 9, 1, 4, 4, 7, 2, 8]])
    _, hidden, _ = forward(target, ids, positions_like(ids))
    for hidden_state in ("chained", "target"):
        np.testing.assert_array_equal(mtp_logits(modules, target, ids, hidden.final, hidden_state=hidden_state),
                                      mtp_logits(loaded, target, ids, hidden.final, hidden_state=hidden_state))
    assert recognized_method(tmp_path) == "mtp" and not proposer_class("draft_model").recognizes(tmp_path)


def test_deepseek_v3s_own_layers_and_foreign_copies_are_refused_naming_the_field_or_tensor(tmp_path):
    target, _ = deepseek_checkpoint(tmp_path / "mla", kv_lora_rank=512)
    with pytest.raises(hf.CheckpointError, match=r"kv_lora_rank = 512: MTP modules whose decoder layer has multi-head "
                                                 r"latent attention .* not supported: allowed null"):
        load_mtp(tmp_path / "mla", target.config)
    deepseek_checkpoint(tmp_path / "moe", n_routed_experts=4)
    tensors = load_file(tmp_path / "moe" / hf.SINGLE_FILE)
    tensors["model.layers.3.mlp.experts.0.gate_proj.weight"] = tensors.pop("model.layers.3.mlp.gate_proj.weight")
    save_file(tensors, tmp_path / "moe" / hf.SINGLE_FILE)
    with pytest.raises(hf.CheckpointError, match=r"tensor 'model.layers.3.mlp.experts.0.gate_proj.weight' "
                                                 r"\(n_routed_experts = 4\): .* mixture of experts are not supported"):
        load_mtp(tmp_path / "moe", target.config)
    deepseek_checkpoint(tmp_path / "head")
    tensors = load_file(tmp_path / "head" / hf.SINGLE_FILE)
    tensors["model.layers.2.shared_head.head.weight"] = tensors["model.layers.2.shared_head.head.weight"] + 1
    save_file(tensors, tmp_path / "head" / hf.SINGLE_FILE)
    with pytest.raises(hf.CheckpointError, match=r"tensor 'model.layers.2.shared_head.head.weight' differs from the "
                                                 r"target's LM head .* \(allowed: equal copies\)"):
        load_mtp(tmp_path / "head", target.config, shared_of(target))
    with pytest.raises(ValueError, match=r"save_mtp layout = 'deepseek_v3' with target None: allowed"):
        save_mtp(load_mtp(tmp_path / "head", target.config), tmp_path / "out", layout="deepseek_v3")


# --------------------------------------------------------------------------------- dynamic trees

def path_of(parents, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.insert(0, node)
        node = int(parents[node])
    return path


@functools.partial(jax.jit, static_argnames=("n", "hidden_state"))
def path_logits(modules, embed, lm_head, tokens, hidden, *, n: int, hidden_state: str):
    """The modules' logits for the token after a path, computed the plain way: tokens [1, n + 1 + d] are the
    committed x_0 .. x_n and the path's d tokens, hidden [1, n, D] the target's h_0 .. h_{n-1}. While d < M,
    module d at slot n - 1 of the modules run over the whole sequence; past them the last module stepped on its
    own outputs at slots n, n + 1, ... (what a chain drafts)."""
    from specjax.models.transformer import unembed

    depth, num_modules = tokens.shape[1] - n - 1, modules.config.num_modules
    if depth < num_modules:
        out = modules.over_sequence(tokens, hidden, embed, hidden_state)[0][depth][:, n - 1]
    else:
        cache = modules.create_cache(1, n + depth + 2)
        outs, cache = modules.over_sequence(tokens[:, :n + num_modules], hidden, embed, hidden_state, cache)
        out = feature = outs[-1][:, n - 1]
        for step in range(depth - num_modules + 1):
            out, feature, cache = modules(num_modules - 1, tokens[:, n + num_modules + step][:, None],
                                          feature[:, None], jnp.asarray([[n + step]]), cache, embed)
            out, feature = out[:, 0], feature[:, 0]
    return unembed(out, embed, lm_head, modules.config.layer.jnp_dtype)[0]


COMMITTED, LENGTHS = np.array([[5, 9, 2, 7, 1, 3, 8], [4, 11, 0, 0, 0, 0, 0]]), np.array([7, 2])


def drafted_tree(modules, spec):
    """One tree (or chain) drafted for COMMITTED's two rows (the second's path reaches back before slot 0):
    (tokens [2, N], parents [2, N] or None)."""
    target = target_and_drafts()[0]
    proposer = build_proposer(spec, SamplingConfig(), 64, modules)
    params = proposer.bind(modules, target)
    committed, lengths = jnp.asarray(COMMITTED), jnp.asarray(LENGTHS)
    hidden = forward(target, committed, positions_like(committed))[1]
    state = jax.jit(proposer.init)(params, committed, lengths, TargetOutput(None, hidden))
    tokens, probs, state = jax.jit(proposer.propose)(params, state, Context.of(committed, lengths),
                                                     jax.random.split(jax.random.key(0), 2))
    assert probs is None or spec.total_tokens is None
    parents = proposer.tree_parents(state, 2)
    return np.asarray(tokens), None if parents is None else np.asarray(parents)


def case_id(case: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in case.items())


def cases(first: dict, second: dict):
    """The first fast, the second slow: a tree program compiles in 10-20 s on the CPU."""
    return [pytest.param(first, id=case_id(first)), pytest.param(second, id=case_id(second), marks=pytest.mark.slow)]


# Several modules then the last one repeated (chained after or before the final norm, or fed the target's hidden
# state), and one module repeated. The ranked case past the modules (depth 5: 18 nodes, ten reference programs) is
# the slow one; depth 5 stays in the fast tier through the chain case and the caches' test.
CHAIN_CASES = cases(dict(num_modules=3, depth=5, chained=True, before_norm=True), dict(num_modules=1, depth=3, chained=True))
RANKED_CASES = cases(dict(num_modules=3, depth=3, chained=False), dict(num_modules=3, depth=5, chained=True))


@pytest.mark.parametrize("case", CHAIN_CASES)
def test_a_dynamic_tree_with_tree_top_k_1_is_the_chain_the_modules_draft(case):
    """Several modules then the last repeated, one module repeated, fed chained (after or before the final norm)
    or the target's hidden state: the one-path tree's tokens are the chain's drafts, row by row."""
    target = target_and_drafts()[0]
    modules = mtp_modules(target.config, case["num_modules"], chain_after_final_norm=not case.get("before_norm"))
    hidden_state = "chained" if case["chained"] else "target"
    chain = SpecConfig(method="mtp", num_speculative_tokens=case["depth"], mtp_hidden_state=hidden_state)
    tree = dataclasses.replace(chain, total_tokens=case["depth"], tree_top_k=1)
    chain_tokens, _ = drafted_tree(modules, chain)
    tree_tokens, parents = drafted_tree(modules, tree)
    assert (parents == np.arange(-1, case["depth"] - 1)).all()
    np.testing.assert_array_equal(tree_tokens, chain_tokens)


@pytest.mark.parametrize("case", RANKED_CASES)
def test_each_tree_node_is_its_parents_ranked_child_along_its_own_path(case):
    """tree_top_k 2, every candidate kept: every node's token is the r-th most likely token of the modules' distribution
    after its path's tokens (path_logits, computed without the tree), r its rank among its siblings."""
    target = target_and_drafts()[0]
    modules = mtp_modules(target.config, case["num_modules"])
    hidden_state = "chained" if case["chained"] else "target"
    spec = SpecConfig(method="mtp", num_speculative_tokens=case["depth"], total_tokens=2 + 4 * (case["depth"] - 1),
                      tree_top_k=2, mtp_hidden_state=hidden_state)
    tokens, parents = drafted_tree(modules, spec)
    hidden = forward(target, jnp.asarray(COMMITTED), positions_like(jnp.asarray(COMMITTED)))[1].final
    embed, lm_head = shared_of(target)
    depths = set()
    for row, length in enumerate(LENGTHS):
        n = int(length) - 1
        for parent in [-1, *range(tokens.shape[1])]:
            children = [i for i in range(tokens.shape[1]) if parents[row, i] == parent]
            if not children:
                continue
            path = [] if parent < 0 else [int(tokens[row, i]) for i in path_of(parents[row], parent)]
            sequence = jnp.asarray([list(COMMITTED[row, :n + 1]) + path])
            logits = path_logits(modules, embed, lm_head, sequence, hidden[row:row + 1, :n], n=n,
                                 hidden_state=hidden_state)
            ranked = np.argsort(-np.asarray(logits), kind="stable")
            assert tokens[row, children].tolist() == ranked[:len(children)].tolist(), (row, parent)
            depths.add(len(path))
    assert max(depths) == case["depth"] - 1  # the deepest expanded nodes were checked too


def test_module_caches_after_an_accepted_tree_path_equal_a_fresh_prefill():
    """Rows accept 5 (the whole depth), 2 and 0 nodes of a path through a depth-5 tree of three modules: the tree
    wrote each module's entries from slot n - m on, past what a chain's window of K + 1 reaches back to; the next
    propose repairs them: every module's entries of committed tokens equal a fresh prefill's."""
    target = target_and_drafts()[0]
    modules = mtp_modules(target.config, 3)
    depth, size = 5, 64
    proposer = build_proposer(SpecConfig(method="mtp", num_speculative_tokens=depth, total_tokens=18, tree_top_k=2),
                              SamplingConfig(), size, modules)
    params = proposer.bind(modules, target)
    rng = np.random.default_rng(2)
    lengths = np.array([9, 14, 3])
    tokens = np.zeros((3, size), np.int32)
    tokens[:, :14] = rng.integers(0, 128, (3, 14))

    def hidden(rows):
        rows = jnp.asarray(rows)
        return forward(target, rows, positions_like(rows))[1].final

    def fresh(tokens, lengths):
        return jax.jit(proposer.init)(params, jnp.asarray(tokens), jnp.asarray(lengths),
                                      TargetOutput(None, Hidden(final=hidden(tokens), layers=None)))

    def propose(state, tokens, lengths):
        return jax.jit(proposer.propose)(params, state, Context.of(jnp.asarray(tokens), jnp.asarray(lengths)),
                                         jax.random.split(jax.random.key(0), 3))

    drafts, _, state = propose(fresh(tokens, lengths), tokens, lengths)
    drafts, parents = np.asarray(drafts), np.asarray(state.parents)
    accepted, paths, committed = np.array([5, 2, 0]), np.full((3, depth), -1), tokens.copy()
    block = tokens.copy()  # [..., x_n, the path's tokens]: the verify forward's hidden states along the path
    for row, n in enumerate(lengths - 1):
        deepest = path_of(parents[row], int(np.argmax([len(path_of(parents[row], i)) for i in range(18)])))
        paths[row, :accepted[row]] = deepest[:accepted[row]]
        block[row, n + 1:n + 1 + depth] = drafts[row, deepest]
        committed[row, n + 1:n + 1 + accepted[row]] = drafts[row, deepest[:accepted[row]]]
        committed[row, n + 1 + accepted[row]] = (block[row, n + 1 + accepted[row]] + 1) % 128  # unlike the node
    verify_hidden = np.asarray(hidden(block))
    verify_hidden = jnp.asarray(np.stack([verify_hidden[row, n:n + depth + 1] for row, n in enumerate(lengths - 1)]))
    next_tokens = committed[np.arange(3), lengths + accepted]
    verify_output = TargetOutput(None, Hidden(final=verify_hidden, layers=None), path=jnp.asarray(paths))
    state = jax.jit(proposer.accept)(state, jnp.asarray(accepted), jnp.asarray(next_tokens), verify_output)
    new_lengths = lengths + accepted + 1
    _, _, state = propose(state, committed, new_lengths)
    expected = fresh(committed, new_lengths).cache
    for module in range(3):
        for row in range(3):
            count = new_lengths[row] - 1 - module  # module's entries of committed tokens: slots s + module + 1 <= n
            for got, want in zip(state.cache.layer(module), expected.layer(module)):
                np.testing.assert_allclose(np.asarray(got)[row, :count], np.asarray(want)[row, :count], atol=1e-4)


@pytest.mark.loop
def test_greedy_tree_output_is_identical_to_autoregressive():
    """Three modules, then the last repeated, drafting 10-node trees of depth 5 for ragged rows with EOS in paths."""
    target = target_and_drafts()[0]
    prompts, budgets = REQUESTS["ragged16"]()
    spec = SpecConfig(method="mtp", num_speculative_tokens=5, total_tokens=10, tree_top_k=2)
    result = generate(target, prompts, max_new_tokens=budgets, eos_token_ids=[EOS], spec=spec,
                      drafter=mtp_modules(target.config, 3))
    expected = autoregressive_outputs("ragged16")
    assert result.sequences() == expected.sequences()
    assert (result.stopped_by_eos == expected.stopped_by_eos).all() and expected.stopped_by_eos.any()
    assert 0 < result.metrics.summary()["acceptance_rate"] < 1


TREE = SpecConfig(method="mtp", num_speculative_tokens=3, total_tokens=6, tree_top_k=2)  # module 1, then it repeated
SAMPLINGS = (SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=5))


@pytest.mark.loop
@pytest.mark.slow
def test_tree_sampling_is_lossless_with_either_verifier():
    """Recursive rejection sampling ('standard') and traversal verification ('block'), both settings in one batch,
    one compiled loop for both verifiers: the first three tokens follow the target (chi-square)."""
    check_lossless(tree_joint_counts(TREE, SAMPLINGS, tiny_mtp_modules()), SAMPLINGS)


@pytest.mark.loop
@pytest.mark.slow
def test_negative_control_accepting_the_first_ranked_path_fails(monkeypatch):
    assert first_ranked_pvalue(monkeypatch, TREE, tiny_mtp_modules()) < 1e-6
