"""The `specjax` command and the README's main job, end to end."""

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_tiny_checkpoint

from specjax import cli
from specjax.decoding import generate
from specjax.models import hf
from specjax.proposers import PROPOSERS

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    return folder, write_tiny_checkpoint(folder, seed=3)


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


def test_generate_defaults_to_the_bundled_models():
    """The second half of `make demo`: the bundled target with the bundled draft, from a fresh process."""
    run = subprocess.run([sys.executable, "-m", "specjax.cli", "generate", "--draft", "default:draft",
                          "--prompt", "def fibonacci(n):", "--max-new-tokens", "16"],
                         check=True, cwd=REPO, capture_output=True, text=True)
    assert run.stdout.startswith("def fibonacci(n):")
    assert "speculative: K=4" in run.stdout
    assert "16 tokens in" in run.stderr or "stopped at EOS" in run.stderr


def test_generate_with_a_draft_prints_the_acceptance_summary(checkpoint, capsys):
    folder, _ = checkpoint
    code = cli.main(["generate", "--model", str(folder), "--draft", str(folder), "--prompt", "for i in",
                     "--max-new-tokens", "12", "--num-speculative-tokens", "3", "--rejection-sample-method", "block",
                     "--temperature", "1.0", "--draft-sample-method", "probabilistic"])
    out = capsys.readouterr().out
    assert code == 0
    # The model drafting for itself with its own distribution is always accepted.
    assert "speculative: K=3" in out and "(100.0%)" in out and "mean acceptance length=4.000" in out


def generate_text(capsys, *args: str) -> str:
    """The text `specjax generate` prints for the bundled target on a short prompt (fails on an error)."""
    code = cli.main(["generate", "--prompt", "import os", "--max-new-tokens", "6", *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


@pytest.fixture(scope="module")
def autoregressive_text():
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert cli.main(["generate", "--prompt", "import os", "--max-new-tokens", "6"]) == 0
    return out.getvalue()


@pytest.mark.parametrize("method", sorted(PROPOSERS))
def test_every_registered_method_runs_with_its_bundled_drafter(method, autoregressive_text, capsys):
    out = generate_text(capsys, "--method", method)
    # Greedy speculative decoding prints the autoregressive text, then its acceptance summary.
    assert out.startswith(autoregressive_text) and "speculative: K=4" in out[len(autoregressive_text):]


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
