"""The README and the docs pages: every relative link resolves (file and #anchor), the text speaks of the
project, not of how it was made, and each measured number has one page that owns it, which every other page
quoting it agrees with."""

import glob
import os
import re
from typing import NamedTuple

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
        assert len(f.read().splitlines()) <= 130  # about 120 lines: what it is, two commands, the KL table, three doors


# ----------------------------------------------------------------------------- one place for each fact


class Fact(NamedTuple):
    """A measured number with one page that owns it (`owner#anchor`, where `stated` finds it), and `quoted`:
    how another page (or a config's comment) would quote it. Every quote on another page must give the
    owner's value (the owner page itself holds related measurements, other machines' and runs', by design);
    the owner's section must exist, and each page in `linked_from` must link to it."""

    name: str
    owner: str
    stated: str
    quoted: tuple[str, ...]
    linked_from: tuple[str, ...] = ()


FACTS = (
    Fact("the embedded default's greedy accuracy, step 0 and step 40", "docs/results.md#the-embedded-default",
         r"\| `val/accuracy` \(greedy, 256 held-out\) \| \*\*(0\.\d+)\*\* \|[^\n]*\*\*(0\.\d+)\*\* \|",
         (r"\| `?val/accuracy`?[^|\n]*\| \*\*(0\.\d{3})\*\* \|[^\n]*\| \*\*(0\.\d{3})\*\* \|",
          r"val/accuracy[^\n]{0,60}?(0\.\d{3}) *(?:→|->) *(?:0\.\d{3} *(?:→|->) *)*(0\.\d{3})",
          r"accuracy from (0\.\d{3}) to (0\.\d{3})"),
         ("README.md",)),
    Fact("the planted habit's answers, step 0 and step 40", "docs/results.md#the-embedded-default",
         r"PPO all but removes the habit \((\d+) → (\d+)\)", (r"habit[^\n]{0,30}?\b(\d+) *(?:→|->) *(\d+)\b",)),
    Fact("where a reproducing run starts", "docs/results.md#what-reproduced-means-on-another-machine",
         r"the README's command starts at (0\.\d{3})", (r"(?:command|runs?) starts? at (0\.\d{3})",), ("README.md",)),
    Fact("where a reproducing run ends", "docs/results.md#what-reproduced-means-on-another-machine",
         r"ends at step 40 between (0\.\d\d) and (0\.\d\d)", (r"ends? at step 40 between (0\.\d\d) and (0\.\d\d)",),
         ("README.md",)),
    Fact("the warm start's build time", "docs/results.md#the-embedded-default", r"(\d+) s to generate 2,304 problems",
         (r"warm start[^\n]{0,20}\(~?(\d+) s\)", r"warm start takes ~?(\d+) s")),
    Fact("the bandit's forward- and reverse-KL optima apart (TV)", "docs/results.md#the-bandit",
         r"the forward- and reverse-KL optima lie (0\.\d+) apart", (r"optima[^\n]{0,40}? lie (0\.\d+) apart",),
         ("docs/training.md",)),
    Fact("the sweep's runs", "docs/comparison.md#as-a-wb-sweep", r"so the grid is (\d+) runs",
         (r"9 runs x seeds 42, 43, 44 = (\d+) runs", r"exactly the (\d+) runs",  # (the binding sweep has its own)
          r"the (\d+) runs of `python -m lab.compare --seeds 3`"),
         ("README.md", "docs/results.md")),
    Fact("the separating grid's wall time, 3 seeds", "docs/results.md#the-separating-regime-three-seeds",
         r"\*\*(\d+\.\d) minutes\*\* for the 27 runs", (r"27 runs in (\d+(?:\.\d)?) min",)),
    Fact("the test suite's size", "docs/results.md#appendix-the-machines-and-the-test-suite", r"(\d,\d{3}) tests in",
         (r"(\d,\d{3}) tests",)),
    Fact("one checkpoint of the GPU recipe", "docs/gpu.md#rehearsal-on-a-cpu-at-the-real-size",
         r"\| checkpoint \(float32 actor and critic, AdamW states\) \| (\d+\.\d) GiB",
         (r"checkpoint[^\n]{0,80}? is (\d+\.\d) GiB",)),
)
# Pages where a number is quoted: the docs, and the configs' comments.
QUOTING = PAGES + sorted(os.path.relpath(p, REPO) for p in glob.glob(f"{REPO}/configs/**/*.yaml", recursive=True))
# A quote known to be wrong at its source, which is code another page is generated from: (fact, page) -> where
# to fix it. The test fails once it is fixed, so that the entry goes.
KNOWN_WRONG: dict[tuple[str, str], str] = {}


def read(page: str) -> str:
    with open(os.path.join(REPO, page)) as f:
        return f.read()


def flat(text: str) -> str:
    """Text with its line breaks (and a YAML comment's `#`) joined into spaces, so a quote may wrap."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)


def owner_value(fact: Fact) -> tuple[str, ...]:
    page = fact.owner.partition("#")[0]
    found = re.findall(fact.stated, flat(read(page)))
    assert len(found) >= 1, f"{page} no longer states {fact.name}: update FACTS"
    values = {v if isinstance(v, tuple) else (v,) for v in found}
    assert len(values) == 1, f"{page} states {fact.name} differently: {values}"
    return values.pop()


def test_the_facts_regexes_find_what_they_are_for():
    """A fact's own quoting patterns recognise the owner's statement of it or a typical quote (else the check
    below could pass by finding nothing)."""
    samples = {"the embedded default's greedy accuracy, step 0 and step 40": "val/accuracy 0.383 -> 0.688",
               "the warm start's build time": "the warm start (~90 s) solves",
               "the sweep's runs": "(9 runs x seeds 42, 43, 44 = 27 runs)",
               "the separating grid's wall time, 3 seeds": "paired by seed: 27 runs in 54 minutes on 2 cores",
               "the bandit's forward- and reverse-KL optima apart (TV)": "optima at beta = 0.3 lie 0.33 apart"}
    for fact in FACTS:
        text = samples.get(fact.name, flat(read(fact.owner.partition("#")[0])))
        assert any(re.search(q, text) for q in fact.quoted), fact.name


@pytest.mark.parametrize("fact", FACTS, ids=lambda f: f.name)
def test_every_page_quoting_a_fact_agrees_with_its_owner(fact):
    value = owner_value(fact)
    wrong = []
    for page in QUOTING:
        if page == fact.owner.partition("#")[0]:
            continue
        text = flat(read(page))
        for pattern in fact.quoted:
            for quote in re.findall(pattern, text):
                quote = quote if isinstance(quote, tuple) else (quote,)
                if quote != value and (fact.name, page) not in KNOWN_WRONG:
                    wrong.append(f"{page}: {quote}")
                elif (fact.name, page) in KNOWN_WRONG:
                    assert quote != value, f"{page} now agrees: remove it from KNOWN_WRONG"
    assert not wrong, f"{fact.name} is {value} on {fact.owner}, but quoted as {wrong}"


@pytest.mark.parametrize("fact", FACTS, ids=lambda f: f.name)
def test_each_fact_has_its_section_and_the_pages_about_it_link_there(fact):
    page, _, anchor = fact.owner.partition("#")
    assert anchor in anchors(os.path.join(REPO, page)), fact.owner
    for other in fact.linked_from:
        targets = {os.path.normpath(os.path.join(os.path.dirname(other), t)) for t in relative_links(other)}
        assert os.path.normpath(fact.owner) in targets or os.path.normpath(page) in targets, (
            f"{other} speaks of {fact.name} but links neither {fact.owner} nor {page}")


def test_the_sweeps_runs_are_the_grid_times_its_seeds():
    """The owner's number of the sweep's runs is the code's: lab.compare's grid x the sweep file's seeds."""
    import yaml

    from lab.compare import DEFAULT_GRID

    with open(os.path.join(REPO, "configs", "sweeps", "kl_estimators.yaml")) as f:
        sweep = yaml.safe_load(f)
    seeds = sweep["parameters"]["trainer.seed"]["values"]
    runs = sweep["parameters"]["trainer.experiment_name"]["values"]
    assert len(runs) == len(DEFAULT_GRID)
    assert owner_value(FACTS[[f.name for f in FACTS].index("the sweep's runs")]) == (str(len(runs) * len(seeds)),)
