"""The layering the README's architecture section promises, read from the import graph:
kvpool imports nothing of radixkv; the service side never imports the replay tool or the CLI;
the client side and the engine integrations load nothing of the service, the server or the
index; the package never imports bench/."""

from __future__ import annotations

import argparse
import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def from_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module a `from ... import` in `package` reads."""
    if not node.level:
        return node.module or ""
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at top level or inside functions (absolute names)."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = from_module(node, package)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def modules(folder: str) -> list[Path]:
    return sorted(p for p in (REPO / folder).rglob("*.py") if "v1" not in p.parts)


def within(name: str, forbidden: tuple[str, ...]) -> bool:
    """`name` is one of the `forbidden` modules or inside one."""
    return any(name == f or name.startswith(f + ".") for f in forbidden)


def offenders(folder: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in modules(folder):
        bad = sorted(n for n in imports_of(path) if within(n, forbidden))
        if bad:
            found[str(path.relative_to(REPO))] = bad
    return found


def test_kvpool_imports_nothing_of_radixkv() -> None:
    assert offenders("kvpool", ("radixkv", "bench")) == {}


@pytest.mark.parametrize("folder", ["radixkv/index", "radixkv/server", "radixkv/cluster"])
def test_service_side_never_imports_the_tools(folder: str) -> None:
    assert offenders(folder, ("radixkv.replay", "radixkv.cli", "bench")) == {}


def test_the_replay_tool_never_imports_the_cli() -> None:
    """The `radixkv replay` command lives in radixkv/cli/commands/replay.py, above the tool."""
    assert offenders("radixkv/replay", ("radixkv.cli",)) == {}


def test_service_core_never_imports_the_tools() -> None:
    for folder in ("radixkv/service", "radixkv/protocol", "radixkv/client"):
        assert offenders(folder, ("radixkv.replay", "radixkv.cli", "bench")) == {}, folder


def test_the_index_does_no_io() -> None:
    assert offenders("radixkv/index", ("grpc", "kvpool", "radixkv.server", "socket")) == {}


def test_package_never_imports_bench() -> None:
    assert offenders("radixkv", ("bench", "_common")) == {}


def test_kvpool_imports_with_radixkv_absent() -> None:
    """Every kvpool module imports in a fresh interpreter where `radixkv` cannot be found."""
    names = [".".join(p.relative_to(REPO).with_suffix("").parts) for p in modules("kvpool")]
    code = f"""
import importlib, sys
class NoRadixKV:
    def find_spec(self, name, path=None, target=None):
        if name == "radixkv" or name.startswith("radixkv."):
            raise ModuleNotFoundError(f"radixkv is absent here ({{name}})")
sys.meta_path.insert(0, NoRadixKV())
for name in {[n.removesuffix(".__init__") for n in names]!r}:
    importlib.import_module(name)
print("imported", len(sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "imported" in out.stdout


# ---- the package import graph: acyclic, no private names across modules ---------------------

GRAPH_PACKAGES = ("radixkv", "kvpool")
GENERATED = (("radixkv", "v1"), ("radixkv", "etcd"))  # protoc's stubs

# Known offenders being fixed elsewhere; remove an entry when its fix lands. A cycle is allowed
# only as exactly these modules (a module joining it fails the test).
ALLOWED_CYCLES: set[frozenset[str]] = set()
ALLOWED_PRIVATE: dict[str, set[str]] = {}


def package_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every hand-written module of the packages."""
    found = {}
    for package in GRAPH_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[:2] in GENERATED:
                continue
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_edges(name: str, path: Path, known: dict[str, Path]) -> tuple[set[str], list[str]]:
    """The package modules `name` imports (top level, in functions, under TYPE_CHECKING), and
    the private names (`_x`, not `__x__`) it imports from another module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges: set[str] = set()
    private: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            module = from_module(node, package)
            for alias in node.names:
                if f"{module}.{alias.name}" in known:  # a submodule
                    edges.add(f"{module}.{alias.name}")
                elif module in known:
                    edges.add(module)
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.append(f"{module}.{alias.name}")
    edges.discard(name)
    return edges, private


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = {stack.pop()}
            while v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycles_finds_a_cycle_and_only_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_import_graph_is_acyclic() -> None:
    known = package_modules()
    graph = {name: import_edges(name, path, known)[0] for name, path in known.items()}
    assert {"kvpool.base", "radixkv.service.service", "radixkv.index.tree"} <= set(graph)
    assert [sorted(c) for c in cycles(graph) if c not in ALLOWED_CYCLES] == []


def test_no_private_name_is_imported_across_modules() -> None:
    known = package_modules()
    found = {}
    for name, path in known.items():
        private = set(import_edges(name, path, known)[1]) - ALLOWED_PRIVATE.get(name, set())
        if private:
            found[name] = sorted(private)
    assert found == {}


# ---- layers by folder: a module imports only from its own layer or those below ------------

LAYERS = (  # bottom up
    ("kvpool",),
    ("radixkv.v1", "radixkv.etcd", "radixkv.protocol", "radixkv"),  # "radixkv": its __init__
    ("radixkv.client", "radixkv.index", "radixkv.table"),
    ("radixkv.service",),
    ("radixkv.disk",),
    ("radixkv.rpc",),
    ("radixkv.server",),
    ("radixkv.cluster",),
    ("radixkv.integrations", "radixkv.engines"),
    ("radixkv.replay", "radixkv.gateway"),
    ("radixkv.cli", "radixkv.__main__"),
)


def layer_of(module: str) -> int:
    """The layer of the longest LAYERS prefix that holds `module`."""
    best, length = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > length:
                best, length = i, len(p)
    assert best >= 0, f"{module} is in no layer: add its folder to LAYERS"
    return best


def test_layer_of_takes_the_longest_prefix() -> None:
    assert layer_of("radixkv.service.events") == 3 and layer_of("radixkv.rpc.etcd") == 5
    assert layer_of("radixkv.protocol.wire") == 1 and layer_of("kvpool.base") == 0


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    known = package_modules()
    upward = sorted(f"{name} -> {e}" for name, path in known.items()
                    for e in import_edges(name, path, known)[0]
                    if layer_of(e) > layer_of(name))
    assert upward == []


# ---- no upward callbacks: the core's parts return what happened, the service acts on it ------

CALLBACK_FREE = ("radixkv/service/tier.py", "radixkv/service/leases.py",
                 "radixkv/service/allocator.py", "radixkv/service/kinds.py",
                 "radixkv/service/keyed.py", "radixkv/service/namespaces.py", "radixkv/disk")
CALLBACK_NAMES = ("Callable",)  # a parameter typed with one is handed a callback
ALLOWED_CALLBACKS = {  # may only shrink
    "clock",  # an injected clock, not a call back into the service
}


def test_the_service_core_hands_its_parts_no_callbacks() -> None:
    found = []
    for rel, path in hand_written().items():
        if not rel.startswith(CALLBACK_FREE):
            continue
        for name, fn in functions(path):
            a = fn.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs:
                text = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                key = f"{rel}:{name}:{arg.arg}"
                if any(c in text for c in CALLBACK_NAMES) and not (
                        arg.arg in ALLOWED_CALLBACKS or key in ALLOWED_CALLBACKS):
                    found.append(key)
    assert found == []


# what a client must not load: the service and its parts, the server, the index
SERVICE_SIDE = ("radixkv.service", "radixkv.server", "radixkv.index", "radixkv.disk",
                "radixkv.rpc", "radixkv.cluster")

# the engine-side modules, all but those that import the engine itself (vLLM, SGLang)
ENGINE_FREE_INTEGRATIONS = [
    ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
    for p in sorted((REPO / "radixkv" / "integrations").rglob("*.py"))
    if p.relative_to(REPO).as_posix() not in ("radixkv/integrations/vllm/connector.py",
                                              "radixkv/integrations/sglang/store.py")]


def loaded_by(*names: str) -> list[str]:
    """The modules importing `names` loads, in a fresh interpreter."""
    code = f"import importlib, sys\nfor n in {list(names)!r}: importlib.import_module(n)\n" \
           "print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.parametrize("module", ["radixkv.client", "radixkv.client.lease",
                                    "radixkv.protocol.wire", "radixkv.protocol.limits"])
def test_the_client_side_loads_no_service_server_or_index(module: str) -> None:
    """What an engine imports, in a fresh interpreter, loads none of the service side."""
    loaded = loaded_by(module)
    assert module in loaded
    assert [m for m in loaded if within(m, SERVICE_SIDE)] == []


def test_the_integrations_load_no_service_server_or_index() -> None:
    """The engine-side modules that import no engine, in a fresh interpreter, load none of the
    service side (the two that need vLLM or SGLang: the next test reads their imports)."""
    assert "radixkv.integrations.vllm.scheduler" in ENGINE_FREE_INTEGRATIONS
    loaded = loaded_by(*ENGINE_FREE_INTEGRATIONS)
    assert [m for m in loaded if within(m, SERVICE_SIDE)] == []


def test_no_integration_imports_the_service_side() -> None:
    """Every module under radixkv/integrations, with all the package modules it imports in
    turn (and their packages), read from the source: none is of the service side. This covers
    the vLLM connector and the SGLang store too, which need their engine to import."""
    known = package_modules()
    graph = {name: import_edges(name, path, known)[0] for name, path in known.items()}
    roots = [n for n in known if within(n, ("radixkv.integrations",))]
    assert {"radixkv.integrations.vllm.connector",
            "radixkv.integrations.sglang.store"} <= set(roots)
    found = {}
    for root in roots:
        seen: set[str] = set()
        todo = [root]
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                parts = name.split(".")
                todo += graph[name] | {".".join(parts[:i]) for i in range(1, len(parts))
                                       if ".".join(parts[:i]) in known}
        bad = sorted(n for n in seen if within(n, SERVICE_SIDE))
        if bad:
            found[root] = bad
    assert found == {}


def names_in(path: Path) -> set[str]:
    """Every name and attribute a file mentions."""
    tree = ast.parse(path.read_text())
    return ({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)})


@pytest.mark.parametrize("name", ["radixkv/service/service.py", "radixkv/server/servicer.py"])
def test_the_service_and_servicer_never_ask_which_kind(name: str) -> None:
    """Full attention and sliding window are two namespace kinds behind one contract
    (radixkv/service/kinds.py), chosen once: the service and the servicer name no window type."""
    window_types = {"WindowLeaseMatch", "WindowMatch", "WindowedRadixTree", "WindowNamespace"}
    assert names_in(REPO / name) & window_types == set()


def test_the_servicer_reaches_no_pool() -> None:
    """The servicer asks the service (epoch, pool handle, stats), never its pool."""
    assert "pool" not in names_in(REPO / "radixkv/server/servicer.py")


# ---- budgets: no hub regrows ---------------------------------------------------------------
# Today's offenders, with their size now: an entry may only shrink (the test fails when one
# grows, when a new offender appears, and when an entry no longer offends: then delete it).

MAX_MODULE_LINES = 400
MAX_CORE_LINES = 350  # radixkv/service/: the core stays small
MAX_FUNCTION_LINES = 60
MAX_PARAMETERS = 7  # beyond that, a dataclass
CORE = ("radixkv", "service")
LONG_MODULES: dict[str, int] = {}
LONG_FUNCTIONS: dict[str, int] = {
    "radixkv/cli/commands/replay.py:register": 84,
    "radixkv/cli/commands/serve.py:register": 107,
    "radixkv/index/integrity.py:check_tree": 64,
    "radixkv/index/tree.py:RadixTree.insert": 67,
    "radixkv/index/window_tree.py:WindowedRadixTree.insert": 62,
    "radixkv/replay/client.py:request": 69,
    "radixkv/replay/report.py:build_report": 63,
    "radixkv/replay/report.py:render_report": 75,
    "radixkv/replay/runner.py:_run": 112,
    "radixkv/replay/runner.py:run_replay": 101,
    "radixkv/replay/simulate.py:replay_tree": 76,
}
WIDE_FUNCTIONS: dict[str, int] = {
    "kvpool/factory.py:create_pool": 9,
    "kvpool/host.py:HostBlockPool.__init__": 8,
    "kvpool/jit.py:Kernel.__init__": 10,
    "radixkv/cli/commands/events.py:tail_events": 8,
    "radixkv/client/client.py:Client.insert": 8,
    "radixkv/client/lease.py:Calls.insert": 8,
    "radixkv/engines/attention.py:attention_forward": 10,
    "radixkv/engines/evaluate.py:evaluate": 8,
    "radixkv/engines/window_cache.py:build_cache": 8,
    "radixkv/integrations/vllm/driver.py:Driver.__init__": 8,
    "radixkv/integrations/vllm/worker.py:WorkerSide.__init__": 8,
    "radixkv/replay/client.py:request": 9,
    "radixkv/replay/jobs.py:feed": 8,
    "radixkv/replay/report.py:build_report": 8,
    "radixkv/replay/runner.py:run_replay": 24,
    "radixkv/replay/workload.py:generate_synthetic": 10,
    "radixkv/rpc/membership.py:make_info": 8,
    "radixkv/service/inserts.py:Inserts.insert": 8,
    "radixkv/service/service.py:KVService.allocate": 9,
}
SHARED_CLASS_NAMES: dict[str, int] = {
    "Counters": 2,
    "Lease": 2,
    "Strided": 2,
}
SHARED_BASENAMES: dict[str, int] = {
    "calc": 2,
    "chat": 2,
    "client": 2,
    "config": 2,
    "demo": 2,
    "errors": 2,
    "events": 2,
    "hints": 2,
    "index": 2,
    "layout": 2,
    "models": 2,
    "router": 2,
    "stats": 2,
    "tier": 2,
}


def hand_written() -> dict[str, Path]:
    return {str(p.relative_to(REPO)): p for p in package_modules().values()}


def over(found: dict[str, int], allowed: dict[str, int]) -> dict[str, str]:
    """What breaks a budget: new offenders, grown ones, and entries that no longer offend."""
    bad = {k: f"{v} (allowed {allowed.get(k, 'none')})" for k, v in found.items()
           if v > allowed.get(k, 0)}
    bad.update({k: "no longer over: delete its entry" for k in allowed if k not in found})
    return bad


def test_no_module_is_over_its_line_budget() -> None:
    found = {}
    for rel, path in hand_written().items():
        lines = len(path.read_text().splitlines())
        limit = MAX_CORE_LINES if Path(rel).parts[:2] == CORE else MAX_MODULE_LINES
        if lines > limit:
            found[rel] = lines
    assert over(found, LONG_MODULES) == {}


def functions(path: Path) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every function and method in a file."""
    out = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((f"{prefix}{child.name}", child))
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")

    walk(ast.parse(path.read_text()), "")
    return out


def test_no_function_is_over_its_length_or_parameter_budget() -> None:
    long, wide = {}, {}
    for rel, path in hand_written().items():
        for name, fn in functions(path):
            key = f"{rel}:{name}"
            lines = (fn.end_lineno or fn.lineno) - fn.lineno + 1
            a = fn.args
            params = len(a.posonlyargs + a.args + a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
            params -= bool(a.args and a.args[0].arg in ("self", "cls"))
            if lines > MAX_FUNCTION_LINES:
                long[key] = lines
            if params > MAX_PARAMETERS:
                wide[key] = params
    assert over(long, LONG_FUNCTIONS) == {}
    assert over(wide, WIDE_FUNCTIONS) == {}


def test_one_name_one_meaning() -> None:
    """No two classes of the packages share a name, no two modules a basename (but
    __init__)."""
    classes: dict[str, int] = {}
    bases: dict[str, int] = {}
    for rel, path in hand_written().items():
        name = Path(rel).stem
        if name != "__init__":
            bases[name] = bases.get(name, 0) + 1
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = classes.get(node.name, 0) + 1
    assert over({k: v for k, v in classes.items() if v > 1}, SHARED_CLASS_NAMES) == {}
    assert over({k: v for k, v in bases.items() if v > 1}, SHARED_BASENAMES) == {}


# ---- the CLI: one command, one file ------------------------------------------------------------

def test_each_command_is_one_module_that_main_discovers() -> None:
    """Every module in radixkv/cli/commands/ is one command of its name, listed in COMMANDS
    (the `--help` order), whose `register` adds its parser and binds its `run`."""
    from radixkv.cli import commands
    from radixkv.cli.main import build_parser

    files = sorted(p.stem for p in (REPO / "radixkv/cli/commands").glob("*.py")
                   if p.stem != "__init__")
    assert sorted(commands.COMMANDS) == files
    (sub,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == list(commands.COMMANDS)
    for name, parser in sub.choices.items():
        module = importlib.import_module(f"radixkv.cli.commands.{name}")
        assert parser.get_default("func") is module.run, name


def test_main_names_no_command() -> None:
    """A new command never needs an edit of radixkv/cli/main.py."""
    imported = imports_of(REPO / "radixkv" / "cli" / "main.py")
    assert sorted(n for n in imported if n.startswith("radixkv.cli.commands.")) == []


# Test folders that mirror a folder not under radixkv/ (the rest mirror radixkv/<folder>).
TEST_MIRRORS = {"pool": "kvpool", "benchmarks": "bench",
                "integrations/shared": "radixkv/integrations"}
REPO_WIDE_TESTS = {"test_structure.py", "test_docs.py"}  # about the whole repository


def test_tests_mirror_the_folders() -> None:
    """A test file sits in the folder of what it tests: tests/<f>/ for radixkv/<f>/ (or a
    TEST_MIRRORS folder); only the repository-wide tests sit in tests/ itself."""
    misplaced = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        folder = path.parent.relative_to(REPO / "tests").as_posix()
        if folder == ".":
            ok = path.name in REPO_WIDE_TESTS
        else:
            ok = (REPO / TEST_MIRRORS.get(folder, f"radixkv/{folder}")).is_dir()
        if not ok:
            misplaced.append(str(path.relative_to(REPO)))
    assert not misplaced, f"test files outside a mirrored folder: {misplaced}"
