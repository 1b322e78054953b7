"""The layout docs/architecture.md promises: no import cycle among the modules of autopipe/ and passes/ (every import
counts, also one inside a function or under TYPE_CHECKING), layers that point one way, no private name imported across
modules, no module over 400 lines nor function over 100, messages raised of at most 300 characters, every module
named in the reading order, every package installed, every named note defined once in the code and every citation of
one (or of a section of architecture.md) pointing at something that is there."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"autopipe": ROOT / "autopipe", "autopipe.passes": ROOT / "passes"}  # pyproject's package-dir
LONGEST_FUNCTION = 100
LONGEST_MODULE = 400      # lines
LONGEST_MESSAGE = 300     # characters of a raise's message, a formatted field counted as PLACEHOLDER
PLACEHOLDER = 10
# What each layer may import of autopipe besides itself. autopipe.ir: what the passes hand the runtime and both read;
# random_ops (the ops stage code calls, under a name the generated code spells out) and global_state: leaf libraries.
LEAVES = ("autopipe.random_ops", "autopipe.global_state")
LAYERS = {"autopipe.ir": (), **{leaf: () for leaf in LEAVES},
          "autopipe.passes": ("autopipe.ir", *LEAVES), "autopipe.runtime": ("autopipe.ir",)}


def modules() -> dict[str, Path]:
    """Every module's dotted name -> its file; a package's name -> its __init__.py."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The known modules that ``name`` imports: ``from x import y`` imports x.y where that is a module, else x."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *filter(None, [base])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # import a.b.c where a.b is the module we know
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
            # importing a.b.c runs a.b's __init__ first: a package the importer is not inside (nor the facade, autopipe)
            while (target := target.rpartition(".")[0]) and target != "autopipe" and not name.startswith(target + "."):
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    known = modules()
    graph = {name: imports(name, path, set(known)) for name, path in known.items()}
    assert graph["autopipe.passes.partition"] >= {"autopipe.passes.cost", "autopipe.passes.cut_solver"}  # the parse
    assert cycles(graph) == []


def layer(name: str) -> str | None:
    """The layer ``name`` belongs to; None: the top (compile, verify, the command line), which may import any."""
    return next((top for top in LAYERS if name == top or name.startswith(top + ".")), None)


def test_layers_point_one_way():
    """The runtime imports nothing of the passes and the passes nothing of the runtime; what both need is in
    autopipe.ir, which imports neither; no layer imports the top."""
    known = modules()
    crossings = [f"{name} imports {target}" for name, path in sorted(known.items()) if (own := layer(name))
                 for target in sorted(imports(name, path, set(known)))
                 if layer(target) != own and layer(target) not in LAYERS[own]]
    assert crossings == []


def test_no_function_over_100_lines():
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in modules().values() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION]
    assert long == []


def test_architecture_names_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    unnamed = [str(path.relative_to(ROOT)) for path in modules().values() if f"`{path.relative_to(ROOT)}`" not in text]
    assert unnamed == []


def test_architecture_is_a_design_document_of_at_most_25k_characters():
    """The design a newcomer finishes: the history is in docs/decisions/, the reasons beside the code as notes."""
    assert len((ROOT / "docs" / "architecture.md").read_text()) <= 25_000


def private_names_used(name: str, path: Path, known: set[str]) -> list[str]:
    """Another module's private names ``name`` reaches: ``from m import _x`` and ``m._x`` (m bound by an import) where m
    is one of autopipe's modules. ``_x`` private: one leading underscore, not a dunder."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    private = lambda attr: attr.startswith("_") and not attr.startswith("__")  # noqa: E731
    bound, found = {}, []  # local name -> the module it is
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            bound.update({alias.asname: alias.name for alias in node.names if alias.asname and alias.name in known})
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *filter(None, [base])])
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
                elif base in known and private(alias.name):
                    found.append(f"{name}:{node.lineno} imports {base}.{alias.name}")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound \
                and private(node.attr) and bound[node.value.id] != name:
            found.append(f"{name}:{node.lineno} reads {bound[node.value.id]}.{node.attr}")
    return found


def test_no_module_imports_another_modules_private_names():
    known = modules()
    assert [f for name, path in sorted(known.items()) for f in private_names_used(name, path, set(known))] == []


def test_no_module_over_400_lines():
    long = {str(path.relative_to(ROOT)): n for path in modules().values()
            if (n := len(path.read_text().splitlines())) > LONGEST_MODULE}
    assert long == {}


def message_length(node: ast.expr) -> int:
    """The characters of a message as written: literal text, each formatted field (or other expression) as
    PLACEHOLDER, a choice (``{...}[k]``, ``a if c else b``) as its longest branch."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return len(node.value)
    if isinstance(node, ast.JoinedStr):
        return sum(len(v.value) if isinstance(v, ast.Constant) else PLACEHOLDER for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return message_length(node.left) + message_length(node.right)
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict):
        return max(map(message_length, node.value.values))
    if isinstance(node, ast.IfExp):
        return max(message_length(node.body), message_length(node.orelse))
    return PLACEHOLDER


def test_every_message_raised_is_at_most_300_characters():
    """docs/faithfulness.md holds the rest: a message says what happened and what to do, in a sentence or two."""
    long = [f"{path.relative_to(ROOT)}:{node.lineno} ({n} characters)" for path in modules().values()
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args
            and (n := message_length(node.exc.args[0])) > LONGEST_MESSAGE]
    assert long == []


def test_pyproject_installs_every_package_and_reads_the_one_version():
    """A package pyproject does not list is left out of the wheel; the version is written once, autopipe.__version__."""
    import pytest
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert sorted(packages - set(config["tool"]["setuptools"]["packages"])) == []
    assert "version" not in config["project"] and "version" in config["project"]["dynamic"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "autopipe.__version__"}



# A named note: "# Note [name]: why" beside the code it guards (or a paragraph of a module's docstring); a citation
# elsewhere is the name without the colon. Lines are joined first, as a name may wrap in a comment or a docstring.
NOTE = re.compile(r"Note\s+\[([^\]]+)\](:?)")
TEXTS = ["autopipe", "passes", "tests", "benchmarks", "examples", "zoo", "docs", "notes", ".ci", "README.md"]


def project_texts(suffixes: tuple[str, ...] = (".py", ".md", ".sh")) -> list[Path]:
    """The project's code and documents: every file of these suffixes under TEXTS, none of a virtual environment."""
    paths = [p for top in TEXTS for p in ((ROOT / top).rglob("*") if (ROOT / top).is_dir() else [ROOT / top])]
    return sorted(p for p in paths if p.suffix in suffixes and p.is_file() and ".venv" not in p.parts)


def notes_written() -> list[tuple[str, str, bool]]:
    """(file, name, whether it defines the note) for every named note written in the project; in Markdown, an inline
    code span is an example of the syntax, not a citation."""
    found = []
    for path in project_texts():
        text = re.sub(r"\n[ \t]*(?:#[ \t]*)?", " ", path.read_text())
        if path.suffix == ".md":
            text = re.sub(r"`[^`]*`", "", text)
        found += [(str(path.relative_to(ROOT)), re.sub(r"\s+", " ", m.group(1)), bool(m.group(2)))
                  for m in NOTE.finditer(text)]
    return found


def test_every_note_is_defined_once_in_the_code_and_every_citation_resolves():
    written = notes_written()
    defined: dict[str, list[str]] = {}
    for file, name, defines in written:
        if defines:
            defined.setdefault(name, []).append(file)
    assert {name: files for name, files in defined.items() if len(files) > 1} == {}
    assert [f"{file}: {name}" for file, name, defines in written if defines and not file.endswith(".py")] == []
    assert sorted({f"{file}: {name}" for file, name, _ in written if name not in defined}) == []
    assert len(defined) >= 70  # the parse: the notes the code holds


def test_every_section_of_architecture_cited_exists():
    """A citation ``docs/architecture.md, "Tasks"`` names one of its headings (or the start of one)."""
    headings = re.findall(r"^#+ (.*)$", (ROOT / "docs" / "architecture.md").read_text(), flags=re.M)
    cited = [(str(path.relative_to(ROOT)), section) for path in project_texts((".py", ".md"))
             for section in re.findall(r"architecture\.md\)?,? \"([^\"]+)\"", re.sub(r"\s+", " ", path.read_text()))]
    assert len(cited) >= 10  # the parse
    assert [f"{file}: {section}" for file, section in cited if not any(h.startswith(section) for h in headings)] == []
