"""The SHA-256 of every file of a directory, written beside them and checked before they are read again.

    <dir>/SHA256SUMS      "<sha256>  <path relative to dir>" a line, every other file under dir, sorted
                          (`sha256sum` format: `cd <dir> && sha256sum -c SHA256SUMS` checks it by hand too)

rlmm/run/checkpoint.py writes one into every checkpoint, last, once every rank's files and state.json are in;
rlmm/run/resume.py checks it before a resume, so a checkpoint with flipped or missing bytes is named and passed over
instead of loaded (a flipped weight loads without complaint and trains on from wrong numbers). A directory without
SHA256SUMS (a checkpoint written before rlmm wrote them) has nothing to be checked against.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

SUMS = "SHA256SUMS"
_CHECKED: dict[tuple, str | None] = {}  # a directory checked once per process while its files stay as they were


def sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def write_sums(directory: Path) -> None:
    """SHA256SUMS of every file under `directory` (written into it)."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.relative_to(directory).as_posix() != SUMS)
    lines = [f"{sha256(p)}  {p.relative_to(directory).as_posix()}\n" for p in files]
    (directory / SUMS).write_text("".join(lines), encoding="utf-8")


def damage(directory: Path) -> str | None:
    """What of `directory` does not match its SHA256SUMS ("rank0.pt does not match its SHA-256 in SHA256SUMS;
    shards/.metadata is missing"), or None: every file matches, or there is no SHA256SUMS."""
    sums = directory / SUMS
    if not sums.exists():
        return None
    key = (str(directory), *sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns)
                                    for p in directory.rglob("*") if p.is_file()))
    if key not in _CHECKED:
        _CHECKED[key] = _damage(directory, sums)
    return _CHECKED[key]


def _damage(directory: Path, sums: Path) -> str | None:
    problems = []
    try:
        lines = sums.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        return f"{SUMS} is not readable"
    for number, line in enumerate(lines, start=1):
        digest, separator, name = line.partition("  ")
        if not separator or len(digest) != 64 or not name:
            return f"{SUMS} is not readable (line {number})"
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif sha256(path) != digest:
            problems.append(f"{name} does not match its SHA-256 in {SUMS}")
    return "; ".join(problems) or None
