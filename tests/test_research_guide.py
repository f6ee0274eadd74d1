"""docs/research-guide.md's worked example, run: its drafter (docs/examples/bigram.py) added to a copy
of the package as one file and one registry line, and nothing else, drafts through `specjax generate
--method bigram` and through `generate(...)`, where greedy output equals autoregressive output."""

import difflib
import filecmp
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs" / "research-guide.md"
EXAMPLE = REPO / "docs" / "examples" / "bigram.py"
REGISTRY = Path("specjax") / "proposers" / "__init__.py"
REGISTRY_LINE = 'from specjax.proposers import bigram  # noqa: F401  (registers "bigram")\n'

# Runs in the copy: the CLI, then the library call on the CLI's prompt and a repetitive one.
SCRIPT = textwrap.dedent('''
    import specjax
    from specjax import cli
    from specjax.config import SpecConfig
    from specjax.decoding import generate
    from specjax.experiments import load_models

    print("package:", specjax.__file__)
    assert cli.main(["generate", "--method", "bigram", "--prompt", "import os", "--max-new-tokens", "8"]) == 0
    target, tokenizer, drafter = load_models("default:target", "bigram", dtype="float32")  # as the guide
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in
               ["import os\\nimport sys\\n", "for i in range(3):\\n    print(i)\\nfor i in range(3):\\n    print("]]
    spec = generate(target, prompts, max_new_tokens=8, spec=SpecConfig(method="bigram"), drafter=drafter)
    greedy = generate(target, prompts, max_new_tokens=8)
    print("equal to autoregressive:", spec.sequences() == greedy.sequences())
    print("accepted:", spec.metrics.summary()["acceptance_rate"])
''')


def changes(before: Path, after: Path) -> tuple[list[str], list[str], list[str]]:
    """(files only in `after`, files only in `before`, files that differ), as paths under the roots."""
    added, removed, changed = [], [], []

    def walk(cmp: filecmp.dircmp, prefix: Path) -> None:
        added.extend(str(prefix / name) for name in cmp.right_only)
        removed.extend(str(prefix / name) for name in cmp.left_only)
        changed.extend(str(prefix / name) for name in cmp.diff_files + cmp.funny_files)
        for name, sub in cmp.subdirs.items():
            walk(sub, prefix / name)

    walk(filecmp.dircmp(before, after), Path())  # ignores __pycache__ (filecmp.DEFAULT_IGNORES)
    return added, removed, changed


def test_the_guide_shows_the_example_and_its_registry_line():
    guide = GUIDE.read_text()
    assert EXAMPLE.read_text() in guide
    assert REGISTRY_LINE in guide
    # Its greedy-equality example loads in float32, as SCRIPT does (bfloat16 rounds near-ties differently).
    assert 'load_models("default:target", "bigram", dtype="float32")' in guide


@pytest.mark.e2e
def test_the_example_drafter_is_one_file_and_one_registry_line(tmp_path):
    shutil.copytree(REPO / "specjax", tmp_path / "specjax", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(EXAMPLE, tmp_path / "specjax" / "proposers" / "bigram.py")
    registry = (tmp_path / REGISTRY).read_text().splitlines(keepends=True)
    last_drafter = max(i for i, line in enumerate(registry) if line.startswith("from specjax.proposers import "))
    registry.insert(last_drafter + 1, REGISTRY_LINE)
    (tmp_path / REGISTRY).write_text("".join(registry))

    added, removed, changed = changes(REPO / "specjax", tmp_path / "specjax")
    assert (added, removed, changed) == (["proposers/bigram.py"], [], ["proposers/__init__.py"])
    diff = [line for line in difflib.unified_diff((REPO / REGISTRY).read_text().splitlines(keepends=True),
                                                  (tmp_path / REGISTRY).read_text().splitlines(keepends=True))
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert diff == ["+" + REGISTRY_LINE]

    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env={**os.environ,
                         "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert f"package: {tmp_path / 'specjax' / '__init__.py'}" in run.stdout
    assert run.stdout.count("import os") == 1 and "speculative: K=4" in run.stdout  # the CLI's output
    assert "equal to autoregressive: True" in run.stdout
    # The drafter drafts for real: on the repetitive prompt some of its drafts are the target's tokens.
    assert float(run.stdout.split("accepted: ")[1]) > 0


@pytest.mark.e2e
def test_a_drafter_registers_from_the_users_own_script(tmp_path):
    """The guide's claim: importing a module with a @register'ed class makes the method usable in that process,
    with no line added to the package (in a subprocess: the registry is process-wide)."""
    shutil.copy(EXAMPLE, tmp_path / "bigram.py")
    script = textwrap.dedent('''
        import bigram  # registers "bigram"
        from specjax.config import SpecConfig
        from specjax.decoding import generate
        from specjax.models.transformer import init_model
        from specjax.config import ModelConfig

        target = init_model(ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                        head_dim=8, intermediate_size=32), seed=0)
        prompts = [[1, 2, 3, 1, 2, 3, 1, 2]]
        spec = generate(target, prompts, max_new_tokens=8, spec=SpecConfig(method="bigram"))
        print("equal:", spec.sequences() == generate(target, prompts, max_new_tokens=8).sequences())
    ''')
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    assert run.returncode == 0, run.stderr
    assert "equal: True" in run.stdout
