"""The README stays a newcomer's page (<= 200 lines) and docs/benchmarks.md is exactly what
scripts/gen_benchmarks.py generates from the saved results; every relative link resolves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_the_readme_is_at_most_200_lines() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move detail to docs/"


def test_the_readme_starts_with_the_two_commands() -> None:
    first = (REPO / "README.md").read_text().splitlines()[:4]
    assert first == ["```", "bash scripts/bootstrap && .venv/bin/radixkv demo",
                     "bash scripts/bootstrap --tests && .venv/bin/python -m pytest -q", "```"]


def test_benchmarks_md_is_what_the_script_generates() -> None:
    out = subprocess.run([sys.executable, "scripts/gen_benchmarks.py", "--check"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_every_saved_result_is_stamped() -> None:
    import json

    saved = sorted((REPO / "docs" / "results").glob("*.json"))
    assert saved
    for path in saved:
        data = json.loads(path.read_text())
        assert {"command", "date", "commit", "result"} <= set(data), path.name
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", data["date"]), path.name
        # "-dirty": measured with uncommitted changes, and the stamp says so
        assert re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", data["commit"]), path.name


def test_relative_links_resolve() -> None:
    broken = []
    for page in PAGES:
        text = page.read_text()
        anchors = {m for m in re.findall(r'<a id="([^"]+)"></a>', text)}
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and resolved.suffix == ".md":
                ids = set(re.findall(r'<a id="([^"]+)"></a>', resolved.read_text())) | {
                    re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
                    for h in re.findall(r"^#+ (.+)$", resolved.read_text(), re.M)}
                if anchor not in ids | (anchors if resolved == page else set()):
                    broken.append(f"{page.name}: {target}")
    assert broken == []
