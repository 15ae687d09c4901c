"""The documentation holds together: every relative link resolves, the site's navigation
lists every page, the index pages link every page under them, and the results page
quotes its study pages verbatim."""

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _pages():
    """README.md and every Markdown page under docs/."""
    return [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))


def _prose(text):
    """``text`` without fenced code blocks and inline code spans (links there are code)."""
    text = re.sub(r"^([ \t]*)```.*?^\1```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading):
    """Python-Markdown's ``toc`` slug of a heading (what MkDocs makes its anchor)."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.replace("**", "").replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page):
    text = re.sub(r"^([ \t]*)```.*?^\1```", "", page.read_text(encoding="utf-8"),
                  flags=re.S | re.M)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.*?)\s*$", text, re.M)}


def _links(page):
    return [m.group(1) for m in _LINK.finditer(_prose(page.read_text(encoding="utf-8")))]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_an_existing_file(page):
    """A relative link (image or page) names a file that exists; one into a Markdown page
    with ``#anchor`` names a heading of that page. Web links and pure ``#anchors`` are
    not checked."""
    broken = []
    for url in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", url) or url.startswith("#"):
            continue
        path, _, anchor = url.partition("#")
        target = (page.parent / path).resolve()
        if not target.exists():
            broken.append(url)
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(url)
    assert broken == [], f"{page.relative_to(ROOT)}: broken links {broken}"


def _nav_paths(node):
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [p for item in node for p in _nav_paths(item)]
    if isinstance(node, dict):
        return [p for value in node.values() for p in _nav_paths(value)]
    return []


def test_mkdocs_nav_lists_every_page():
    """Every page under docs/ is in the navigation (the result files under docs/results/
    are reached from the study pages), and every nav entry exists."""
    import yaml

    nav = _nav_paths(yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"])
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")
             if RESULTS not in p.parents}
    assert len(nav) == len(set(nav)), "a page is listed twice in the nav"
    assert sorted(pages - set(nav)) == [], "pages missing from mkdocs.yml's nav"
    assert sorted(set(nav) - pages) == [], "nav entries with no page"


@pytest.mark.parametrize("index, folder", [("benchmarks.md", "benchmarks"),
                                           ("user-guide.md", "guide")])
def test_index_pages_link_every_page_of_their_folder(index, folder):
    linked = {url.partition("#")[0] for url in _links(DOCS / index)}
    pages = {f"{folder}/{p.name}" for p in (DOCS / folder).glob("*.md")}
    assert pages and sorted(pages - linked) == []


def test_readme_links_every_top_level_page():
    linked = {url.partition("#")[0] for url in _links(ROOT / "README.md")}
    for name in ("results.md", "user-guide.md", "your-own-framework.md", "benchmarks.md",
                 "architecture.md", "api.md", "security.md"):
        assert f"docs/{name}" in linked, name


_CI = re.compile(r"[+−-]?\d[\d,.]*%?(?: points)? \[[^\]\n]+\]")


def test_results_page_quotes_each_study_page_verbatim():
    """One row per study page (and rows for studies on other pages), and every figure with
    a CI in a row appears, character for character, on the page the row links."""
    rows = [ln for ln in (DOCS / "results.md").read_text(encoding="utf-8").splitlines()
            if ln.startswith("| [")]
    studies = sorted(f"benchmarks/{p.name}" for p in (DOCS / "benchmarks").glob("*.md")
                     if p.name != "reproduce.md")
    linked = []
    for row in rows:
        (page,) = re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", row.split("|")[1])
        linked.append(page)
        study = " ".join((DOCS / page).read_text(encoding="utf-8").replace("**", "").split())
        figures = _CI.findall(row.replace("**", ""))
        missing = [f for f in figures if f not in study]
        assert missing == [], f"{page}: not on the page: {missing}"
    assert sorted(p for p in linked if p.startswith("benchmarks/")) == studies
    assert len(linked) == len(set(linked))
