"""The package's layout in numbers, from the files alone (no import runs), so a restructuring
states its before and after reproducibly:

* engine modules: ``.py`` files under ``dflash_batch/engine`` (``__init__.py`` not counted);
* import circles: groups of engine modules that import each other round (strongly connected
  parts of the import graph, any import in the file, a function's too);
* upward arrows: imports from a lower floor of the engine to a higher one (``ops`` < ``models`` <
  the decoding loop in ``engine/`` itself);
* environment reads: ``os.environ`` / ``os.getenv`` in library code (``dflash_batch``) outside
  the one table module that reads for everyone (``TABLE``: its own lines are counted apart), and
  the files holding them;
* kernel source lines inside ``.py`` files: lines of string constants that read as C, CUDA or
  Metal source (most of their lines end in ``;``, ``{`` or ``}``);
* lines over 100 characters, in ``dflash_batch``;
* lines quoting a timing, a machine or a date there (``FIGURE``; f-strings not counted);
* benchmark imports of engine internals: (benchmark file, engine module other than the package
  itself) pairs, and names imported that start with ``_``.

    python -m benchmarks.layout_metrics                  # this checkout
    python -m benchmarks.layout_metrics --root DIR       # another (e.g. a `git archive` of main)
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ("ops", "models")  # the engine's lower floors, lowest first; the rest is the loop
LONG = 100
ENV_READ = re.compile(r"os\.environ|os\.getenv|getenv\(")
TABLE = "dflash_batch/environment.py"  # the environment's one accessor: not a scattered read
# a timing, a machine or a date in a line of text (messages' format strings excepted)
FIGURE = re.compile(
    r"\d[\d.,]* ?(ms|us|µs|ns|s)\b|\bH[12]00\b|\bA100\b|\b20\d\d-\d\d-\d\d\b|\d+x (faster|slower)"
    r"|\d\.\d+x\b|\b\d-core\b|\bVM\b"
)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path, path: Path, known: Set[str]) -> Iterator[str]:
    """The modules ``path`` imports (relative imports resolved): ``from x import y`` imports x.y
    where that is a module of ``known``, else x itself."""
    package = module_name(root, path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            stem = ".".join(base + ([node.module] if node.module else []))
            submodules = [
                f"{stem}.{alias.name}" for alias in node.names if f"{stem}.{alias.name}" in known
            ]
            if len(submodules) < len(node.names):  # a name from the module itself
                yield stem
            yield from submodules


def engine_graph(root: Path) -> Dict[str, Set[str]]:
    engine = root / "dflash_batch" / "engine"
    modules = {module_name(root, p): p for p in engine.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in imports(root, path, set(modules)) if m in modules and m != name}
    return graph


def floor(module: str) -> int:
    parts = module.split(".")
    if len(parts) > 2 and parts[2] in FLOORS:
        return FLOORS.index(parts[2])
    return len(FLOORS)


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def kernel_lines(path: Path) -> int:
    """Lines of string constants in ``path`` that read as C, CUDA or Metal source."""
    total = 0
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            lines = [ln.strip() for ln in node.value.splitlines() if ln.strip()]
            code = [ln for ln in lines if ln.endswith((";", "{", "}"))]
            if len(lines) >= 3 and len(code) >= len(lines) / 2:
                total += len(node.value.splitlines())
    return total


def measure(root: Path) -> Dict[str, object]:
    package = root / "dflash_batch"
    graph = engine_graph(root)
    engine_modules = [
        m
        for m in graph
        if not m.endswith("__init__") and (root / (m.replace(".", "/") + ".py")).exists()
    ]
    upward = sorted((a, b) for a, targets in graph.items() for b in targets if floor(b) > floor(a))
    env: List[Tuple[str, int]] = []
    long_lines = kernel = figures = table_reads = 0
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        reads = sum(1 for line in text.splitlines() if ENV_READ.search(line))
        if path.relative_to(root).as_posix() == TABLE:
            table_reads = reads
        elif reads:
            env.append((str(path.relative_to(root)), reads))
        long_lines += sum(1 for line in text.splitlines() if len(line) > LONG)
        figures += sum(1 for line in text.splitlines() if FIGURE.search(line) and 'f"' not in line)
        kernel += kernel_lines(path)
    internal, private = set(), set()
    for path in sorted((root / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "dflash_batch.engine."
            ):
                internal.add((path.name, node.module))
                private |= {
                    (path.name, f"{node.module}.{a.name}")
                    for a in node.names
                    if a.name.startswith("_")
                }
            elif isinstance(node, ast.Import):
                internal |= {
                    (path.name, a.name)
                    for a in node.names
                    if a.name.startswith("dflash_batch.engine.")
                }
    return {
        "engine_modules": len(engine_modules),
        "import_circles": circles(graph),
        "upward_arrows": [f"{a} -> {b}" for a, b in upward],
        "environment_reads": sum(n for _, n in env),
        "environment_read_files": dict(env),
        "environment_table_lines": table_reads,
        "kernel_source_lines_in_py": kernel,
        "lines_over_100": long_lines,
        "figure_lines": figures,
        "benchmark_engine_internal_imports": len(internal),
        "benchmark_private_imports": sorted(f"{a}: {b}" for a, b in private),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(ROOT), help="the checkout to measure (default: this one)")
    args = ap.parse_args(argv)
    print(json.dumps(measure(Path(args.root)), indent=2))


if __name__ == "__main__":
    main()
