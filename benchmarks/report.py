"""Write one benchmark's results into its own ``## <title>`` section of docs/benchmarks.md.

Every benchmark script calls ``write_section`` with a markdown body; the section is replaced in
place (or appended), other sections are left as they are.
"""

from __future__ import annotations

import platform
import re
import time
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
HEADER = ("# Benchmarks\n\nEach section is written by the script it names; re-run the command to "
          "refresh it. Numbers are medians of repeated runs; comparisons are ratios against a peer "
          "measured in the same run (machines here are shared and noisy).\n")


def machine() -> str:
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or platform.machine()})"
    return f"{dev}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"


def write_section(title: str, body: str, doc: Path = DOC) -> None:
    text = doc.read_text() if doc.exists() else HEADER
    section = f"## {title}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1)
    else:
        text = text.rstrip() + "\n\n" + section
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text.rstrip() + "\n")
