"""References between the code and the docs resolve.

- Every "§N" cited in dflash2/, server/, scripts/ or tests/ (and every "spec §N" in README.md and
  docs/) is a numbered heading of docs/dflash2-spec.md, and a module that cites "spec §N" names
  that document.
- Every docs/*.md, scripts/*.py, dflash2/… or server/… file named in a comment or string of the
  code, or in the docs, exists; a quoted section name after a docs path (``docs/engine.md, "Token
  trees"``) is a heading or bold paragraph title of that document.
- The docs' links to anchors (``engine.md#token-trees``) land on a heading.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "docs" / "dflash2-spec.md"
CODE_DIRS = ("dflash2", "server", "scripts", "tests")
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# "§N" written in the code that names a section of another document, by (file, text on the same line).
EXTERNAL_CITATIONS = {("dflash2/models/tensor_parallel.py", "Megatron-LM")}

SECTION = re.compile(r"§(\d+(?:\.\d+)*)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$")
SPEC_HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s")
PATH = re.compile(
    r"(?<![\w/.-])((?:docs/[\w.-]+\.md)|(?:scripts/[\w.-]+\.(?:py|sh))|(?:(?:dflash2|server)/[\w/.-]+\.(?:py|md|cpp)))"
)
QUOTED_SECTION = re.compile(r"(docs/[\w.-]+\.md)`{0,2},?\s+\"([^\"]+)\"")
MD_LINK = re.compile(r"\]\(([\w./-]*\.md)?#([\w-]+)\)")


def _python_files() -> list[Path]:
    return sorted(p for d in CODE_DIRS for p in (REPO / d).rglob("*.py") if ".venv" not in p.parts)


def _text_tokens(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and string literal of a Python file (docstrings included)."""
    kinds = {tokenize.COMMENT, tokenize.STRING}
    fstring_middle = getattr(tokenize, "FSTRING_MIDDLE", None)
    if fstring_middle is not None:
        kinds.add(fstring_middle)
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [(tok.start[0], tok.string) for tok in tokens if tok.type in kinds]


def _spec_sections() -> set[str]:
    sections = set()
    for line in SPEC.read_text().splitlines():
        match = SPEC_HEADING.match(line)
        if match:
            sections.add(match.group(1))
    return sections


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces → hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    anchors: set[str] = set()
    in_code = False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else HEADING.match(line)
        if match:
            base = _anchor(match.group(1))
            anchor, n = base, 0
            while anchor in anchors:
                n += 1
                anchor = f"{base}-{n}"
            anchors.add(anchor)
    return anchors


def _titles(doc: Path) -> set[str]:
    """Headings and bold paragraph titles of a markdown document, lower case."""
    text = doc.read_text()
    headings = {m.group(1).lower() for line in text.splitlines() if (m := HEADING.match(line))}
    bold = {m.lower() for m in re.findall(r"\*\*([^*]+)\*\*", text)}
    return headings | bold


def test_spec_has_the_sections_the_code_relies_on() -> None:
    sections = _spec_sections()
    for number in ("1", "1.1", "1.2", "1.3", "2", "2.1", "2.4", "2.6", "3.2", "4.3", "5.2", "5.4", "6", "7", "9", "10"):
        assert number in sections, f"docs/dflash2-spec.md has no section {number}"


def test_every_cited_section_has_a_heading() -> None:
    sections = _spec_sections()
    missing = []
    for path in _python_files():
        rel = path.relative_to(REPO).as_posix()
        lines = path.read_text().splitlines()
        for line_no, text in _text_tokens(path):
            for offset, part in enumerate(text.splitlines()):
                source_line = lines[line_no - 1 + offset] if line_no - 1 + offset < len(lines) else part
                if any(rel == f and marker in source_line for f, marker in EXTERNAL_CITATIONS):
                    continue
                missing += [f"{rel}:{line_no + offset}: §{n}" for n in SECTION.findall(part) if n not in sections]
    for doc in DOCS:
        for line_no, line in enumerate(doc.read_text().splitlines(), 1):
            for cited in re.findall(r"spec(?:\.md)?\)? (§[\d.]+(?:(?:, | and |–)§[\d.]+)*)", line):
                missing += [
                    f"{doc.name}:{line_no}: §{n}" for n in SECTION.findall(cited) if n.rstrip(".") not in sections
                ]
    assert not missing, "sections cited but not in docs/dflash2-spec.md:\n" + "\n".join(missing)


def test_modules_citing_the_spec_name_it() -> None:
    """A module that cites "spec §N" says once where the spec is."""
    unnamed = []
    for path in _python_files():
        text = path.read_text()
        if re.search(r"\bspec §\d", text, re.IGNORECASE) and "docs/dflash2-spec.md" not in text:
            unnamed.append(path.relative_to(REPO).as_posix())
    assert not unnamed, "modules citing 'spec §N' without naming docs/dflash2-spec.md: " + ", ".join(unnamed)


def test_paths_named_in_comments_and_strings_exist() -> None:
    missing = []
    for path in _python_files():
        rel = path.relative_to(REPO).as_posix()
        for line_no, text in _text_tokens(path):
            for named in PATH.findall(text):
                if not (REPO / named).exists():
                    missing.append(f"{rel}:{line_no}: {named}")
            for doc, quoted in QUOTED_SECTION.findall(text):
                title = " ".join(quoted.split())  # a docstring may wrap the title
                if (REPO / doc).exists() and title.lower() not in _titles(REPO / doc):
                    missing.append(f'{rel}:{line_no}: {doc}, "{title}"')
    assert not missing, "paths or sections named in the code that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_paths_named_in_the_docs_exist(doc: Path) -> None:
    missing = sorted({named for named in PATH.findall(doc.read_text()) if not (REPO / named).exists()})
    assert not missing, f"{doc.name} names files that do not exist: " + ", ".join(missing)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_markdown_anchor_links_resolve(doc: Path) -> None:
    broken = []
    for target, anchor in MD_LINK.findall(doc.read_text()):
        linked = (doc.parent / target) if target else doc
        if not linked.exists():
            broken.append(f"{target}#{anchor} (no such file)")
        elif anchor not in _anchors(linked):
            broken.append(f"{target or doc.name}#{anchor}")
    assert not broken, f"{doc.name} links to anchors that are not headings: " + ", ".join(broken)
