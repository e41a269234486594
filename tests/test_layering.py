"""The import layering of DESIGN.md, checked on the source files."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"planner": "meshplan", "cost_model": "meshplan.cost_model", "ilp": "meshplan.ilp",
           "dp_search": "meshplan.dp_search", "runtime": "meshplan.runtime"}
# Modules of planner that sit on top of everything (public API, CLI, verification).
TOP = {"__init__", "api", "cli", "verify", "methods_impl", "calibrate", "checkpoint"}
ALLOWED = {
    "core": {"core"},
    "cost_model": {"core", "cost_model"},
    "ilp": {"core", "cost_model", "ilp"},
    "dp_search": {"core", "cost_model", "ilp", "dp_search"},
    "runtime": {"core", "runtime"},
    "top": {"core", "cost_model", "ilp", "dp_search", "runtime", "top"},
}


def _component(module: str) -> str | None:
    if module == "meshplan" or not module.startswith("meshplan"):
        return "core" if module == "meshplan" else None
    parts = module.split(".")
    if parts[1] in ("cost_model", "ilp", "dp_search", "runtime"):
        return parts[1]
    return "top" if parts[1] in TOP else "core"


def _imports(path: pathlib.Path, module: str):
    tree = ast.parse(path.read_text())
    pkg = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:
                    for a in node.names:
                        yield f"{name}.{a.name}"
                    continue
                yield name
            elif node.module:
                yield node.module


def _modules():
    for folder, pkg in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            yield path, ".".join([pkg] + parts)


def test_layering():
    problems = []
    for path, module in _modules():
        own = _component(module)
        if path.parent == ROOT / "planner" and path.stem in TOP:
            own = "top"
        for imp in _imports(path, module):
            other = _component(imp)
            if other is None:
                continue
            if other not in ALLOWED[own]:
                problems.append(f"{path.relative_to(ROOT)} ({own}) imports {imp} ({other})")
    assert not problems, "\n".join(problems)


def test_no_generic_top_level_packages_installed():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"meshplan" = "planner"' in text
    for generic in ("runtime", "ilp", "planner", "cost_model", "dp_search"):
        assert f'packages = ["{generic}"' not in text
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
