"""The `specjax` command."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from specjax.config import ConfigError, SamplingConfig, SpecConfig


def _generate(args: argparse.Namespace) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # silences "PyTorch was not found"
    from transformers import AutoTokenizer

    from specjax import default_models
    from specjax.decoding import generate
    from specjax.models import hf
    from specjax.models.transformer import for_decoding

    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    mesh, model_shards = None, 1
    if args.mesh:
        from specjax import sharding

        data, model_shards = _mesh_shape(args.mesh)
        mesh = sharding.make_mesh(data, model_shards)

    model_dir = default_models.resolve(args.model)
    model = for_decoding(hf.load(model_dir, param_dtype=args.param_dtype, dtype=args.dtype), model_shards)
    spec = drafter = None
    method = _method(args)
    if method is not None:
        drafter = _drafter(method, args, model, model_shards)
        spec = SpecConfig(method=method, num_speculative_tokens=args.num_speculative_tokens,
                          rejection_sample_method=args.rejection_sample_method,
                          draft_sample_method=args.draft_sample_method)
    tokenizer = AutoTokenizer.from_pretrained(default_models.tokenizer_folder(args.model))
    prompt = tokenizer.encode(args.prompt, add_special_tokens=False)
    if tokenizer.bos_token_id is not None:
        prompt = [tokenizer.bos_token_id, *prompt]
    start = time.perf_counter()
    result = generate(model, [prompt], max_new_tokens=args.max_new_tokens, sampling=sampling,
                      eos_token_ids=hf.eos_token_ids(model_dir), seeds=args.seed, spec=spec, drafter=drafter,
                      mesh=mesh)
    seconds = time.perf_counter() - start
    tokens = result.sequences()[0]
    print(args.prompt + tokenizer.decode(tokens, skip_special_tokens=True))
    print(f"\n[{len(tokens)} tokens in {seconds:.2f} s including compilation; "
          f"{'stopped at EOS' if result.stopped_by_eos[0] else 'token budget reached'}]", file=sys.stderr)
    if result.metrics is not None:
        print(result.metrics.format_summary())
    return 0


def _method(args: argparse.Namespace) -> str | None:
    """--method; with only --draft, the method whose bundled drafter it names or which recognizes its
    folder (e.g. a DFlash drafter's config.json), else draft_model."""
    if args.method is not None or args.draft is None:
        return args.method
    from specjax import default_models
    from specjax.proposers import PROPOSERS

    folder = default_models.resolve(args.draft)
    return next((name for name, proposer in PROPOSERS.items()
                 if proposer.default_drafter == args.draft or proposer.recognizes(folder)), "draft_model")


def _drafter(method: str, args: argparse.Namespace, target, model_shards: int):
    """The weights of --method's drafter: from --draft, else the method's bundled one (with the bundled
    target), loaded by its registered proposer in the target's compute dtype."""
    from specjax import default_models
    from specjax.experiments import default_drafter, load_drafter
    from specjax.proposers import proposer_class

    proposer = proposer_class(method)
    if not proposer.needs_drafter and args.draft is not None:
        raise ValueError(f"--draft {args.draft} is invalid with --method {method}: that method has no weights")
    folder = default_drafter(args.model, method, args.draft)
    if proposer.needs_drafter and folder is None:
        bundled = "" if proposer.default_drafter is None else f" (it has a bundled one for --model {default_models.TARGET})"
        raise ValueError(f"--method {method} needs --draft FOLDER{bundled}")
    return load_drafter(method, folder, target, args.dtype or args.param_dtype, model_shards)


def _serve(args: argparse.Namespace) -> int:
    from specjax.serve import FLAGS, load_serve_config, serve

    flags = {name: getattr(args, name) for name in FLAGS}
    if args.config is None:  # --draft alone names its method as in `specjax generate`
        flags["method"] = _method(args)
    return serve(load_serve_config(args.config, flags, args.set))


def _mesh_shape(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
        raise ValueError(f"--mesh {text!r} is invalid: allowed DATA,MODEL device counts, e.g. 1,2 (DATA -1: the rest)")
    return int(parts[0]), int(parts[1])


# Training commands: name -> (config class in specjax.config, trainer "module:function", help, config example).
TRAINERS = {
    "train-lm": ("TrainConfig", "specjax.training.lm:train_lm", "train a target or draft LM",
                 "configs/train/tiny_lm.yaml"),
    "train-eagle": ("HeadTrainConfig", "specjax.training.eagle:train_eagle",
                    "train an EAGLE-1 / EAGLE-3 head on a frozen target", "configs/train/tiny_eagle.yaml"),
    "train-medusa": ("HeadTrainConfig", "specjax.training.medusa:train_medusa",
                     "train Medusa heads on a frozen target", "configs/train/tiny_medusa.yaml"),
    "train-dflash": ("DFlashTrainConfig", "specjax.training.dflash:train_dflash",
                     "train a DFlash block drafter on a frozen target", "configs/train/tiny_dflash.yaml"),
}


def _train(args: argparse.Namespace) -> int:
    import importlib

    from specjax import config

    config_class, trainer, _, _ = TRAINERS[args.command]
    module, function = trainer.split(":")
    run_config = config.load_yaml(getattr(config, config_class), args.config, args.set)
    print(json.dumps(getattr(importlib.import_module(module), function)(run_config), indent=2))
    return 0


def _run(args: argparse.Namespace) -> int:
    from specjax import experiments

    row = experiments.Runner().run(experiments.load_run(args.config, args.set))
    print(experiments.markdown([row]), end="")
    print("per-position acceptance: " + " ".join(f"{p:.2f}" for p in row["per_position_acceptance"]))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from specjax import experiments

    sweep = experiments.load_sweep(args.config, args.set)
    rows = experiments.run_sweep(sweep)
    print(experiments.markdown(rows), end="")
    print(f"results, tables and plots in {sweep.output_dir}")
    return 0


def _speed(args: argparse.Namespace) -> int:
    from specjax import speed

    skipped = speed.skip_reason(args.shape)
    if skipped:
        print(skipped)
        return 0
    batches = tuple(int(b) for b in args.batches.split(","))
    rows, meta = speed.speed_table(args.shape, batches, args.prompt_len, args.new_tokens, args.acceptance_length,
                                   args.num_speculative_tokens, args.drafter)
    print(speed.markdown(rows, meta), end="")
    if args.output:
        print("wrote", *speed.write(rows, meta, args.output))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description="Speculative decoding in JAX.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text from a Hugging Face checkpoint folder")
    gen.add_argument("--model", default="default:target",
                     help="folder with config.json, safetensors, tokenizer; default:NAME for a bundled model "
                          "(default: default:target)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="0 disables")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 disables")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--param-dtype", default=None, help="weights dtype (default: the checkpoint's)")
    gen.add_argument("--dtype", default=None, help="compute dtype (default: the weights')")
    gen.add_argument("--mesh", default=None, metavar="DATA,MODEL",
                     help="run on a data x model device mesh, e.g. 1,2 (default: one device)")
    spec = gen.add_argument_group("speculative decoding (with --method or --draft)")
    spec.add_argument("--method", default=None,
                      help="a registered drafter (specjax.proposers), e.g. eagle or ngram (default with --draft: "
                           "the method of the bundled drafter it names, else draft_model; without: none, "
                           "autoregressive)")
    spec.add_argument("--draft", default=None,
                      help="the drafter's folder, e.g. default:draft (default: the method's bundled drafter with "
                           "the bundled target)")
    spec.add_argument("--num-speculative-tokens", type=int, default=4, help="K, tokens drafted per step")
    spec.add_argument("--rejection-sample-method", default="standard", help="standard | block | synthetic")
    spec.add_argument("--draft-sample-method", default="greedy", help="greedy | probabilistic")
    gen.set_defaults(run=_generate)
    srv = commands.add_parser("serve", help="an OpenAI-compatible HTTP server on the engine (docs/serving.md); "
                              "flags override --config's values, --set overrides both")
    srv.add_argument("--config", type=Path, default=None, help="a ServeConfig YAML (specjax/serve/_config.py)")
    srv.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a field, e.g. --set spec.total_tokens=16 --set spec.top_k=4 (repeatable)")
    srv.add_argument("--model", default=None, help="folder or default:NAME (default: default:target)")
    srv.add_argument("--served-model-name", default=None, help="the name clients give as `model` (default: --model)")
    srv.add_argument("--method", default=None, help="a registered drafter, e.g. eagle (default: none, autoregressive; "
                     "with --draft alone: its method as in `specjax generate`)")
    srv.add_argument("--draft", default=None, help="the drafter's folder (default: the method's bundled drafter "
                     "with the bundled target)")
    srv.add_argument("--num-speculative-tokens", type=int, default=None, help="K (default: 4)")
    srv.add_argument("--rejection-sample-method", default=None, help="standard (default) | block | synthetic")
    srv.add_argument("--max-num-seqs", type=int, default=None, help="requests decoded at once (default: 8)")
    srv.add_argument("--max-model-len", type=int, default=None,
                     help="prompt + max_tokens + K + 1 at most per request (default: 1024)")
    srv.add_argument("--dtype", default=None, help="compute dtype (default: the checkpoints')")
    srv.add_argument("--host", default=None, help="default: 127.0.0.1")
    srv.add_argument("--port", type=int, default=None, help="default: 8000")
    srv.add_argument("--per-request-spec-decode-metrics", default=None, metavar="none|summary|detailed",
                     help="vLLM's metrics.speculative_decoding object in each response (default: none)")
    srv.add_argument("--shutdown-timeout", type=float, default=None,
                     help="seconds requests in flight get to finish after SIGTERM (default: 30)")
    srv.set_defaults(run=_serve)
    for name, (config_class, _, help_text, example) in TRAINERS.items():
        train = commands.add_parser(name, help=f"{help_text} (resumes a killed run)")
        train.add_argument("--config", type=Path, required=True, help=f"a {config_class} YAML, e.g. {example}")
        train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                           help="override a config field, e.g. --set optimizer.lr=1e-3 (repeatable)")
        train.set_defaults(run=_train)
    for name, function, help_text in (("run", _run, "one experiment: autoregressive baseline and speculative decoding"),
                                      ("sweep", _sweep, "a grid of runs; resumable; tables and plots")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("config", type=Path, help=f"a {'RunConfig' if name == 'run' else 'SweepConfig'} YAML")
        command.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field")
        command.set_defaults(run=function)
    speed = commands.add_parser("speed", help="decoding speed at Llama-3.1-8B's shapes (random weights, synthetic "
                                "acceptance; GPU only): autoregressive, speculative, the HBM floor")
    speed.add_argument("--shape", default="8b", choices=("8b", "tiny"), help="model shapes (tiny: for tests)")
    speed.add_argument("--batches", default="1", help="comma-separated batch sizes (default: 1)")
    speed.add_argument("--prompt-len", type=int, default=128)
    speed.add_argument("--new-tokens", type=int, default=128)
    speed.add_argument("--acceptance-length", type=float, default=4.0,
                       help="synthetic mean acceptance length tau (tokens committed a step, at most K + 1)")
    speed.add_argument("--num-speculative-tokens", type=int, default=5, help="K, tokens drafted a step")
    speed.add_argument("--drafter", default="eagle", help="eagle | eagle_fr | eagle3 | draft_model")
    speed.add_argument("--output", default=None, help="also write speed_<shape>.json and .md into this folder")
    speed.set_defaults(run=_speed)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"specjax {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
