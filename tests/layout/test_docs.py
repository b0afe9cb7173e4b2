"""The docs as a reference (issue 39): every relative link of the README,
docs/ and the folders' READMEs leads to a file that exists and, with an
anchor, to a heading of it (GitHub's anchors); and no page of docs/ grows
past about 500 lines (history goes to docs/history/)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 520
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def pages():
    found = [REPO / "README.md"]
    found += sorted((REPO / "docs").rglob("*.md"))
    found += sorted(p for p in REPO.glob("*/README.md"))
    found += sorted(p for p in REPO.glob("*/*/README.md") if ".venv" not in p.parts)
    return [p for p in found if p.is_file()]


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped (but
    '-' and '_'), spaces to '-'."""
    text = re.sub(r"`|\*\*|\[|\]\([^)]*\)", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    out = set()
    seen = {}
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path):
    in_code = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):
                continue  # http:, https:, mailto:
            yield n, target


def test_every_relative_link_leads_somewhere():
    broken = []
    for page in pages():
        for n, target in links(page):
            file_part, _, anchor = target.partition("#")
            dest = page if not file_part else (page.parent / file_part).resolve()
            where = f"{page.relative_to(REPO)}:{n}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no {file_part})")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no heading #{anchor} in {dest.relative_to(REPO)})")
    assert not broken, f"{len(broken)} broken link(s):\n" + "\n".join(broken)


def test_no_doc_page_is_over_about_500_lines():
    long = {str(p.relative_to(REPO)): len(p.read_text().splitlines())
            for p in sorted((REPO / "docs").rglob("*.md"))}
    over = {p: n for p, n in long.items() if n > MAX_LINES}
    assert not over, f"over {MAX_LINES} lines: {over}"


def test_the_checker_finds_a_broken_anchor(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# Top\n\n## Some `code` heading, (with) punctuation\n\n"
                    "[ok](#some-code-heading-with-punctuation) [bad](#nowhere)\n")
    found = {target for _, target in links(page)}
    assert found == {"#some-code-heading-with-punctuation", "#nowhere"}
    assert "some-code-heading-with-punctuation" in anchors(page)
    assert "nowhere" not in anchors(page)
