"""The package's layout is the pipeline: imports point only down the stage order, there are
no import cycles, no module imports another module's private name, and every reference to
docs/design.md in a docstring points at a file (and a section) that exists.

The stage order, bottom first (README, "Layout"):

    errors, labels, formats, fsio, allocator, version   small shared modules
    log          the raw log: model, layouts, reading, validation, parts, merge
    capture      the recorder, its sinks, signals, device timing
    attribution  the partitions (ITL, TTFT, client boundary) on one timeline kernel
    analysis     per-run figures, gaps, compare, verdict, what-if, fleet, export
    render       text, HTML, Perfetto
    live         metrics and traces while the engine serves
    cli          the command line (cli.py; cli_window.py: the window options; cli_output.py:
                 how records are written; cli_listing.py: gaps and ttft of a long run in
                 slices)

A module may import its own stage or any stage below it. The check reads the source with
`ast`, so a function-local import counts like one at the top (where an optional dependency
needs a local import, it is a third-party module and not checked here).
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "tracekit"

STAGES = ("base", "log", "capture", "attribution", "analysis", "render", "live", "cli")
BASE = {"errors", "labels", "formats", "fsio", "allocator", "version", "__main__"}
#: modules of the `cli` stage beside `cli.py` (what the command line shares, moved out of it)
CLI_MODULES = {"cli_window", "cli_output", "cli_listing"}


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def stage_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:  # the package itself (its __init__ is the public facade)
        return "facade"
    if parts[1] == "__main__" or parts[1] in CLI_MODULES:
        return "cli"
    if parts[1] in STAGES:
        return parts[1]
    if parts[1] in BASE:
        return "base"
    raise AssertionError(f"{module}: not in any stage; add it to STAGES or BASE")


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports_of(path: pathlib.Path, module: str) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every tracekit import in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("tracekit")]
        elif isinstance(node, ast.ImportFrom):
            name = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, name] if name else base)
            if name.startswith("tracekit"):
                out.append((name, [a.name for a in node.names], node.lineno))
    return out


def resolve(name: str, taken: list[str]) -> list[str]:
    """The tracekit modules an import statement loads (`from tracekit.x import y` loads the
    module tracekit.x.y where y is a submodule)."""
    mods = [name] if name in MODULES else []
    mods += [f"{name}.{t}" for t in taken if f"{name}.{t}" in MODULES]
    return mods or [name]


def test_every_module_belongs_to_a_stage():
    for m in MODULES:
        stage_of(m)


def test_imports_point_only_down_the_pipeline():
    bad = []
    for m, path in MODULES.items():
        here = stage_of(m)
        for name, taken, line in imports_of(path, m):
            for target in resolve(name, taken):
                there = stage_of(target)
                if here == "facade":
                    continue  # the facade re-exports from every stage
                if there == "facade":
                    bad.append(f"{m}:{line} imports the facade `tracekit` ({taken})")
                elif STAGES.index(there) > STAGES.index(here):
                    bad.append(f"{m}:{line} ({here}) imports {target} ({there}): up the pipeline")
    assert not bad, "\n".join(bad)


def test_no_private_names_across_modules():
    bad = []
    for m, path in MODULES.items():
        for name, taken, line in imports_of(path, m):
            if name.split(".")[-1].startswith("_") and name.split(".")[-1] != "__init__":
                bad.append(f"{m}:{line} imports the private module {name}")
            for t in taken:
                if t.startswith("_") and not t.startswith("__") and name != m:
                    bad.append(f"{m}:{line} imports the private name {name}.{t}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = {
        m: {t for name, taken, _ in imports_of(p, m) for t in resolve(name, taken) if t != m}
        for m, p in MODULES.items()
    }
    # a package's __init__ re-exports from its modules: an edge into the package is an edge
    # into what it re-exports, so cycles through a facade are found too
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if t not in graph:
                continue
            if state.get(t) == 1:
                cycles.append(" -> ".join([*stack[stack.index(t) :], t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)


DESIGN = ROOT / "docs" / "design.md"


def design_sections() -> set[str]:
    return {ln.lstrip("#").strip() for ln in DESIGN.read_text().splitlines() if ln.startswith("#")}


def test_design_md_is_in_the_repo_and_cited_sections_exist():
    assert DESIGN.is_file()
    sections = design_sections()
    cited = []
    for path in [*PKG.rglob("*.py"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]:
        text = path.read_text()
        # design.md's "Section", design.md, "Section"
        for m in re.finditer(r"design\.md(?:'s|,)?\s*(?:\(|,)?\s*\"([^\"]+)\"", text):
            cited.append((path, m.group(1)))
    # a citation names a heading or its first words ("The partition" for "The partition
    # (the heart of it)")
    missing = [
        f"{p.relative_to(ROOT)}: {s!r}"
        for p, s in cited
        if not any(h == s or h.startswith(s + " ") for h in sections)
    ]
    assert cited, "expected docstrings that cite design.md's sections"
    assert not missing, "cited sections not in docs/design.md:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    "name",
    ["Recorder", "RawLog", "load", "partition", "analyze", "ttft_partition", "LogError"],
)
def test_public_api_at_the_top(name):
    import tracekit

    assert name in tracekit.__all__
    assert getattr(tracekit, name) is not None


#: Where no class reaches into another object's private state (`other._name`): the whole
#: package.
OWN_STATE_PACKAGES = ("tracekit",)


def private_reach_ins(path: pathlib.Path) -> list[str]:
    """Every `x._name` in `path` where `x` is not `self` or `cls` (dunder names are not
    private; a module's own private functions are called by their bare name)."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or (name.startswith("__") and name.endswith("__")):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        out.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    return out


def test_no_class_reaches_into_another_objects_private_state():
    bad = [
        hit
        for m, path in MODULES.items()
        if m.startswith(OWN_STATE_PACKAGES)
        for hit in private_reach_ins(path)
    ]
    assert not bad, "private state reached from outside its object:\n" + "\n".join(bad)


# -- sizes, and why an import is local ------------------------------------------------------


MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 1000


def test_no_function_over_100_lines():
    long = [
        f"{p.relative_to(ROOT)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
        for p in MODULES.values()
        for n in ast.walk(ast.parse(p.read_text(), str(p)))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, "split these into named steps:\n" + "\n".join(long)


def test_no_module_over_1000_lines():
    big = [
        f"{p.relative_to(ROOT)} ({n} lines)"
        for p in MODULES.values()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not big, "split these modules:\n" + "\n".join(big)


def uncommented_local_imports(path: pathlib.Path) -> list[str]:
    """Every import inside a function with no comment saying why it is local: on its own
    line(s), or on the nearest line above that is not blank or `try:`. One comment covers a
    block of consecutive local imports (each import's line above is the previous one)."""
    text = path.read_text()
    lines = text.splitlines()
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    comments = {t.start[0] for t in tokens if t.type == tokenize.COMMENT}
    tree = ast.parse(text, str(path))
    local = {
        (n.lineno, n.end_lineno): n
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(fn)
        if isinstance(n, (ast.Import, ast.ImportFrom))
    }
    by_end = {end: n for (_, end), n in local.items()}

    def says_why(n: ast.stmt) -> bool:
        assert n.end_lineno is not None
        if comments & set(range(n.lineno, n.end_lineno + 1)):
            return True
        ln = n.lineno - 1
        while ln >= 1 and ln not in comments and lines[ln - 1].strip() in ("", "try:"):
            ln -= 1
        if ln in comments:
            return True
        return ln in by_end and says_why(by_end[ln])

    return [
        f"{path.relative_to(ROOT)}:{n.lineno} {ast.unparse(n)}"
        for n in sorted(local.values(), key=lambda n: n.lineno)
        if not says_why(n)
    ]


def test_every_function_local_import_says_why():
    """A local import is deferred (a heavy module only where it is used), an optional extra,
    or breaks a cycle; a silent one hides which (module-level is the default)."""
    bad = [hit for path in MODULES.values() for hit in uncommented_local_imports(path)]
    assert not bad, "say why each import is local, or move it to the top:\n" + "\n".join(bad)


# -- the serve wire contract: spelled out in one module -----------------------------------

CONTRACT = PKG / "log" / "serve_contract.py"
#: Where the contract's names are written into logs and read back: the package, the
#: engine adapters (the vLLM serve plugin) and the benches.
CONTRACT_READERS = [
    *sorted(PKG.rglob("*.py")),
    *sorted((ROOT / "engine_adapters").glob("*.py")),
    *sorted((ROOT / "bench").glob("*.py")),
]


def contract_values() -> tuple[set[str], set[str]]:
    """(every string value the contract defines, the roles among them)."""
    from tracekit.log import serve_contract as sc

    values = {v for k, v in vars(sc).items() if k.isupper() and isinstance(v, str)}
    return values, set(sc.ROLES)


def test_the_serve_contract_is_defined_in_one_module():
    """No other module binds a module-level name to one of the contract's values (a second
    definition of a counter name, the separators, a role, the shared clock), spells a
    counter name, a separator or the shared clock as a bare literal anywhere (``"\\x1f"``
    in an f-string included), or compares a role with a bare literal."""
    values, roles = contract_values()
    # "~" alone is too common a string to ban outside assignments (paths, formats)
    bare_banned = {v for v in values if v not in roles and len(v) > 1} | {
        v for v in values if v == "\x1f"
    }
    assert "serve.added" in bare_banned and "\x1f" in bare_banned
    bad = []
    for path in CONTRACT_READERS:
        if path == CONTRACT:
            continue
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(ROOT)
        for node in tree.body:  # module-level names bound to a contract value
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                value = node.value
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    pairs = [(t, value)]
                    if isinstance(t, ast.Tuple) and isinstance(value, ast.Tuple):
                        pairs = list(zip(t.elts, value.elts, strict=False))
                    for tt, v in pairs:
                        if isinstance(v, ast.Constant) and v.value in values:
                            name = tt.id if isinstance(tt, ast.Name) else "?"
                            bad.append(f"{where}:{node.lineno} defines {name} = {v.value!r}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in bare_banned:
                bad.append(f"{where}:{node.lineno} spells out {node.value!r}")
            if isinstance(node, ast.Compare):
                for side in [node.left, *node.comparators]:
                    elts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                    for e in elts:
                        if isinstance(e, ast.Constant) and e.value in roles:
                            bad.append(f"{where}:{node.lineno} compares with {e.value!r}")
    assert not bad, "use tracekit.log.serve_contract's names:\n" + "\n".join(bad)
