"""The `specjax` command and the README's main job, end to end."""

import subprocess
import sys
from pathlib import Path

import pytest
from support.checkpoints import write_tiny_checkpoint

from specjax import cli
from specjax.decoding import generate
from specjax.models import hf
from specjax.proposers import PROPOSERS

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    return folder, write_tiny_checkpoint(folder, seed=3)


@pytest.mark.e2e
def test_generate_prints_the_prompt_and_the_models_continuation(checkpoint, capsys):
    folder, tokenizer = checkpoint
    code = cli.main(["generate", "--model", str(folder), "--prompt", "def add(", "--max-new-tokens", "9",
                     "--temperature", "0.8", "--top-k", "20", "--seed", "4"])
    assert code == 0
    out = capsys.readouterr()
    prompt = [tokenizer.bos_token_id, *tokenizer.encode("def add(", add_special_tokens=False)]
    from specjax.config import SamplingConfig
    expected = generate(hf.load(folder), [prompt], max_new_tokens=9, seeds=4,
                        sampling=SamplingConfig(temperature=0.8, top_k=20),
                        eos_token_ids=[tokenizer.eos_token_id]).sequences()[0]
    assert out.out == "def add(" + tokenizer.decode(expected, skip_special_tokens=True) + "\n"
    assert "tokens in" in out.err


def test_bad_arguments_exit_with_a_message(checkpoint, capsys):
    folder, _ = checkpoint
    assert cli.main(["generate", "--model", str(folder), "--prompt", "x", "--top-p", "2"]) == 2
    assert "SamplingConfig.top_p = 2.0 is invalid" in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(folder / "nope"), "--prompt", "x"]) == 2
    assert "nope" in capsys.readouterr().err


@pytest.mark.e2e
def test_generate_defaults_to_the_bundled_models():
    """The second half of `make demo`: the bundled target with the bundled draft, from a fresh process."""
    run = subprocess.run([sys.executable, "-m", "specjax.cli", "generate", "--draft", "default:draft",
                          "--prompt", "def fibonacci(n):", "--max-new-tokens", "16"],
                         check=True, cwd=REPO, capture_output=True, text=True)
    assert run.stdout.startswith("def fibonacci(n):")
    assert "speculative: K=4" in run.stdout
    assert "16 tokens in" in run.stderr or "stopped at EOS" in run.stderr


@pytest.mark.e2e
def test_generate_with_a_draft_prints_the_acceptance_summary(checkpoint, capsys):
    folder, _ = checkpoint
    code = cli.main(["generate", "--model", str(folder), "--draft", str(folder), "--prompt", "for i in",
                     "--max-new-tokens", "12", "--num-speculative-tokens", "3", "--rejection-sample-method", "block",
                     "--temperature", "1.0", "--draft-sample-method", "probabilistic"])
    out = capsys.readouterr().out
    assert code == 0
    # The model drafting for itself with its own distribution is always accepted.
    assert "speculative: K=3" in out and "(100.0%)" in out and "mean acceptance length=4.000" in out


# Issue 35's prompt: in the checkpoints' bfloat16 every method printed the same text, not the autoregressive one.
SHORT = ["--prompt", "def fib(n):", "--max-new-tokens", "16"]


def generate_text(capsys, *args: str) -> str:
    """The text `specjax generate` prints for the bundled target on a short prompt (fails on an error)."""
    code = cli.main(["generate", *SHORT, *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


@pytest.fixture(scope="module")
def autoregressive_text():
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert cli.main(["generate", *SHORT]) == 0
    return out.getvalue()


# A drafter of each kind: a head on the target's features, a block drafter, modules from the target's own checkpoint.
# The CLI loads every method's bundled drafter as load_models does (experiments.load_drafter), whose greedy output
# tests/test_default_models.py checks for every bundled drafter; what is the CLI's own (its dtype, the text it
# prints) does not depend on the method.
CLI_METHODS = ["dflash", "eagle3", "mtp"]


@pytest.mark.e2e
@pytest.mark.parametrize("method", CLI_METHODS)
def test_a_drafter_of_each_kind_prints_the_autoregressive_text_by_default(method, autoregressive_text, capsys):
    """Greedy speculative decoding prints the autoregressive text, then its acceptance summary: the CLI computes
    in float32 on the CPU as runs do (in the checkpoints' bfloat16 every method printed the same other text)."""
    out = generate_text(capsys, "--method", method)
    assert out.startswith(autoregressive_text) and "speculative: K=4" in out[len(autoregressive_text):]


@pytest.mark.e2e
def test_bfloat16_says_greedy_equality_is_up_to_rounding(capsys):
    assert cli.main(["generate", "--prompt", "x", "--max-new-tokens", "2", "--dtype", "bfloat16"]) == 0
    err = capsys.readouterr().err
    assert ("note: computing in bfloat16: greedy speculative output then equals autoregressive only up to "
            "rounding") in err
    assert 'docs/performance.md, "Rounding"' in err and "[autoregressive: up to 2 new tokens, bfloat16 on" in err


def test_every_spec_config_field_has_a_flag_and_the_tree_top_k_is_not_samplings():
    import dataclasses

    from specjax.config import SpecConfig

    parser = cli.build_parser()
    for field in dataclasses.fields(SpecConfig):  # each flag parses into the field's destination
        value = "eagle" if field.name == "method" else "7"
        args = parser.parse_args(["generate", "--prompt", "x", cli.spec_flag(field.name), value])
        assert getattr(args, "method" if field.name == "method" else f"spec_{field.name}") == value
    args = parser.parse_args(["generate", "--prompt", "x", "--method", "eagle", "--num-speculative-tokens", "3",
                              "--total-tokens", "8", "--tree-top-k", "2", "--top-k", "5", "--dflash-full-block",
                              "false", "--speculative-token-tree", "null", "--prompt-lookup-min", "2"])
    spec = cli.spec_from_args(args, "eagle")
    assert (spec.num_speculative_tokens, spec.total_tokens, spec.tree_top_k, spec.dflash_full_block,
            spec.prompt_lookup_min) == (3, 8, 2, False, 2)
    assert args.top_k == 5  # sampling's
    tree = cli.spec_from_args(parser.parse_args(["generate", "--prompt", "x", "--num-speculative-tokens", "2",
                                                 "--speculative-token-tree", "[[0], [1], [0, 0]]"]), "medusa")
    assert tree.speculative_token_tree == ((0,), (1,), (0, 0))
    assert cli.spec_from_args(parser.parse_args(["generate", "--prompt", "x", "--use-heterogeneous-vocab"]),
                              "draft_model").use_heterogeneous_vocab is True


def test_bad_spec_flags_name_the_field_and_the_flag(capsys):
    assert cli.main(["generate", "--method", "eagle", "--total-tokens", "8", "--prompt", "x"]) == 2
    assert ("SpecConfig.total_tokens = 8 and tree_top_k = None: allowed both (a dynamic draft tree) or neither "
            "(--total-tokens sets SpecConfig.total_tokens)") in capsys.readouterr().err
    assert cli.main(["generate", "--method", "ngram", "--prompt-lookup-min", "two", "--prompt", "x"]) == 2
    assert ("command line: SpecConfig.prompt_lookup_min = 'two' is invalid: allowed an integer "
            "(--prompt-lookup-min sets SpecConfig.prompt_lookup_min)") in capsys.readouterr().err
    # A drafter's own option, checked by its proposer, names its flag too.
    assert cli.main(["generate", "--method", "ngram", "--prompt-lookup-min", "0", "--prompt", "x"]) == 2
    assert ("SpecConfig.prompt_lookup_min = 0 is invalid: allowed an integer >= 1 "
            "(--prompt-lookup-min sets SpecConfig.prompt_lookup_min)") in capsys.readouterr().err


@pytest.mark.e2e
def test_ngram_lookup_flags_reach_the_drafter(capsys):
    out = generate_text(capsys, "--method", "ngram", "--prompt-lookup-min", "1", "--prompt-lookup-max", "3",
                        "--num-speculative-tokens", "2")
    assert "speculative: K=2" in out


@pytest.mark.parametrize("args, message", [
    (["--method", "eagle", "--draft", "default:dflash"],
     "drafter folder default:dflash holds a DFlash drafter, not an EAGLE-1 head: use --method dflash"),
    (["--method", "eagle", "--draft", "default:eagle3"],
     "drafter folder default:eagle3 holds an EAGLE-3 head, not an EAGLE-1 head: use --method eagle3"),
    (["--method", "draft_model", "--draft", "default:medusa"],
     "drafter folder default:medusa holds Medusa heads, not a draft model (a Hugging Face LM): use --method medusa"),
    (["--draft", "/nonexistent/head"], "--draft /nonexistent/head: folder /nonexistent/head does not exist"),
    (["--method", "eagle", "--draft", "/nonexistent/head"], "drafter folder /nonexistent/head does not exist"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: folder /nonexistent/model does not exist"),
    (["--max-new-tokens", "100000"], "the prompt (3 tokens) + --max-new-tokens (100000) = 100003 exceeds the "
                                     "model's max_position_embeddings (2048): allowed at most 2045 new tokens"),
])
def test_wrong_folders_and_budgets_are_refused_in_one_line(args, message, capsys):
    assert cli.main(["generate", "--prompt", "def f", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("name, method", [("draft", "draft_model"), ("eagle1", "eagle"), ("eagle3", "eagle3"),
                                          ("medusa", "medusa"), ("dflash", "dflash")])
def test_a_drafter_folder_without_method_picks_the_method_its_files_say(name, method, tmp_path):
    """Each proposer recognizes its checkpoints by their files (a copy, so not by the bundled name)."""
    import argparse
    import shutil

    from specjax import default_models

    folder = tmp_path / name
    shutil.copytree(default_models.path(name), folder)
    assert cli.choose_method(argparse.Namespace(method=None, draft=str(folder))) == method


@pytest.mark.e2e
def test_long_budgets_generate_in_chunks_with_a_progress_bar(checkpoint, capsys, monkeypatch):
    """Above CHUNK_TOKENS the text so far is continued chunk by chunk (greedy: the text of one call)."""
    folder, _ = checkpoint
    assert cli.main(["generate", "--model", str(folder), "--prompt", "def f", "--max-new-tokens", "20"]) == 0
    whole = capsys.readouterr().out
    monkeypatch.setattr(cli, "CHUNK_TOKENS", 8)
    assert cli.main(["generate", "--model", str(folder), "--prompt", "def f", "--max-new-tokens", "20"]) == 0
    out = capsys.readouterr()
    assert out.out == whole and "generate: 100%" in out.err and "20/20" in out.err


@pytest.mark.e2e
def test_a_bundled_drafter_folder_picks_its_method(autoregressive_text, capsys):
    """`--draft default:eagle1` runs method eagle (an EAGLE head is no draft model)."""
    assert generate_text(capsys, "--draft", "default:eagle1").startswith(autoregressive_text + "speculative: K=4")


def test_bad_methods_and_drafters_exit_with_a_message(checkpoint, capsys):
    folder, _ = checkpoint
    assert cli.main(["generate", "--method", "lookahead", "--prompt", "x"]) == 2
    assert (f"specjax generate: error: SpecConfig.method = 'lookahead' is invalid: allowed one of "
            f"{sorted(PROPOSERS)}") in capsys.readouterr().err
    assert cli.main(["generate", "--method", "ngram", "--draft", "default:draft", "--prompt", "x"]) == 2
    assert "--draft default:draft is invalid with --method ngram: that method has no weights" in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(folder), "--method", "eagle", "--prompt", "x"]) == 2
    assert ("--method eagle needs --draft FOLDER (it has a bundled one for --model default:target)"
            in capsys.readouterr().err)


def test_importing_specjax_with_transformers_prints_no_pytorch_warning():
    """transformers warns on import that PyTorch is absent; specjax needs only its tokenizers."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_VERBOSITY"}
    run = subprocess.run([sys.executable, "-c", "import specjax.data.tokenizer"], cwd=REPO, env=env,
                         capture_output=True, text=True, check=True)
    assert "PyTorch was not found" not in run.stderr and run.stderr == "", run.stderr
