"""The runtime reads the planner's data types only: it never traces (the
planner hands it a meshplan.traced.TracedStep) and knows no planning pass."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# what runtime/ may import from meshplan besides its own modules
ALLOWED = {"meshplan.plan", "meshplan.graph", "meshplan.traced", "meshplan.schedule",
           "meshplan.errors", "meshplan.cluster"}


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
                    and module not in ALLOWED:
                problems.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not problems, "\n".join(problems)


def test_runtime_has_no_global_state_statements():
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        tree = ast.parse(path.read_text())
        assert not any(isinstance(n, ast.Global) for n in ast.walk(tree)), path
