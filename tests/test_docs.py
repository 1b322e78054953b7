"""The README stays a newcomer's page that tells the truth: short, its links live, every schedule and option
named, every refusal it lists explained in docs/faithfulness.md, and its install line the distribution's real name.
And the project's text carries no history: no issue numbers, no sittings of work."""
import inspect
import re
from pathlib import Path

import pytest

import autopipe
from autopipe.ir.schedule import NAMES

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FAITHFULNESS = ROOT / "docs" / "faithfulness.md"
# the pages the README hands a reader to; docs/architecture.md is the design's own and checked by its owner
PAGES = [README, *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "architecture.md")]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def _table_rows(section: str) -> list[list[str]]:
    rows = [line for line in section.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]
    return cells[2:]  # past the header and its rule


def test_readme_is_at_most_12k_characters():
    size = len(README.read_bytes())
    assert size <= 12_000, f"README.md is {size} bytes: move reference material to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_point_at_existing_files_and_headings(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert not broken, f"{page.name}: links to nothing: {broken}"


def test_every_schedule_is_in_the_readme():
    text = README.read_text()
    schedules = _section(text, "Schedules")
    assert [name for name in NAMES if f'`"{name}"`' not in schedules] == []


def test_every_option_is_in_the_options_table():
    options = {row[0] for row in _table_rows(_section(README.read_text(), "Options"))}
    named = {name for cell in options for name in re.findall(r"`(\w+)`", cell)}
    wanted = (set(inspect.signature(autopipe.compile).parameters) | set(inspect.signature(autopipe.plan).parameters))
    assert sorted(wanted - {"model"} - named) == []


def test_every_refusal_in_the_readme_is_in_docs_faithfulness():
    rows = _table_rows(_section(README.read_text(), "Faithfulness"))
    refused = [what for what, verdict in rows if verdict.startswith("refused")]
    assert len(refused) >= 15
    docs = FAITHFULNESS.read_text()
    assert [what for what in refused if what not in docs] == []


def test_install_line_names_the_distribution():
    name = re.search(r'^name = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), flags=re.M).group(1)
    text = README.read_text()
    assert name != "autopipe"  # on PyPI that is someone else's package
    assert f"`{name}`" in text and "pip install -e ." in text
    assert "pip install autopipe" not in text
    for command in ("make demo", "make test"):
        assert command in text



# The project's text speaks of the project; its history is in git log and docs/decisions/history.md, dated. The word
# for a sitting of work is spelt in two pieces here, so that this file passes its own test.
TEXTS = ["autopipe", "passes", "tests", "benchmarks", "examples", "zoo", "docs", "notes", ".ci", "README.md",
         "Makefile", "pyproject.toml"]
SITTING = "sess" + "ion"
HISTORY_WORDS = re.compile(rf"\bissues?\s*#?\s*[0-9]+|{SITTING}", flags=re.I)
PYTEST_API = re.compile(rf"""scope=["']{SITTING}["']|test {SITTING} starts""")  # pytest's own words


def _texts() -> list[Path]:
    paths = [p for top in TEXTS for p in ((ROOT / top).rglob("*") if (ROOT / top).is_dir() else [ROOT / top])]
    return sorted(p for p in paths if p.is_file() and ".venv" not in p.parts and "__pycache__" not in p.parts
                  and (p.suffix in (".py", ".md", ".sh", ".toml") or p.name in ("Makefile", "run")))


def test_no_issue_numbers_nor_sittings_of_work_in_code_or_docs():
    """No issue numbered and no sitting of work named anywhere in code, tests, benchmarks, CI or docs
    (docs/decisions/history.md too, which is dated instead); words wrapped across two lines count as well."""
    found = [f"{p.relative_to(ROOT)}: {m.group(0)!r}" for p in _texts()
             for m in HISTORY_WORDS.finditer(PYTEST_API.sub("", re.sub(r"\s+", " ", p.read_text())))]
    assert len(_texts()) > 100  # the walk
    assert found == []
