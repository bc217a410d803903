"""Imports run one way: the layers of docs/architecture.md, read from the source (AST), no cycles.

Every ``import`` and ``from ... import`` in `router/`, `autoscaler/`, `warmup/`, `fleet/`,
`loadtests/` and `tests/` counts, wherever it sits (module level, inside a function, under
``if TYPE_CHECKING:``): a type-only import is a dependency a reader follows too. The test
fails on:

- an import of a higher layer (`LAYERS`, bottom first): a module may import its own package and
  any lower layer, never a layer above it, nor another package of its own layer;
- a cycle between modules (any length);
- a product module importing `fleet.testing`, `tests` or `loadtests`; `loadtests` importing
  `tests`.

The rules are written down in docs/architecture.md; change both together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("router", "autoscaler", "warmup", "fleet", "loadtests", "tests")

LAYERS: tuple[tuple[str, ...], ...] = (
    ("fleet.base",),                                # the spec base, the registry helper, the name patterns
    ("router.protocol",),                           # the data plane, room by room: OpenAI errors, SSE, usage, JSON
    ("router.stats",),                              # windowed statistics, request log, Prometheus metrics
    ("router.kv",),                                 # KV events, exact and approximate indexes, tokenizer
    ("router.pools",),                              # endpoints, pools, policies, split, outliers, admission
    ("router.signals", "router.request"),           # engine load, KV streams; the request path
    ("router.picker",),                             # the endpoint picker: its wire, state, server and client
    ("router.http",),                               # the ASGI app, admin API, uvicorn
    ("router",),                                    # router/__init__.py, router/__main__.py
    ("autoscaler", "warmup"),                       # pure scaling policies; the warm-up gate
    ("fleet.enginesim",),                           # the engine SIMULATOR (its own process)
    ("fleet.engines",),                             # engine kinds, the spec's engine section, vllm serve, the tiny model
    ("fleet.sources", "fleet.rollout.spec", "fleet.pricing"),   # model sources; the rollout section of the spec; GPU prices
    ("fleet.spec",),                                # the InferenceDeployment document
    ("fleet.inventory",),                           # nodes, GPUs, MIG, NVLink domains
    ("fleet.models",),                              # model facts and the memory a replica needs
    ("fleet.placement", "fleet.rollout", "fleet.agent"),   # pure placement and rollout policies; the node agent
    ("fleet.controller",),                          # the reconcile loop and its collaborators
    ("fleet.observability",),                       # dashboards, rules, discovery, fleet top
    ("fleet.control_plane",),                       # the one assembly of controller, autoscaler and metrics
    ("fleet.local", "fleet.k8s", "fleet.tracesim"),  # the two runtimes; the trace simulator
    ("fleet.cli",),                                 # the command line
    ("fleet",),                                     # fleet/__init__.py, fleet/__main__.py
    ("fleet.testing",),                             # stand-ins for tests and benchmarks
    ("loadtests",),                                 # benchmarks: the product and fleet.testing
    ("tests",),                                     # everything
)


def _modules() -> dict[str, Path]:
    mods = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The modules of this repository that ``name`` imports (a name imported from a package that
    is not a module of it counts as the package)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module for a in node.names]
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, the prefix that placed it): the longest prefix in `LAYERS` that matches."""
    best: tuple[int, str] | None = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > len(best[1])):
                best = (i, p)
    assert best is not None, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return best


def test_every_module_has_a_layer() -> None:
    for name in MODULES:
        layer_of(name)


def test_imports_go_down_the_layers() -> None:
    wrong = []
    for name, deps in sorted(GRAPH.items()):
        mine, my_prefix = layer_of(name)
        for dep in sorted(deps):
            theirs, their_prefix = layer_of(dep)
            if theirs > mine or (theirs == mine and their_prefix != my_prefix):
                wrong.append(f"{name} (layer {mine}: {my_prefix}) imports {dep} (layer {theirs}: {their_prefix})")
    assert not wrong, "imports against the layers (docs/architecture.md):\n" + "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("root", ["router", "autoscaler", "warmup", "fleet"])
def test_the_product_imports_no_test_code(root: str) -> None:
    bad = sorted(f"{name} imports {dep}" for name, deps in GRAPH.items()
                 if (name == root or name.startswith(root + ".")) and not name.startswith("fleet.testing")
                 for dep in deps if dep.split(".")[0] in ("tests", "loadtests") or dep.startswith("fleet.testing"))  # fmt: skip
    assert not bad, "\n".join(bad)


def test_loadtests_import_no_tests() -> None:
    bad = sorted(f"{name} imports {dep}" for name, deps in GRAPH.items() if name.startswith("loadtests")
                 for dep in deps if dep.split(".")[0] == "tests")  # fmt: skip
    assert not bad, "\n".join(bad)


def test_the_leaves_import_nothing_of_fleet_but_its_base() -> None:
    bad = sorted(f"{name} imports {dep}" for name, deps in GRAPH.items() if name.split(".")[0] in
                 ("router", "autoscaler", "warmup") for dep in deps
                 if dep.split(".")[0] == "fleet" and not (dep == "fleet.base" or dep.startswith("fleet.base.")))  # fmt: skip
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_cycle_and_an_upward_import() -> None:
    """The rules bite: a made-up cycle is found, and a made-up upward import is against the layers."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("router.pools.pool")[0] < layer_of("fleet.controller.reconcile")[0]
    assert layer_of("router.kv.exact_index")[0] < layer_of("router.pools.policies")[0] < layer_of("router.http.app")[0]
    assert layer_of("fleet.rollout.spec")[0] < layer_of("fleet.spec")[0] < layer_of("fleet.rollout.machine")[0]
    assert "fleet.spec" in GRAPH["fleet.controller.reconcile"]    # the graph is read from the source
