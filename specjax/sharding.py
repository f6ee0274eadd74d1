"""Several devices: one `Mesh` with a data and a model axis, and where every array lives on it.

Parameters are split Megatron-style over the model axis: q, k, v, gate and up projections by their
output (heads, intermediate) — column parallel — and the attention output and down projections by
their input — row parallel, so each layer needs one all-reduce after attention and one after the MLP.
The embedding and the LM head are split over the vocabulary (logits come out vocabulary-split). KV
caches are split over batch (data axis) and KV heads (model axis); batches over the data axis.
A dimension the axis does not divide stays whole (e.g. 2 KV heads on a model axis of 4: k and v
projections and caches replicated), so every model runs on every mesh.

Inside jitted code nothing names a device: the loops call `constrain(x, spec)`, a no-op unless a mesh
is set (`jax.set_mesh`, which `specjax.decoding.generate(mesh=...)` does), and GSPMD partitions the
one program. The same program serves one device, one host with several, and several hosts after
`initialize_distributed()`.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA, MODEL = "data", "model"
BATCH = PartitionSpec(DATA)  # [B, ...] arrays
CACHE = PartitionSpec(None, DATA, None, MODEL, None)  # KVCache.k / .v: [L, B, S, H_kv, D]
LAYER_CACHE = PartitionSpec(*CACHE[1:])  # one layer's of a per-layer cache: [B, S, H_kv, D]

# Parameter name -> the mesh axis of each dimension of one layer's weight; names not listed are
# replicated. Stacked decoder weights (specjax.models.transformer.StackedLayers) carry a leading layer
# axis in front, which stays whole. A drafter's pytree adds rules for names of its own with a
# `parameter_rules` class attribute of the same form (e.g. specjax.proposers.eagle.EagleParams).
PARAMETER_RULES: dict[str, tuple[str | None, ...]] = {
    "wq": (None, MODEL, None),  # [D, H, E]: column parallel over heads
    "wk": (None, MODEL, None),  # [D, H_kv, E]
    "wv": (None, MODEL, None),
    "bq": (MODEL, None),  # [H, E]
    "bk": (MODEL, None),
    "bv": (MODEL, None),
    "wo": (MODEL, None, None),  # [H, E, D]: row parallel
    "w_gate": (None, MODEL),  # [D, F]: column parallel
    "w_up": (None, MODEL),
    "b_gate": (MODEL,),  # [F]
    "b_up": (MODEL,),
    "w_down": (MODEL, None),  # [F, D]: row parallel
    "wqkv": (None, MODEL, None, None),  # [D, M, H/M + 2K/M, E]: transformer.DecodingLayer, shard-major
    "bqkv": (MODEL, None, None),
    "w_gate_up": (None, MODEL, None, None),  # [D, M, 2, F/M]
    "b_gate_up": (MODEL, None, None),
    "embed": (MODEL, None),  # [V, D]: vocabulary parallel
    "lm_head": (None, MODEL),  # [D, V]
}


STACKED = ("layers", "layer")  # modules whose weights may carry a leading layer axis (StackedLayers)


def make_mesh(data: int = 1, model: int = 1, devices=None) -> Mesh:
    """A (data, model) mesh over the first data * model of `devices` (default: every device of every
    process). data=-1 takes every device the model axis leaves."""
    devices = list(jax.devices() if devices is None else devices)
    if data == -1 and model >= 1:
        data = len(devices) // model
    if data < 1 or model < 1 or data * model > len(devices):
        raise ValueError(f"mesh data={data} x model={model} needs {max(data, 0) * model} devices: allowed at most "
                         f"{len(devices)} (data=-1 takes what the model axis leaves)")
    return Mesh(np.asarray(devices[:data * model]).reshape(data, model), (DATA, MODEL))


def fit_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh_shape: dict[str, int]) -> PartitionSpec:
    """spec with every axis dropped that does not divide its dimension (that dimension is replicated)."""
    fitted = []
    for dim, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        fitted.append(axis if axis is not None and dim % mesh_shape.get(axis, 1) == 0 else None)
    return PartitionSpec(*fitted)


def parameter_spec(path: tuple, shape: tuple[int, ...], mesh: Mesh, fsdp: bool = False,
                   rules: dict[str, tuple[str | None, ...]] = PARAMETER_RULES) -> PartitionSpec:
    """The spec of the parameter at `path` (its last name picks the rule). fsdp additionally splits
    the first whole dimension the data axis divides (after the layer axis of stacked weights)."""
    name = str(path[-1]) if path else ""
    rule = rules.get(name, ())
    # Stacked layers carry the layer axis; to_decoding_layout' have a layer index in their path instead.
    stacked = any(n in STACKED for n in path) and not any(n.isdigit() for n in path)
    rule = (None, *rule) if stacked and len(shape) == len(rule) + 1 else rule
    rule = rule if len(rule) == len(shape) else ()  # e.g. Medusa's per-head LM heads: another layout
    spec = list(fit_spec(PartitionSpec(*rule), shape, dict(mesh.shape)))
    if fsdp and mesh.shape[DATA] > 1:
        for dim in range(1 if stacked else 0, len(shape)):  # the layer axis stays whole: the scan slices it
            if spec[dim] is None and shape[dim] % mesh.shape[DATA] == 0:
                spec[dim] = DATA
                break
    return PartitionSpec(*spec)


def shardings(tree, mesh: Mesh, fsdp: bool = False):
    """A NamedSharding for every array of a pytree (a model, a drafter's bound weights, a training state
    with its optimizer moments), by the name each array has in the tree (see PARAMETER_RULES, and the
    tree's own `parameter_rules`)."""
    rules = {**PARAMETER_RULES, **getattr(tree, "parameter_rules", {})}
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, parameter_spec(_names(path), np.shape(leaf), mesh, fsdp, rules)), tree)


def shard(tree, mesh: Mesh, fsdp: bool = False):
    """The pytree placed on the mesh by the rules; arrays already placed so are not copied."""
    return tree if tree is None else jax.device_put(tree, shardings(tree, mesh, fsdp))


def put(x, mesh: Mesh, spec: PartitionSpec = BATCH):
    """Host or device arrays (a pytree) onto the mesh, each split by spec where the mesh divides it."""
    return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, fit_spec(spec, np.shape(a),
                                                                                dict(mesh.shape)))), x)


def to_host(tree):
    """Numpy copies of whole arrays, also of arrays split over several hosts (gathered from every
    process, which must all call this)."""
    from jax.experimental import multihost_utils

    def whole(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(whole, tree)


def constrain(x, spec: PartitionSpec):
    """Inside jit: x laid out as spec on the mesh set by `jax.set_mesh` (axes that do not divide are
    dropped); unchanged when no mesh is set, so single-device code pays nothing."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, fit_spec(spec, x.shape, dict(mesh.shape)))


def vocabulary_argmax(scores: jax.Array) -> jax.Array:
    """jnp.argmax over the last (vocabulary) axis, as int32, for use inside jit. On a mesh whose model
    axis splits that axis (logits from the vocabulary-parallel LM head), each shard takes its own best
    and the shards swap (value, index) pairs in one all-gather; XLA's own partitioning of argmax
    gathers the values and the indices separately, two collectives where latency counts most
    (docs/multi-device.md). Ties go to the lowest index, as jnp.argmax's."""
    mesh = jax.sharding.get_abstract_mesh()
    shards = 1 if mesh.empty else dict(mesh.shape).get(MODEL, 1)
    if shards == 1 or scores.shape[-1] % shards:
        return jnp.argmax(scores, axis=-1).astype(jnp.int32)
    spec = fit_spec(PartitionSpec(DATA, *[None] * (scores.ndim - 2), MODEL), scores.shape, dict(mesh.shape))
    shard_size = scores.shape[-1] // shards

    def per_shard(block):
        index = jnp.argmax(block, axis=-1).astype(jnp.int32)
        value = jnp.max(block, axis=-1).astype(jnp.float32)
        pairs = jax.lax.all_gather(jnp.stack([value, jax.lax.bitcast_convert_type(index, jnp.float32)]), MODEL)
        best = jnp.argmax(pairs[:, 0], axis=0)  # [M, 2, ...] -> the first shard holding the maximum
        local = jnp.take_along_axis(pairs[:, 1], best[None], axis=0)[0]
        return jax.lax.bitcast_convert_type(local, jnp.int32) + best.astype(jnp.int32) * shard_size

    # Every model shard computes the same choice from the same gathered pairs (not inferred by JAX).
    return jax.shard_map(per_shard, in_specs=spec, out_specs=PartitionSpec(*spec[:-1]), check_vma=False)(scores)


COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_CALLED = re.compile(r"(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
                     r"|branch_computations=\{([^}]*)\}")
_COLLECTIVE = re.compile(r"= [^=]* (" + "|".join(COLLECTIVE_OPS) + r")(?:-start)?\(")


def step_collectives(compiled_hlo: str) -> dict[str, int]:
    """Collectives in one step of a compiled decoding loop: the ops in the body of its outermost
    `while` and every computation it calls, by kind (`all-reduce`: n, ...).
    A collective inside a nested loop (e.g. K drafting steps) counts once. `compiled_hlo` is
    `jitted.lower(...).compile().as_text()`, compiled for a mesh."""
    computations, name = {}, None
    for line in compiled_hlo.splitlines():
        match = _COMPUTATION.match(line)
        if match:
            name = match.group(1)
            computations[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            computations[name].append(line)

    def called(lines):
        for line in lines:
            for single, group in _CALLED.findall(line):
                yield from ([single] if single else [c.strip().lstrip("%") for c in group.split(",")])

    def count(root):
        counts, seen, todo = dict.fromkeys(COLLECTIVE_OPS, 0), set(), [root]
        while todo:
            name = todo.pop()
            if name in seen or name not in computations:
                continue
            seen.add(name)
            for line in computations[name]:
                op = _COLLECTIVE.search(line)
                if op:
                    counts[op.group(1)] += 1
            todo.extend(called(computations[name]))
        return counts

    bodies = [re.search(r"body=%?([\w.\-]+)", line).group(1) for lines in computations.values() for line in lines
              if " while(" in line]
    if not bodies:
        raise ValueError("step_collectives: the compiled program has no while loop")
    # The outermost loop's body calls every nested one: it has the most.
    return max((count(body) for body in bodies), key=lambda counts: sum(counts.values()))


def _names(path) -> tuple[str, ...]:
    """The attribute and key names along a pytree path (nnx Variables end in `.value`, skipped)."""
    names = []
    for key in path:
        name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", None)))
        if name is not None and name != "value":
            names.append(str(name))
    return tuple(names)


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> None:
    """Joins this process to a multi-host run (jax.distributed.initialize); afterwards jax.devices() lists
    every host's devices and make_mesh spans them. Arguments default to SPECJAX_COORDINATOR,
    SPECJAX_NUM_PROCESSES and SPECJAX_PROCESS_ID, else to what JAX detects (SLURM, TPU pods)."""
    env = os.environ
    coordinator_address = coordinator_address or env.get("SPECJAX_COORDINATOR")
    if num_processes is None and "SPECJAX_NUM_PROCESSES" in env:
        num_processes = int(env["SPECJAX_NUM_PROCESSES"])
    if process_id is None and "SPECJAX_PROCESS_ID" in env:
        process_id = int(env["SPECJAX_PROCESS_ID"])
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
