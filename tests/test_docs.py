"""The README and the docs pages: every relative link resolves (file and #anchor), and the text speaks of
the project, not of how it was made."""

import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted(["README.md", "bench/README.md", *(os.path.relpath(p, REPO) for p in glob.glob(f"{REPO}/docs/*.md"))])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    with open(path) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    headings = re.findall(r"^#+\s+(.*)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def relative_links(page: str) -> list[str]:
    with open(os.path.join(REPO, page)) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:", t)]


def test_the_pages_exist_and_link_to_something():
    assert {"README.md", "docs/kl.md", "docs/training.md", "docs/config.md", "docs/gpu.md",
            "docs/results.md", "bench/README.md"} <= set(PAGES)
    assert len(relative_links("README.md")) >= 10


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(REPO, os.path.dirname(page), path)) if path else os.path.join(REPO, page)
        if not os.path.exists(resolved):
            broken.append(f"{target} (no file {os.path.relpath(resolved, REPO)})")
        elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor})")
    assert not broken, f"{page}: broken links: {broken}"


def test_anchor_rule_matches_github():
    assert "several-processes-ddp-and-fsdp2" in anchors(os.path.join(REPO, "docs", "gpu.md"))
    assert "critic-free-grpo-and-rloo" in anchors(os.path.join(REPO, "docs", "training.md"))


@pytest.mark.parametrize("page", PAGES)
def test_text_speaks_of_the_project_not_its_history(page):
    with open(os.path.join(REPO, page)) as f:
        text = f.read()
    found = re.findall(r"this session|now fixed|the previous code|\bissue \d+|\(issue \d+\)", text, flags=re.I)
    assert not found, f"{page}: {found}"


def test_readme_is_a_front_door():
    with open(os.path.join(REPO, "README.md")) as f:
        assert len(f.read().splitlines()) <= 200
