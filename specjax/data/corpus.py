"""Offline text corpora: files under a folder, by default the running interpreter's standard library."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Iterator


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path | None = None, pattern: str = "*.py", exclude_tests: bool = True) -> list[Path]:
    """Sorted files under root (default: the standard library) matching pattern, without test suites
    and site-packages."""
    root = Path(root) if root is not None else stdlib_dir()
    files = []
    for path in sorted(root.rglob(pattern)):
        parts = set(path.relative_to(root).parts[:-1])
        if "site-packages" in parts or (exclude_tests and parts & {"test", "tests", "idle_test"}):
            continue
        files.append(path)
    if not files:
        raise FileNotFoundError(f"no files matching {pattern!r} under {root}")
    return files


def read_texts(files: list[Path]) -> Iterator[str]:
    for path in files:
        yield path.read_text(encoding="utf-8", errors="replace")
