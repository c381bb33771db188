"""The package's import graph, read with ast (nothing is imported): dependencies point one way.

The rules (docs of the layout: ARCHITECTURE's "Dependencies point one way"):
- the package never imports a benchmark (top-level perf/) or a test module;
- a fast path in track_1_short/perf never imports the optimizer or the model that dispatches to it, only the
  lower-level definitions both share (ALLOWED_FROM_PERF);
- no import cycle among the package's modules, counting imports inside functions too (a lazy import still
  ties the two modules together).
Each rule is also run on a small planted tree, so the checks are known to fail when they should.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "track_1_short"
# The definitions a fast path may read from optim/ or model/: records and layouts, no dispatch.
ALLOWED_FROM_PERF = {"optim.hyper", "optim.bank_layout"}  # under the package
# Top-level names of the benchmarks and tests: the package must import none of them.
FORBIDDEN_ROOTS = {"perf", "tests"} | {p.stem for p in (ROOT / "perf").glob("*.py")}


def module_files(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """module name -> file, for every .py file of ``package`` under ``root``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported_names(path: Path, module: str, is_package: bool) -> set[str]:
    """Every module name ``path`` imports, at any depth of its code; ``from a import b`` gives a.b and a.
    Imports under ``if TYPE_CHECKING:`` never run, so they are no dependency (annotations only)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and getattr(test, "id", getattr(test, "attr", "")) == "TYPE_CHECKING":
            node.body = []
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: Path, package: str = PACKAGE) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges among the package's own modules, every imported name) per module of the package."""
    files = module_files(root, package)
    edges, raw = {}, {}
    for module, path in files.items():
        names = imported_names(path, module, path.name == "__init__.py")
        raw[module] = names
        # A name that is a module of the package is an edge; `from pkg import attr` falls back to pkg, whose
        # __init__ is only a parent and not a dependency worth a cycle.
        edges[module] = {n for n in names if n in files and n != module and files[n].name != "__init__.py"}
    return edges, raw


def benchmark_or_test_imports(raw: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} imports {name}"
        for module, names in raw.items()
        for name in names
        if name.split(".")[0] in FORBIDDEN_ROOTS
    )


def fast_path_back_imports(edges: dict[str, set[str]], package: str = PACKAGE) -> list[str]:
    perf = f"{package}.perf"
    back = (f"{package}.optim", f"{package}.model")
    allowed = {f"{package}.{name}" for name in ALLOWED_FROM_PERF}
    return sorted(
        f"{module} imports {target}"
        for module, targets in edges.items()
        if module == perf or module.startswith(perf + ".")
        for target in targets
        if target.startswith(back) and target not in allowed
    )


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


# ---- the package ----------------------------------------------------------------------------------------


def test_the_package_imports_no_benchmark_or_test_module():
    _, raw = import_graph(ROOT)
    assert benchmark_or_test_imports(raw) == []


def test_fast_paths_import_only_the_shared_definitions_of_the_optimizer_and_the_model():
    edges, _ = import_graph(ROOT)
    assert fast_path_back_imports(edges) == []
    modules = module_files(ROOT)
    assert all(f"{PACKAGE}.{name}" in modules for name in ALLOWED_FROM_PERF)  # the allowance names modules


def test_the_package_has_no_import_cycle():
    edges, _ = import_graph(ROOT)
    assert cycles(edges) == []


def test_the_graph_sees_the_package_and_its_lazy_imports():
    # A check that found nothing because it read nothing would pass: the optimizer's lazy import of its fast
    # path (inside AnvilAndAdam.__init__) is an edge.
    edges, _ = import_graph(ROOT)
    assert len(edges) > 30
    assert "track_1_short.perf.replicated_adam" in edges["track_1_short.optim.anvil"]


# ---- the checks fail where they should: a planted tree --------------------------------------------------


@pytest.fixture
def planted(tmp_path):
    def write(files: dict[str, str]) -> Path:
        for rel, text in files.items():
            path = tmp_path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return tmp_path

    base = {
        "pkg/__init__.py": "",
        "pkg/optim/__init__.py": "",
        "pkg/optim/hyper.py": "",
        "pkg/optim/anvil.py": "def build():\n    from pkg.perf import fast\n",
        "pkg/perf/__init__.py": "",
        "pkg/perf/fast.py": "from pkg.optim.hyper import X\n",
        "pkg/data.py": "",
        "pkg/synthetic.py": "from pkg import data\n",
    }
    return lambda extra: write({**base, **extra})


def test_a_planted_back_import_from_a_fast_path_is_found(planted):
    root = planted({"pkg/perf/fast.py": "from pkg.optim.hyper import X\nfrom pkg.optim import anvil\n"})
    edges, _ = import_graph(root, "pkg")
    assert fast_path_back_imports(edges, "pkg") == ["pkg.perf.fast imports pkg.optim.anvil"]
    assert cycles(edges) == [["pkg.optim.anvil", "pkg.perf.fast"]]


def test_a_planted_lazy_cycle_is_found(planted):
    root = planted({"pkg/data.py": "def paths():\n    from pkg import synthetic\n"})
    edges, _ = import_graph(root, "pkg")
    assert cycles(edges) == [["pkg.data", "pkg.synthetic"]]


def test_a_planted_benchmark_or_test_import_is_found(planted):
    root = planted({"pkg/data.py": "import bench_meta\nfrom tests.optim import fake_model\n"})
    _, raw = import_graph(root, "pkg")
    found = benchmark_or_test_imports(raw)
    assert "pkg.data imports bench_meta" in found and "pkg.data imports tests.optim" in found
