"""The repository is self-contained: no file reads or links to anything beside or above the
checkout (the trace and the design document live inside it)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", "build", "dist", "fastkv-out", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis"}
OUTSIDE = [
    re.compile(r"\.\./+" + "shared"),  # split so this file does not match itself
    re.compile("/" + r"work/"),
    re.compile(r"\bROOT\.parent\b"),
    re.compile(r"[\"']" + "shared" + r"[\"']\s*/"),
]
# Path(__file__).resolve().parents[N] / .parent.parent...: how far up a module looks
UP = re.compile(r"__file__\)(?:\.resolve\(\))?(?:\.parents\[(\d+)\]|((?:\.parent)+))")


def repo_files() -> list[Path]:
    out = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if path.is_file() and not any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            out.append(path)
    return out


def text_of(path: Path) -> str | None:
    data = path.read_bytes()
    return None if b"\0" in data[:8192] or path.suffix in (".gz", ".so", ".png") else data.decode("utf-8", "replace")


def test_no_file_references_a_path_outside_the_repo():
    bad = []
    for path in repo_files():
        text = text_of(path)
        if text is None:
            continue
        rel = path.relative_to(ROOT)
        for lineno, line in enumerate(text.splitlines(), 1):
            bad += [f"{rel}:{lineno}: {line.strip()}" for pattern in OUTSIDE if pattern.search(line)]
            for match in UP.finditer(line):
                levels = int(match[1]) + 1 if match[1] is not None else match[2].count(".parent")
                if levels > len(rel.parts):  # above the repository root
                    bad.append(f"{rel}:{lineno}: {line.strip()}")
    assert not bad, "files reference paths outside the repository:\n" + "\n".join(bad)


def test_the_trace_and_design_doc_are_in_the_repo():
    from fastkv import workload

    assert workload.TRACE.is_relative_to(ROOT / "fastkv"), workload.TRACE
    assert (workload.TRACE.parent / "LICENSE-Mooncake-APACHE.txt").is_file()
    assert len(workload.trace(3)) == 3
    assert (ROOT / "docs" / "DESIGN.md").is_file() and "(docs/DESIGN.md)" in (ROOT / "README.md").read_text()
