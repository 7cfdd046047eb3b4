"""The docs tree holds together: every page under docs/ is reachable from README.md by links, and
every relative link (and #anchor) in README.md and docs/ points at a file and heading that exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose(path: Path) -> str:
    """The page without its fenced blocks (a link-like text in code is not a link)."""
    out, inside = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            inside = not inside
        elif not inside:
            out.append(line)
    return "\n".join(out)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, spaces to -."""
    found = set()
    for line in prose(path).splitlines():
        if m := re.match(r"#{1,6}\s+(.*)", line):
            text = m.group(1).strip().lower()
            found.add("".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-"))
    return found


def links(path: Path) -> list[tuple[Path, str]]:
    out = []
    for target in LINK.findall(prose(path)):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        out.append(((path.parent / file).resolve() if file else path, anchor))
    return out


def test_every_relative_link_resolves_to_a_file_and_heading():
    for page in pages():
        for target, anchor in links(page):
            where = f"{page.relative_to(ROOT)} -> {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}"
            assert target.exists(), f"{where}: no such file"
            assert target.is_relative_to(ROOT), f"{where}: points outside the repository"
            if anchor and target.suffix == ".md":
                assert anchor in anchors(target), f"{where}#{anchor}: no such heading"


def test_every_docs_page_is_reachable_from_the_readme():
    seen, todo = set(), [(ROOT / "README.md").resolve()]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md" or not page.exists():
            continue
        seen.add(page)
        todo += [target for target, _ in links(page)]
    missing = [str(p.relative_to(ROOT)) for p in pages() if p.resolve() not in seen]
    assert not missing, f"not linked from README.md or a page it reaches: {missing}"


def test_the_readme_is_a_short_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
