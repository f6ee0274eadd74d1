"""Which products an EAGLE head's training step runs on the GPU, and in which dtypes, found on the CPU.

    PYTHONPATH=. python benchmarks/probes/head_step_products.py [--batch 4] [--seq-len 2048] [--remat layer]
        [--platform cuda]

Lowers the gradient of training.eagle.eagle3_head_loss (the offline step of scripts/bench_train_head.py: an
EAGLE-3 head against stored 8B-shaped features, 7 training-time-test steps, SpecForge's 32,000 draft ids) for
`--platform` with abstract inputs, so nothing of the 8B shape is allocated, and sums its dot_generals' FLOPs by
(lhs, rhs, result) element types. Lowering for CUDA on a CPU needs two stand-ins: jax.default_backend() answers
"gpu" while it traces (models.transformer.einsum_f32 chooses its GPU form from it), and the attention is XLA's,
since choosing cuDNN's needs a GPU (its fused kernel is one custom call, no dot_general, on the device).
"""

import argparse
import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import export

from specjax import benchmarking
from specjax.config import DataConfig, HeadTrainConfig, MeshConfig
from specjax.models.transformer import Hidden
from specjax.training.eagle import TargetVocabulary, build_head, eagle3_head_loss

OPERANDS = re.compile(r":\s*\((tensor<[^>]*>), (tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)")
CONTRACTING = re.compile(r"contracting_dims = \[([\d, ]*)\] x")


def dims(tensor: str) -> tuple[list[int], str]:
    *shape, dtype = tensor[len("tensor<"):-1].split("x")
    return [int(d) for d in shape], dtype


def products(mlir: str) -> dict[tuple[str, str, str], list[float]]:
    """(lhs, rhs, result) element types -> [count, FLOPs] of the module's dot_generals."""
    totals: dict[tuple[str, str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for line in mlir.splitlines():
        if "stablehlo.dot_general" not in line:
            continue
        lhs, rhs, result = OPERANDS.search(line).groups()
        (lhs_shape, lhs_type), (_, rhs_type), (out_shape, out_type) = dims(lhs), dims(rhs), dims(result)
        contracted = int(np.prod([lhs_shape[int(i)] for i in CONTRACTING.search(line).group(1).split(",")]))
        entry = totals[(lhs_type, rhs_type, out_type)]
        entry[0] += 1
        entry[1] += 2.0 * float(np.prod(out_shape)) * contracted
    return dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--remat", default="layer")
    parser.add_argument("--platform", default="cuda")
    args = parser.parse_args()
    target = benchmarking.SHAPES["8b"][0]
    config = HeadTrainConfig(target="shape:8b", kind="eagle3", unroll_steps=7, draft_vocab_size=32000,
                             data=DataConfig(seq_len=args.seq_len, batch_size=args.batch), remat=args.remat,
                             compute_dtype="bfloat16", mesh=MeshConfig(data=1), output_dir="/tmp/head_step_products")
    head = build_head(config, target, np.random.default_rng(0).integers(0, target.vocab_size, 100_000))
    graphdef, params, rest = nnx.split(head, nnx.Param, ...)

    def loss(params, tokens, hidden, vocabulary):
        return eagle3_head_loss(nnx.merge(graphdef, params, rest), vocabulary, tokens, hidden, 7, config.step_decay)

    shaped = jax.ShapeDtypeStruct
    width, bf16 = (args.batch, args.seq_len + 1, target.hidden_size), jnp.bfloat16
    hidden = Hidden(final=shaped(width, bf16), layers=shaped((3, *width), bf16))
    vocabulary = TargetVocabulary(shaped((target.vocab_size, target.hidden_size), bf16),
                                  None if target.tie_word_embeddings else
                                  shaped((target.hidden_size, target.vocab_size), bf16), "bfloat16",
                                  target.matmul_precision)
    inputs = (jax.tree.map(lambda x: shaped(x.shape, x.dtype), params),
              shaped((args.batch, args.seq_len + 1), jnp.int32), hidden, vocabulary)
    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    if args.platform == "cpu":
        mlir = step.lower(*inputs).as_text()
    else:
        attention = jax.nn.dot_product_attention
        jax.default_backend = lambda: "gpu"
        jax.nn.dot_product_attention = lambda *a, implementation=None, **k: attention(*a, implementation="xla", **k)
        mlir = export.export(step, platforms=[args.platform])(*inputs).mlir_module()
    totals = products(mlir)
    print(f"EAGLE-3 head step, 8b, batch {args.batch}, T {args.seq_len}, remat {args.remat}, for {args.platform}:")
    for (lhs, rhs, out), (count, flops) in sorted(totals.items(), key=lambda item: -item[1][1]):
        print(f"  {lhs} x {rhs} -> {out}: {count:.0f} products, {flops / 1e12:.2f} TFLOP")
    print(f"  all: {sum(flops for _, flops in totals.values()) / 1e12:.2f} TFLOP")


if __name__ == "__main__":
    main()
