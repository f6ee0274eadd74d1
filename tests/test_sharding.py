"""Several devices on the CPU (eight host devices, set in conftest.py): meshes 8x1, 1x8 and 2x4 give
the one-device logits (1e-5, float32) and exactly the one-device tokens, for the autoregressive and
speculative loops, every verifier and every drafter; a training step on a mesh (data parallel, and
FSDP) equals the one-device step; the compiled program splits the weights Megatron-style (one
all-reduce after attention and one after the MLP per layer) and never gathers a whole weight."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.models import assert_float32_close, positions_like
from jax.sharding import PartitionSpec

from specjax import sharding
from specjax.config import (DataConfig, MeshConfig, ModelConfig, OptimizerConfig, SamplingConfig, SpecConfig,
                            TrainConfig)
from specjax.decoding import decode_loop, generate, loop_arrays, pad_request, speculative_loop
from specjax.models.eagle import EagleConfig, init_eagle, head_to_decoding_layout, with_draft_vocabulary
from specjax.models.medusa import MedusaConfig, init_medusa
from specjax.models.transformer import init_model, to_decoding_layout
from specjax.proposers import build_proposer
from specjax.training.lm import fit, next_token_loss
from specjax.verify.sampling import GREEDY as GREEDY_MODE

MESHES = [(8, 1), (1, 8), (2, 4)]  # (data, model)
# 8 query heads split on every model axis; 4 KV heads split on 2x4 and replicated on 1x8.
TARGET = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8,
                     intermediate_size=128)
DRAFT = dataclasses.replace(TARGET, num_layers=1, intermediate_size=64)
GREEDY, T1 = SamplingConfig(), SamplingConfig(temperature=1.0)
# The prompts twice, greedy then sampled, in one batch: the settings are data, so one program per loop and
# mesh serves both (generate's keyword arguments).
GREEDY_AND_T1 = dict(sampling=[GREEDY] * 8 + [T1] * 8, seeds=list(range(16)))


@pytest.fixture(scope="module")
def models():
    target = init_model(TARGET, seed=0)
    head_layer = dataclasses.replace(TARGET, num_layers=1)
    eagle = init_eagle(EagleConfig(layer=head_layer, version=1), seed=2)
    return {"target": target, "draft_model": init_model(DRAFT, seed=1), "eagle": eagle,
            # FR-Spec: the EAGLE-1 head drafting over 96 of the 256 ids (its restricted LM head is split too).
            "eagle_fr": with_draft_vocabulary(eagle, np.arange(0, 192, 2)),
            "eagle3": init_eagle(EagleConfig(layer=head_layer, version=3, fuse_layers=(0, 1, 1)), seed=3),
            "medusa": init_medusa(MedusaConfig(num_heads=4, hidden_size=64, vocab_size=256), target, seed=4),
            "ngram": None}


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    # Repeats inside the prompts give the n-gram drafter something to find.
    return [np.tile(rng.integers(0, 256, 3), n).tolist()[:3 * n + 1] for n in (2, 3, 1, 4, 2, 5, 3, 2)]


def test_weights_are_placed_megatron_style():
    mesh = sharding.make_mesh(2, 4)
    model = sharding.shard(init_model(TARGET), mesh)
    layers = model.layers
    assert layers.wq[...].sharding.spec == PartitionSpec(None, None, "model", None)  # column parallel
    assert layers.wo[...].sharding.spec == PartitionSpec(None, "model", None, None)  # row parallel
    assert layers.w_up[...].sharding.spec == PartitionSpec(None, None, "model")
    assert layers.w_down[...].sharding.spec == PartitionSpec(None, "model", None)
    assert model.lm_head[...].sharding.spec == PartitionSpec(None, "model")  # vocabulary parallel
    assert layers.attn_norm[...].sharding.spec == PartitionSpec(None, None)
    # 4 KV heads do not split 8 ways: replicated there, split 4 ways on the 2x4 mesh.
    wide = sharding.shard(init_model(TARGET), sharding.make_mesh(1, 8))
    assert wide.layers.wk[...].sharding.spec == PartitionSpec(None, None, None, None)
    assert layers.wk[...].sharding.spec == PartitionSpec(None, None, "model", None)
    # FSDP also splits the first whole dimension after the layer axis over the data axis.
    assert sharding.parameter_spec(("layers", "wq"), (2, 64, 8, 8), mesh, fsdp=True) == PartitionSpec(
        None, "data", "model", None)
    assert sharding.parameter_spec(("final_norm",), (64,), mesh, fsdp=True) == PartitionSpec("data")
    assert sharding.parameter_spec(("layers", "attn_norm"), (2, 64), mesh, fsdp=True) == PartitionSpec(None, "data")


def test_bad_meshes_are_refused():
    with pytest.raises(ValueError, match="mesh data=4 x model=4 needs 16 devices: allowed at most 8"):
        sharding.make_mesh(4, 4)
    assert dict(sharding.make_mesh(-1, 2).shape) == {"data": 4, "model": 2}


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_logits_match_one_device(models, mesh_shape):
    target = models["target"]
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, TARGET.vocab_size, (8, 6)), jnp.int32)
    want, _, _ = jax.jit(lambda m, t: m(t, positions_like(t)))(target, tokens)
    mesh = sharding.make_mesh(*mesh_shape)
    with jax.set_mesh(mesh):
        got, _, _ = jax.jit(lambda m, t: m(t, positions_like(t)))(sharding.shard(target, mesh),
                                                                   sharding.put(tokens, mesh))
    assert not got.sharding.is_fully_replicated or mesh_shape == (1, 1)
    assert_float32_close(got, want)


@pytest.mark.loop
@pytest.mark.parametrize("mesh_shape", MESHES)
def test_autoregressive_tokens_match_one_device(models, prompts, mesh_shape):
    kwargs = dict(max_new_tokens=12, **GREEDY_AND_T1)
    want = generate(models["target"], prompts * 2, **kwargs)
    got = generate(models["target"], prompts * 2, **kwargs, mesh=sharding.make_mesh(*mesh_shape))
    assert got.sequences() == want.sequences()


@pytest.mark.loop
@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4)])
def test_the_decoding_layout_matches_one_device(models, prompts, mesh_shape):
    """to_decoding_layout and head_to_decoding_layout made for the mesh's model axis: the same greedy and sampled tokens as
    the stacked models on one device, autoregressive and speculative (draft model, EAGLE-1), and their
    fused weights split by heads."""
    mesh = sharding.make_mesh(*mesh_shape)
    target = to_decoding_layout(models["target"], model_shards=mesh_shape[1])
    drafters = {"draft_model": to_decoding_layout(models["draft_model"], model_shards=mesh_shape[1]),
                "eagle": head_to_decoding_layout(models["eagle"], model_shards=mesh_shape[1])}
    placed = sharding.shard(target, mesh)
    model_axis = sharding.MODEL if TARGET.num_kv_heads % mesh_shape[1] == 0 else None  # else one-device layout
    assert placed.layers[0].wqkv[...].sharding.spec == PartitionSpec(None, model_axis, None, None)
    assert placed.layers[0].w_gate_up[...].sharding.spec == PartitionSpec(None, model_axis, None, None)
    assert sharding.shard(drafters["eagle"], mesh).layer.wqkv[...].sharding.spec == PartitionSpec(
        None, model_axis, None, None)
    runs = [({}, {})]
    for method, drafter in drafters.items():
        spec = SpecConfig(method=method, num_speculative_tokens=3)
        runs.append((dict(spec=spec, drafter=drafter), dict(spec=spec, drafter=models[method])))
    for extra, reference in runs:
        want = generate(models["target"], prompts * 2, max_new_tokens=10, **GREEDY_AND_T1, **reference)
        got = generate(placed, prompts * 2, max_new_tokens=10, **GREEDY_AND_T1, mesh=mesh, **extra)
        assert got.sequences() == want.sequences(), bool(extra)


VERIFIERS = [  # (sampling, SpecConfig changes, gather_logits)
    (GREEDY, {}, False),
    (T1, {"rejection_sample_method": "standard", "draft_sample_method": "probabilistic"}, False),
    (T1, {"rejection_sample_method": "block", "draft_sample_method": "probabilistic"}, False),
    (T1, {"rejection_sample_method": "block", "draft_sample_method": "probabilistic"}, True),
    (T1, {"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.5}, False),
]


# Greedy on every mesh; the sampling verifiers on 2x4, which splits both the rows and the vocabulary
# (what 8x1 and 1x8 split alone), so that each verifier compiles one sharded program, not three.
VERIFIER_CASES = [pytest.param(mesh, *VERIFIERS[0], id=f"greedy-{mesh[0]}x{mesh[1]}") for mesh in MESHES] + [
    pytest.param((2, 4), *case, id=f"{name}-2x4")
    for name, case in zip(["standard", "block", "block-gathered-logits", "synthetic"], VERIFIERS[1:])]


@pytest.mark.loop
@pytest.mark.parametrize("mesh_shape, sampling, changes, gather_logits", VERIFIER_CASES)
def test_speculative_tokens_match_one_device_for_every_verifier(models, prompts, mesh_shape, sampling, changes,
                                                                  gather_logits):
    spec = SpecConfig(method="draft_model", num_speculative_tokens=3, **changes)
    kwargs = dict(max_new_tokens=12, sampling=sampling, seeds=list(range(8)), spec=spec, drafter=models["draft_model"])
    want = generate(models["target"], prompts, **kwargs)
    got = generate(models["target"], prompts, **kwargs, mesh=sharding.make_mesh(*mesh_shape),
                   gather_logits=gather_logits)
    assert got.sequences() == want.sequences()
    assert got.metrics.summary() == want.metrics.summary()


@pytest.mark.loop
@pytest.mark.parametrize("method", ["eagle", "eagle_fr", "eagle3", "medusa", "ngram", "eagle3_tree"])
def test_every_drafter_matches_one_device(models, prompts, method):
    tree = dict(total_tokens=8, tree_top_k=2) if method.endswith("_tree") else {}  # an EAGLE-2 dynamic tree
    method = method.removesuffix("_tree")
    spec = SpecConfig(method="eagle" if method == "eagle_fr" else method, num_speculative_tokens=3,
                      prompt_lookup_min=1, prompt_lookup_max=3, **tree)
    kwargs = dict(max_new_tokens=12, spec=spec, drafter=models[method])
    want = generate(models["target"], prompts, **kwargs)
    got = generate(models["target"], prompts, **kwargs, mesh=sharding.make_mesh(2, 4))
    assert got.sequences() == want.sequences()
    assert got.metrics.summary() == want.metrics.summary()
    if method == "eagle_fr":  # the restricted LM head, [D, 96], is split over its vocabulary like the target's
        proposer = build_proposer(spec, GREEDY, 64, models[method])
        bound = sharding.shard(proposer.bind(models[method], models["target"]), sharding.make_mesh(2, 4))
        assert bound.draft_lm_head.sharding.spec == PartitionSpec(None, sharding.MODEL)


@pytest.mark.train
@pytest.mark.parametrize("mesh_shape, fsdp", [((8, 1), False), ((2, 4), False), ((8, 1), True), ((2, 4), True)])
def test_a_training_step_on_a_mesh_equals_the_one_device_step(tmp_path, mesh_shape, fsdp):
    rng = np.random.default_rng(1)
    batches = rng.integers(0, TARGET.vocab_size, (3, 8, 17)).astype(np.int32)

    def train(mesh: MeshConfig, fsdp: bool, folder: str):
        run = TrainConfig(model=TARGET, data=DataConfig(), optimizer=OptimizerConfig(lr=1e-2, warmup_steps=1,
                          total_steps=3), mesh=mesh, fsdp=fsdp, checkpoint_every=3, log_every=1)
        loss = lambda model, batch, _: (next_token_loss(model, batch),) * 2  # noqa: E731
        trained = fit(init_model(TARGET, seed=5), lambda m, b, f: (loss(m, b, f)[0], {"loss": loss(m, b, f)[0]}),
                      lambda step: batches[step - 1], run, tmp_path / folder, description="test")
        return jax.tree.leaves(jax.device_get(trained))

    one_device = train(MeshConfig(data=1, model=1), False, "one")
    on_mesh = train(MeshConfig(*mesh_shape), fsdp, "mesh")
    for a, b in zip(on_mesh, one_device, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def compiled_text(lowered_fn) -> str:
    return lowered_fn.compile().as_text()


def collectives(text: str, op: str) -> list[tuple[int, ...]]:
    """Result shapes of every `op` (all-gather, all-reduce, ...) in compiled HLO text."""
    shapes = []
    for match in re.finditer(rf"= \w+\[([\d,]*)\][^ ]* {op}(?:-start)?\(", text):
        shapes.append(tuple(int(d) for d in match.group(1).split(",") if d))
    return shapes


def parameter_shapes(module) -> set[tuple[int, ...]]:
    """Every weight's shape, whole and per layer (what a per-step gather of weights would produce)."""
    shapes = set()
    for leaf in jax.tree.leaves(module):
        if np.ndim(leaf) >= 2:
            shapes |= {tuple(np.shape(leaf)), tuple(np.shape(leaf))[1:]}
    return shapes


@pytest.mark.loop
@pytest.mark.parametrize("layout", ["stacked", "decoding"])
def test_the_compiled_loops_all_reduce_activations_and_never_gather_weights(models, prompts, layout):
    """Also for the decoding layout (to_decoding_layout for 4 model shards): its fused q/k/v and gate/up
    weights are shard-major, so splitting them needs no collective either."""
    mesh = sharding.make_mesh(2, 4)
    split = (lambda m: to_decoding_layout(m, model_shards=4)) if layout == "decoding" else (lambda m: m)  # noqa: E731
    target, draft_model = split(models["target"]), split(models["draft_model"])
    request = pad_request(target, prompts, 12, 0, None, 4, batch_multiple=2)
    args, mode = loop_arrays(request, T1)
    proposer = build_proposer(SpecConfig(method="draft_model", num_speculative_tokens=3), mode, request.cache_size,
                              draft_model)
    with jax.set_mesh(mesh):
        placed, placed_args = sharding.shard(target, mesh), sharding.put(args, mesh)
        draft = sharding.shard(proposer.bind(draft_model, target), mesh)
        programs = {
            "autoregressive": compiled_text(decode_loop.lower(placed, *placed_args, mode=GREEDY_MODE,
                                                              eos_token_ids=(), cache_size=request.cache_size)),
            "speculative": compiled_text(speculative_loop.lower(placed, draft, *placed_args, proposer=proposer,
                                                                eos_token_ids=())),
        }
    weights = parameter_shapes(target) | parameter_shapes(draft_model)
    rows_per_shard = request.tokens.shape[0] // 2
    for name, text in programs.items():
        gathered = collectives(text, "all-gather")
        assert not weights & set(gathered), f"{name} gathers a weight: {sorted(weights & set(gathered))}"
        # Row-parallel outputs of the decode step ([rows, 1 or K + 1, D]) are summed over the model axis.
        width = 1 if name == "autoregressive" else 4
        assert (rows_per_shard, width, TARGET.hidden_size) in collectives(text, "all-reduce"), name


@pytest.mark.parametrize("mesh_shape, shape", [((1, 2), (3, 256)), ((2, 4), (4, 5, 256)), ((2, 4), (3, 250))])
def test_the_vocabulary_argmax_is_jnps_in_one_all_gather(mesh_shape, shape):
    """Ties everywhere (integer scores): the lowest index wins, as jnp.argmax's; 250 ids do not split 4 ways
    (jnp.argmax itself, nothing gathered)."""
    scores = np.random.default_rng(0).integers(0, 5, shape).astype(np.float32)
    mesh = sharding.make_mesh(*mesh_shape)
    with jax.set_mesh(mesh):
        placed = sharding.put(scores, mesh, PartitionSpec(sharding.DATA, *[None] * (len(shape) - 2), sharding.MODEL))
        got = jax.jit(sharding.vocabulary_argmax)(placed)
        text = compiled_text(jax.jit(sharding.vocabulary_argmax).lower(placed))
    np.testing.assert_array_equal(np.asarray(got), np.argmax(scores, axis=-1))
    assert len(collectives(text, "all-gather")) == (shape[-1] % mesh_shape[1] == 0)
    assert not collectives(text, "all-reduce")


@pytest.mark.loop
@pytest.mark.parametrize("sampling", [GREEDY, T1], ids=["greedy", "T1"])
def test_a_decode_step_makes_two_all_reduces_a_layer_one_for_the_embedding_and_one_all_gather(models, prompts,
                                                                                              sampling):
    """The per-step collectives of the compiled loop (model axis 2, the decoding layout's unrolled layers):
    the row-parallel attention and MLP outputs, the vocabulary-parallel embedding's rows, and the token's
    choice as (value, index) pairs (sharding.vocabulary_argmax, also under the Gumbel-max draw of
    sampling.categorical; XLA's own argmax gathers twice)."""
    mesh = sharding.make_mesh(1, 2)
    target = to_decoding_layout(models["target"], model_shards=2)
    request = pad_request(target, prompts, 8, 0, None, 4)
    args, mode = loop_arrays(request, sampling)
    with jax.set_mesh(mesh):
        text = compiled_text(decode_loop.lower(sharding.shard(target, mesh), *sharding.put(args, mesh),
                                               mode=mode, eos_token_ids=(), cache_size=request.cache_size))
    counts = {op: n for op, n in sharding.step_collectives(text).items() if n}
    assert counts == {"all-reduce": 2 * TARGET.num_layers + 1, "all-gather": 1}


@pytest.mark.e2e
def test_runs_and_generate_take_a_mesh_from_the_command_line(tmp_path, capsys):
    import yaml

    from specjax import cli

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"target": "default:target", "spec": {"method": "eagle"}, "num_prompts": 4,
                                      "prompt_len": 32, "max_new_tokens": 16}))
    assert cli.main(["run", str(config), "--set", "mesh={data: 2, model: 2}"]) == 0
    out = capsys.readouterr().out
    assert "| eagle | 4 | greedy | 0 | greedy |" in out and out.split("\n")[2].endswith("| 4/4 |")
    assert cli.main(["generate", "--mesh", "1,2", "--prompt", "import os", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("import os")
    assert cli.main(["generate", "--mesh", "two", "--prompt", "x"]) == 2
    assert "--mesh 'two' is invalid: allowed DATA,MODEL" in capsys.readouterr().err
