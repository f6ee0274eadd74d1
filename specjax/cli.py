"""The `specjax` command."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specjax.config import ConfigError, SamplingConfig, SpecConfig


# Budgets above this generate in chunks of it, with a progress bar (one call is one compiled loop, silent until
# it ends); each chunk's prompt is the text so far.
CHUNK_TOKENS = 256
ROUNDING_NOTE = ("greedy speculative output then equals autoregressive only up to rounding: the K + 1-position "
                 "verify pass and the one-token pass round differently, and a near-tie can flip a token "
                 "(docs/performance.md, \"Rounding\"); --dtype float32 makes them equal")


def _generate(args: argparse.Namespace) -> int:
    import jax
    from transformers import AutoTokenizer

    from specjax import default_models
    from specjax.models import hf
    from specjax.models.transformer import for_decoding

    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    mesh, model_shards = None, 1
    if args.mesh:
        from specjax import sharding

        data, model_shards = _mesh_shape(args.mesh)
        mesh = sharding.make_mesh(data, model_shards)

    model_dir = default_models.resolve(args.model)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"--model {args.model}: folder {model_dir} does not exist")
    # As runs compute (RunConfig.dtype): float32 on the CPU, where bfloat16 gains nothing and rounds greedy
    # near-ties differently in the verify pass; elsewhere the checkpoint's dtype unless --dtype says.
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else None)
    model = for_decoding(hf.load(model_dir, param_dtype=args.param_dtype, dtype=dtype), model_shards)
    spec = drafter = None
    method = choose_method(args)
    if method is not None:
        spec = spec_from_args(args, method)
        drafter = _drafter(method, args, model, model_shards, dtype)
    if model.config.dtype != "float32":
        print(f"note: computing in {model.config.dtype}: {ROUNDING_NOTE}", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(default_models.tokenizer_folder(args.model))
    prompt = tokenizer.encode(args.prompt, add_special_tokens=False)
    if tokenizer.bos_token_id is not None:
        prompt = [tokenizer.bos_token_id, *prompt]
    positions = model.config.max_position_embeddings
    if len(prompt) + args.max_new_tokens > positions:
        raise ValueError(f"the prompt ({len(prompt)} tokens) + --max-new-tokens ({args.max_new_tokens}) = "
                         f"{len(prompt) + args.max_new_tokens} exceeds the model's max_position_embeddings "
                         f"({positions}): allowed at most {positions - len(prompt)} new tokens for this prompt")
    what = "autoregressive" if spec is None else f"{method}, K={spec.num_speculative_tokens}"
    print(f"[{what}: up to {args.max_new_tokens} new tokens, {model.config.dtype} on {jax.default_backend()}; "
          "the first call compiles]", file=sys.stderr)
    start = time.perf_counter()
    precision = "float32" if model.config.dtype == "float32" else None  # GPUs: no TF32 products (as runs)
    with jax.default_matmul_precision(precision):
        tokens, stopped, metrics = _generate_in_chunks(
            model, prompt, args.max_new_tokens, sampling=sampling, eos_token_ids=hf.eos_token_ids(model_dir),
            seed=args.seed, spec=spec, drafter=drafter, mesh=mesh)
    seconds = time.perf_counter() - start
    print(args.prompt + tokenizer.decode(tokens, skip_special_tokens=True))
    print(f"\n[{len(tokens)} tokens in {seconds:.2f} s including compilation; "
          f"{'stopped at EOS' if stopped else 'token budget reached'}]", file=sys.stderr)
    if metrics is not None:
        print(metrics.format_summary())
    return 0


def _generate_in_chunks(model, prompt: list[int], max_new_tokens: int, *, seed: int, **kwargs):
    """(tokens, stopped at EOS, AcceptanceMetrics or None): one generate call up to CHUNK_TOKENS new tokens;
    above it, calls of CHUNK_TOKENS each continuing the text so far (chunk i samples with seed + i), under a
    progress bar, their acceptance counts added up."""
    import dataclasses

    from tqdm.auto import tqdm

    from specjax.decoding import generate

    tokens, metrics = [], None
    with tqdm(total=max_new_tokens, unit="tok", desc="generate", file=sys.stderr,
              disable=max_new_tokens <= CHUNK_TOKENS) as bar:
        for chunk in range(-(-max_new_tokens // CHUNK_TOKENS) or 1):
            budget = min(CHUNK_TOKENS, max_new_tokens - len(tokens))
            result = generate(model, [prompt + tokens], max_new_tokens=budget, seeds=seed + chunk, **kwargs)
            new = result.sequences()[0]
            tokens += new
            bar.update(len(new))
            if result.metrics is not None:
                metrics = result.metrics if metrics is None else dataclasses.replace(metrics, **{
                    f.name: getattr(metrics, f.name) + getattr(result.metrics, f.name)
                    for f in dataclasses.fields(metrics)})
            if result.stopped_by_eos[0]:
                return tokens, True, metrics
    return tokens, False, metrics


def spec_flag(name: str) -> str:
    """The `specjax generate` flag of SpecConfig field `name`: its dashed name (--tree-top-k: sampling's --top-k is
    the token filter)."""
    return "--" + name.replace("_", "-")


def spec_field_help() -> dict[str, str]:
    """Each SpecConfig field's first sentence in its docstring ("name: text", "a / b: text", "a, b: text")."""
    import re

    def first_sentence(text: list[str]) -> str:  # "e.g. (0,)" does not end one: a capital letter follows
        return re.split(r"\.\s+(?=[A-Z])", " ".join(text))[0].rstrip(".")

    helps, current, text = {}, [], []
    for line in (SpecConfig.__doc__ or "").splitlines():
        match = re.match(r"    ([a-z_]+(?:(?: / |, )[a-z_]+)*): (.*)", line)
        if match or not line.strip():
            helps.update({name: first_sentence(text) for name in current})
            current, text = (re.split(r" / |, ", match.group(1)), [match.group(2)]) if match else ([], [])
        elif current:
            text.append(line.strip())
    helps.update({name: first_sentence(text) for name in current})
    return helps


def add_spec_flags(group) -> None:
    """A flag for every SpecConfig field but method, from the dataclass's own fields: values are read as YAML
    (e.g. 16, auto, true, [[0], [1], [0, 0]]) and checked by SpecConfig as a config file's are."""
    import dataclasses

    helps = spec_field_help()
    for field in dataclasses.fields(SpecConfig):
        if field.name == "method":
            continue
        flag_only = field.type in ("bool", bool)  # a plain switch: --use-heterogeneous-vocab alone means true
        default = "null" if field.default is None else json.dumps(field.default)
        text = helps.get(field.name, "see SpecConfig's docstring")
        group.add_argument(spec_flag(field.name), dest=f"spec_{field.name}", default=None,
                           nargs="?" if flag_only else None, const="true" if flag_only else None, metavar="VALUE",
                           help=f"{text} (SpecConfig.{field.name}; default: {default})".replace("%", "%%"))


def spec_from_args(args: argparse.Namespace, method: str) -> SpecConfig:
    """The SpecConfig of --method and the spec flags given (spec_flag), each value read as YAML; a bad value is
    a ConfigError naming the field and its flag."""
    import dataclasses

    import yaml

    from specjax.config import from_dict

    given = {f.name: getattr(args, f"spec_{f.name}") for f in dataclasses.fields(SpecConfig) if f.name != "method"}
    values = {}
    for name, raw in given.items():
        if raw is not None:
            try:
                values[name] = yaml.safe_load(raw)
            except yaml.YAMLError as error:
                raise ConfigError(f"{spec_flag(name)} {raw!r} is not a YAML value: {error}") from None
    from specjax.proposers import check_spec

    try:
        spec = from_dict(SpecConfig, {"method": method, **values}, "command line")
        check_spec(spec)  # the drafter's own options, which its proposer checks
        return spec
    except ConfigError as error:
        flags = [f"{spec_flag(name)} sets SpecConfig.{name}" for name in values if f"SpecConfig.{name}" in str(error)]
        raise ConfigError(str(error) + (f" ({'; '.join(flags)})" if flags else "")) from None


def choose_method(args: argparse.Namespace) -> str | None:
    """--method; with only --draft, the method whose bundled drafter it names or which recognizes its
    folder by its files (each proposer's `recognizes`), else draft_model."""
    if args.method is not None or args.draft is None:
        return args.method
    from specjax import default_models
    from specjax.experiments import recognized_method
    from specjax.proposers import PROPOSERS

    folder = default_models.resolve(args.draft)
    if not folder.is_dir():
        raise FileNotFoundError(f"--draft {args.draft}: folder {folder} does not exist")
    named = next((name for name, proposer in PROPOSERS.items() if proposer.default_drafter == args.draft), None)
    return named or recognized_method(folder) or "draft_model"


def _drafter(method: str, args: argparse.Namespace, target, model_shards: int, dtype: str | None):
    """The weights of --method's drafter: from --draft, else the method's bundled one (with the bundled
    target), loaded by its registered proposer in the target's compute dtype; a folder of another method's
    kind is refused naming the method."""
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
    return load_drafter(method, folder, target, dtype, model_shards, method_option="--method")


def _serve(args: argparse.Namespace) -> int:
    from specjax.serve import FLAGS, load_serve_config, serve

    flags = {name: getattr(args, name) for name in FLAGS}
    if args.config is None:  # --draft alone names its method as in `specjax generate`
        flags["method"] = choose_method(args)
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
    "train-dspark": ("DSparkTrainConfig", "specjax.training.dflash:train_dflash",
                     "train a DSpark drafter (DFlash backbone, Markov and confidence heads) on a frozen target",
                     "configs/train/tiny_dspark.yaml"),
    "train-mtp": ("MTPTrainConfig", "specjax.training.mtp:train_mtp",
                  "train multi-token prediction modules on a frozen target", "configs/train/tiny_mtp.yaml"),
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
    gen.add_argument("--max-new-tokens", type=int, default=64,
                     help=f"at most the model's max_position_embeddings less the prompt; above {CHUNK_TOKENS}, "
                          "generated in chunks under a progress bar (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="0 disables")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 disables")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--param-dtype", default=None, help="weights dtype (default: the checkpoint's)")
    gen.add_argument("--dtype", default=None,
                     help="compute dtype (default: float32 on the CPU, as runs and sweeps compute, where bfloat16 "
                          "gains nothing; elsewhere the weights'). In bfloat16 greedy speculative output equals "
                          "autoregressive only up to rounding (docs/performance.md, \"Rounding\")")
    gen.add_argument("--mesh", default=None, metavar="DATA,MODEL",
                     help="run on a data x model device mesh, e.g. 1,2 (default: one device)")
    spec = gen.add_argument_group("speculative decoding (with --method or --draft; every SpecConfig field, "
                                  "values read as YAML)")
    spec.add_argument("--method", default=None,
                      help="a registered drafter (specjax.proposers), e.g. eagle or ngram (default with --draft: "
                           "the method whose checkpoint the folder holds, else draft_model; without: none, "
                           "autoregressive)")
    spec.add_argument("--draft", default=None,
                      help="the drafter's folder, e.g. default:draft (default: the method's bundled drafter with "
                           "the bundled target)")
    add_spec_flags(spec)
    gen.set_defaults(run=_generate)
    srv = commands.add_parser("serve", help="an OpenAI-compatible HTTP server on the engine (docs/serving.md); "
                              "flags override --config's values, --set overrides both")
    srv.add_argument("--config", type=Path, default=None, help="a ServeConfig YAML (specjax/serve/_config.py)")
    srv.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a field, e.g. --set spec.total_tokens=16 --set spec.tree_top_k=4 (repeatable)")
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
    srv.add_argument("--enable-prefix-caching", action="store_true", default=None,
                     help="reuse the KV of prompt blocks other requests prefilled (docs/serving.md)")
    srv.add_argument("--max-num-batched-tokens", type=int, default=None,
                     help="prompt tokens prefilled per engine visit; longer prompts in chunks (default: whole)")
    srv.add_argument("--mixed-prefill-tokens", type=int, default=None,
                     help="prefill prompts in the decode steps, chunks of this many tokens (default: off)")
    srv.add_argument("--mixed-prefill-chunks", type=int, default=None,
                     help="prompt chunks a decode step prefills at most, with --mixed-prefill-tokens (default: 1)")
    srv.add_argument("--warmup-prompt-len", type=int, default=None,
                     help="compile every program prompts of up to this length run before listening (default: short only)")
    srv.add_argument("--no-warmup-sampled", dest="warmup_sampled", action="store_false", default=None,
                     help="compile the sampled programs at the first sampled request, not before listening")
    srv.add_argument("--admit-wait-ms", type=float, default=None,
                     help="ms a visit may wait for arriving requests (default: 50; 0: off)")
    srv.add_argument("--steps-per-visit", type=int, default=None,
                     help="engine steps a visit runs at most, admitting nothing meanwhile (default: 16)")
    srv.add_argument("--visit-ends", type=int, default=None,
                     help="with requests waiting, rows a visit lets end before it stops to admit them (default: "
                          "chosen from the last visits' host and step times; 1: at the first end)")
    srv.add_argument("--end-visits-on-finish", action="store_true", default=None,
                     help="end an engine visit when a request ends, not after its steps (docs/serving.md)")
    srv.add_argument("--async-scheduling", action="store_true", default=None,
                     help="dispatch each engine visit before reading the one before it (docs/serving.md)")
    srv.add_argument("--max-prefill-batch", type=int, default=None,
                     help="requests admitted by one prefill call at most (default: 8)")
    srv.add_argument("--log-stats-interval", type=float, default=None,
                     help="seconds between the engine's stats lines in the log while it works (default: 10; 0: off)")
    srv.add_argument("--switch-interval-ms", type=float, default=None,
                     help="the server process's Python thread switch interval (default: 0.5; Python's own: 5)")
    srv.add_argument("--engine-process", action="store_true", default=None,
                     help="run the engine in a child process, apart from the HTTP server's (docs/serving.md)")
    srv.add_argument("--profile-dir", default=None, metavar="DIR",
                     help="enable POST /start_profile and /stop_profile: JAX profiler traces into DIR")
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
    speed.add_argument("--drafter", default="eagle",
                       help="a drafter of specjax.speed.DRAFTERS: a method whose proposer builds a shaped drafter "
                            "(eagle, eagle3, draft_model, dflash, mtp), or NAME_fr over a draft vocabulary")
    speed.add_argument("--output", default=None, help="also write speed_<shape>.json and .md into this folder")
    speed.set_defaults(run=_speed)
    # Its own parser (specjax/bench_serve.py, which scripts/bench_serve.py runs too) reads the arguments: main.
    commands.add_parser("bench-serve", add_help=False, help="load on the serving engine: TTFT, TPOT, throughput, "
                        "acceptance, prefix cache hit rate (specjax bench-serve --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench-serve"]:
        from specjax import bench_serve

        bench_serve.main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"specjax {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
