"""The layering the README's architecture section promises, read from the import graph:
gpu_pool imports nothing of radixkv; the service side never imports the replay tool or the CLI;
the client side loads nothing of the service, the server or the index; the package never imports
bench/."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at top level or inside functions (absolute names)."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
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


def test_gpu_pool_imports_nothing_of_radixkv() -> None:
    assert offenders("gpu_pool", ("radixkv", "bench")) == {}


@pytest.mark.parametrize("folder", ["radixkv/index", "radixkv/server", "radixkv/cluster"])
def test_service_side_never_imports_the_tools(folder: str) -> None:
    assert offenders(folder, ("radixkv.replay", "radixkv.cli", "bench")) == {}


def test_service_core_never_imports_the_tools() -> None:
    for name in ("service.py", "events.py", "client.py", "tokens.py", "errors.py", "lease.py",
                 "types.py", "wire.py", "env.py"):
        bad = sorted(n for n in imports_of(REPO / "radixkv" / name)
                     if within(n, ("radixkv.replay", "radixkv.cli", "bench")))
        assert bad == [], name


def test_the_index_does_no_io() -> None:
    assert offenders("radixkv/index", ("grpc", "gpu_pool", "radixkv.server", "socket")) == {}


def test_package_never_imports_bench() -> None:
    assert offenders("radixkv", ("bench", "_common")) == {}


def test_gpu_pool_imports_with_radixkv_absent() -> None:
    """Every gpu_pool module imports in a fresh interpreter where `radixkv` cannot be found."""
    names = [".".join(p.relative_to(REPO).with_suffix("").parts) for p in modules("gpu_pool")]
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


# what a client must not load: the service and its parts, the server, the index
SERVICE_SIDE = ("radixkv.service", "radixkv.server", "radixkv.index", "radixkv.events")


@pytest.mark.parametrize("module", ["radixkv.client", "radixkv.lease", "radixkv.wire"])
def test_the_client_side_loads_no_service_server_or_index(module: str) -> None:
    """What an engine imports, in a fresh interpreter, loads none of the service side."""
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split()
    assert module in loaded
    assert [m for m in loaded if within(m, SERVICE_SIDE)] == []


def names_in(path: Path) -> set[str]:
    """Every name and attribute a file mentions."""
    tree = ast.parse(path.read_text())
    return ({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)})


@pytest.mark.parametrize("name", ["radixkv/service.py", "radixkv/server/servicer.py"])
def test_the_service_and_servicer_never_ask_which_kind(name: str) -> None:
    """Full attention and sliding window are two namespace kinds behind one contract
    (radixkv/kinds.py), chosen once: the service and the servicer name no window type."""
    window_types = {"WindowLeaseMatch", "WindowMatch", "WindowedRadixTree", "WindowNamespace"}
    assert names_in(REPO / name) & window_types == set()


def test_the_servicer_reaches_no_pool() -> None:
    """The servicer asks the service (epoch, pool handle, stats), never its pool."""
    assert "pool" not in names_in(REPO / "radixkv/server/servicer.py")
