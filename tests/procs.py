"""Processes of this machine, for tests that check nothing is left running."""
from __future__ import annotations

from pathlib import Path


def processes_mentioning(text: str) -> list[str]:
    """Command lines of the live processes whose command line contains ``text``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it exited while we looked
            continue
        if text in args:
            found.append(args)
    return found
