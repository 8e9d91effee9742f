"""Every link and every repository path the docs cite exists: relative Markdown links (and their #anchors), and
paths in backticks (`src/...`, `tests/...`, `bench/...`, `docs/...`, a module under `src/kvbridge` such as
`core/plan.py`, and result files such as `ttft-plain-20261201-210718.json` under bench/results)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    p
    for p in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("bench/*.md")]
    if p.exists()
)
LAYERS = ("core", "wire", "transport", "runtime", "vllm", "serving", "testing")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
RESULT = re.compile(r"^[\w.+-]+-20\d{6}[\w.+-]*\.(?:json|txt|log|md)$")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in page.read_text(encoding="utf-8").splitlines() if line.startswith("#")}


def broken_links(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
        if not dest.exists():
            broken.append(f"{target} (no {rel})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {rel})")
    return broken


def cited_paths(text: str) -> set[str]:
    paths = set()
    for code in CODE.findall(text):
        for word in code.split():
            word = word.strip("(),;:'\"").split("::")[0]
            if "…" in word or "*" in word or "<" in word or "{" in word or "$" in word:
                continue
            if re.match(r"(src|tests|bench|docs)/[\w./-]+$", word):
                paths.add(word.rstrip("/."))
            elif re.match(rf"({'|'.join(LAYERS)})/[\w/]+\.py$", word):
                paths.add(f"src/kvbridge/{word}")
            elif RESULT.match(word):
                paths.add(f"bench/results/{word}")
    return paths


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_and_cited_path_exists(page):
    missing = [p for p in sorted(cited_paths(page.read_text(encoding="utf-8"))) if not (ROOT / p).exists()]
    assert not broken_links(page) + missing, f"{page.relative_to(ROOT)}: {broken_links(page) + missing}"


def test_the_check_notices_a_missing_path_and_anchor(tmp_path):
    page = ROOT / "docs" / "x.md"  # resolved against the real tree; never written
    assert cited_paths("see `core/plan.py` and `bench/results/nope-20990101.json`, `nope-20990101-1.json`") == {
        "src/kvbridge/core/plan.py",
        "bench/results/nope-20990101.json",
        "bench/results/nope-20990101-1.json",
    }
    fake = tmp_path / "p.md"
    fake.write_text("[a](nothing.md) [b](#nowhere) [c](https://example.com)\n# Here\n", encoding="utf-8")
    assert len(broken_links(fake)) == 2
    assert slug("## MLA (DeepSeek-V2)".lstrip("#")) == "mla-deepseek-v2"
    assert page.parent.exists()


def test_bench_readme_indexes_every_script_and_result_file():
    index = (ROOT / "bench" / "README.md").read_text(encoding="utf-8")
    scripts = [p.name for p in (ROOT / "bench").iterdir() if p.suffix in (".py", ".sh")]
    results = [p.name for p in (ROOT / "bench" / "results").iterdir() if p.is_file()]
    missing = [name for name in sorted(scripts + results) if f"`{name}" not in index]
    assert not missing, f"bench/README.md does not index: {missing}"
