"""The import layering of DESIGN.md, checked on the source files.

Every module of the package is given a layer below; a module may import
only from the layers its own layer allows (and from itself).  A module that
is not in the table fails the test: a new module states where it belongs.
No import cycle between modules is allowed, counting imports inside
functions too.
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"planner": "meshplan", "cost_model": "meshplan.cost_model", "ilp": "meshplan.ilp",
           "dp_search": "meshplan.dp_search", "runtime": "meshplan.runtime"}

# module (without the "meshplan." prefix) -> layer.  A package's own name is
# its __init__.  Folders not listed take the layer of their folder.
LAYER_OF = {
    # data types: what every layer may read
    "errors": "types", "cluster": "types", "graph": "types", "plan": "types",
    "request": "types", "methods": "types", "progress": "types", "traced": "types",
    "schedule": "types", "datasheets": "types", "primitives": "types", "units": "types",
    "alternatives": "types",    # what --explain records in a plan
    "recompute": "types",       # the recomputation choices and the selective region
    "collector": "types",       # the garbage collector's thresholds while tracing and planning
    "contributions": "types",   # gradient sums run once a step (planner and runtime)
    "flops": "types",           # the per-primitive FLOP table (the ILP's rules read it too)
    "specs": "types",           # the PartitionSpec vocabulary of plans (plain Python)
    "layout_moves": "types",    # where mesh axes go in a resharding (cost model and runtime)
    "tpu": "types",             # TPU slices of a cluster file (cluster.py reads them)
    # a plan bound to jax devices (Mesh, NamedSharding): Plan.shardings and the
    # runtime build meshes and specs the same way
    "shardings": "types",
    # the front end: jaxpr -> Graph (the meshplan.trace package), and the
    # public gradient and pipeline markers
    "trace": "trace", "markers": "trace",
    # built-in models (user code: they use the public markers)
    "models": "models",
    # on top of everything
    "": "top", "api": "top", "cli": "top", "planning": "top", "checkpoint": "top",
    "tools": "top",             # calibrate, verify, timeline drawing
    "explain": "top",           # plans the alternatives --explain lists
    "one_stage": "top",         # the whole-graph ILP plan (planning and explain)
    "offload": "top",           # optimizer state in host memory (one-stage plans)
}
FOLDER_LAYER = {"cost_model": "cost_model", "ilp": "ilp", "dp_search": "dp_search",
                "runtime": "runtime", "models": "models"}
ALLOWED = {
    "types": {"types"},
    "trace": {"types", "trace"},
    "models": {"types", "trace", "models"},
    "cost_model": {"types", "cost_model"},
    "ilp": {"types", "cost_model", "ilp"},
    "dp_search": {"types", "cost_model", "ilp", "dp_search"},
    "runtime": {"types", "runtime"},
    "top": {"types", "trace", "models", "cost_model", "ilp", "dp_search", "runtime", "top"},
}


def _modules():
    for folder, pkg in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            yield path, ".".join([pkg] + parts)


MODULES = dict((module, path) for path, module in _modules())


def _layer(module: str) -> str | None:
    """The layer of a meshplan module (None: not ours, or not in the table)."""
    if module != "meshplan" and not module.startswith("meshplan."):
        return None
    rest = module[len("meshplan."):] if module != "meshplan" else ""
    head = rest.split(".")[0]
    if head in FOLDER_LAYER:
        return FOLDER_LAYER[head]
    return LAYER_OF.get(rest, LAYER_OF.get(head, "unlisted"))


def _imports(path: pathlib.Path, module: str):
    """The meshplan modules ``module`` imports (``from X import name`` counts
    X.name when that is a module)."""
    tree = ast.parse(path.read_text())
    pkg = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in _walk_runtime(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            subs = [f"{name}.{a.name}" for a in node.names if f"{name}.{a.name}" in MODULES]
            if len(subs) < len(node.names):     # (names from the module itself)
                yield name
            yield from subs


def _walk_runtime(tree: ast.AST):
    """The nodes of ``tree`` outside ``if TYPE_CHECKING:`` blocks (annotations only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve(name: str) -> str | None:
    """The module file an import name stands for (its longest known prefix)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def test_every_module_has_a_layer():
    unlisted = [m for m in MODULES if _layer(m) == "unlisted"]
    assert not unlisted, f"give these modules a layer in LAYER_OF: {unlisted}"


def test_layering():
    problems = []
    for module, path in MODULES.items():
        own = _layer(module)
        for imp in _imports(path, module):
            other = _layer(imp)
            if other is None or other == "unlisted":
                continue
            if other not in ALLOWED[own]:
                problems.append(f"{path.relative_to(ROOT)} ({own}) imports {imp} ({other})")
    assert not problems, "\n".join(problems)


def test_no_import_cycles():
    edges = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for imp in _imports(path, module):
            target = _resolve(imp)
            # (a package's __init__ re-exporting its submodules is not a cycle)
            if target and target != module and not module.startswith(target + "."):
                edges[module].add(target)
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack)
        stack.pop()
        state[m] = "done"
    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_layering_check_can_fail(tmp_path):
    # a runtime module importing the tracer, and a pair importing each other
    assert _layer("meshplan.runtime.driver") == "runtime"
    assert "trace" not in ALLOWED[_layer("meshplan.runtime.driver")]
    assert _layer("meshplan.trace") == "trace"
    assert _layer("meshplan.something_new") == "unlisted"
    bad = tmp_path / "bad.py"
    bad.write_text("from meshplan.trace import trace\nfrom ..dp_search import plan_pipeline\n")
    got = set(_imports(bad, "meshplan.runtime.bad"))
    assert got == {"meshplan.trace", "meshplan.dp_search"}
    assert {_layer(m) for m in got} == {"trace", "dp_search"}


def test_no_generic_top_level_packages_installed():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"meshplan" = "planner"' in text
    # the installed packages are all meshplan.*, whatever the list's layout
    start = text.index("packages = [")
    listed = text[start:text.index("]", start)]
    names = [n.strip().strip('"') for n in listed[len("packages = ["):].split(",") if n.strip()]
    assert names and all(n == "meshplan" or n.startswith("meshplan.") for n in names), names
    # Outside the source tree, only meshplan is importable from this checkout.
    import subprocess, sys, tempfile
    code = ("import importlib.util as u, json; print(json.dumps({n: str(getattr(u.find_spec(n), 'origin', None)) "
            "for n in ['runtime', 'ilp', 'dp_search', 'cost_model', 'planner', 'meshplan.ilp']}))")
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run([sys.executable, "-c", code], cwd=d, capture_output=True, text=True, check=True)
    import json
    origins = json.loads(out.stdout)
    for generic in ("runtime", "ilp", "dp_search", "cost_model", "planner"):
        assert ROOT.as_posix() not in origins[generic], (generic, origins[generic])
    assert origins["meshplan.ilp"].startswith((ROOT / "ilp").as_posix())


# The runtime reads the planner's data types only: it never traces (the
# planner hands it a meshplan.traced.TracedStep) and knows no planning pass.
# what runtime/ may import from meshplan besides its own modules
RUNTIME_ALLOWED = {"meshplan.plan", "meshplan.graph", "meshplan.traced", "meshplan.schedule",
           "meshplan.errors", "meshplan.cluster",
           # meshes and specs of a plan: the runtime and Plan.shardings share them
           "meshplan.shardings", "meshplan.specs",
           # whether a move gathers the tensor whole: priced and run the same way
           "meshplan.layout_moves",
           # what a selective stage replays: defined once for planner and runtime
           "meshplan.recompute",
           # which gradient sums run once a step: the same for planner and runtime
           "meshplan.contributions"}


def _meshplan_imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.lineno, node.module
        elif isinstance(node, ast.ImportFrom) and node.level > 1:
            yield node.lineno, "meshplan." + (node.module or "")


def test_runtime_imports_only_data_types():
    problems = []
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        for line, module in _meshplan_imports(path):
            if module.startswith("meshplan") and not module.startswith("meshplan.runtime") \
                    and module not in RUNTIME_ALLOWED:
                problems.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not problems, "\n".join(problems)


def test_runtime_has_no_global_state_statements():
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        tree = ast.parse(path.read_text())
        assert not any(isinstance(n, ast.Global) for n in ast.walk(tree)), path
