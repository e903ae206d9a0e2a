"""The layering the README's architecture section promises, read from the import graph:
gpu_pool imports nothing of radixkv; the service side never imports the replay tool or the CLI;
the package never imports bench/."""

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


def offenders(folder: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in modules(folder):
        bad = sorted(n for n in imports_of(path)
                     if any(n == f or n.startswith(f + ".") for f in forbidden))
        if bad:
            found[str(path.relative_to(REPO))] = bad
    return found


def test_gpu_pool_imports_nothing_of_radixkv() -> None:
    assert offenders("gpu_pool", ("radixkv", "bench")) == {}


@pytest.mark.parametrize("folder", ["radixkv/index", "radixkv/server", "radixkv/cluster"])
def test_service_side_never_imports_the_tools(folder: str) -> None:
    assert offenders(folder, ("radixkv.replay", "radixkv.cli", "bench")) == {}


def test_service_core_never_imports_the_tools() -> None:
    for name in ("service.py", "events.py", "client.py", "tokens.py", "errors.py"):
        bad = sorted(n for n in imports_of(REPO / "radixkv" / name)
                     if n.startswith(("radixkv.replay", "radixkv.cli", "bench")))
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
