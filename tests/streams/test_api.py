"""The package's shape: its public API is documented, and it respects the layer rule."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import mstar_async.streams as streams

ALLOWED_OURS = {"mstar_async.errors", "mstar_async.policies"}
ALLOWED_THIRD_PARTY = {"anyio", "torch"}


def test_every_public_item_has_a_docstring() -> None:
    for name in streams.__all__:
        obj = getattr(streams, name)
        assert inspect.getdoc(obj), f"{name} has no docstring"
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_") or not (callable(member) or isinstance(member, property)):
                    continue
                assert inspect.getdoc(member), f"{name}.{attr} has no docstring"


def test_streams_imports_only_what_the_layer_rule_allows() -> None:
    package_dir = Path(streams.__file__).parent
    for path in sorted(package_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:  # relative: inside mstar_async.streams
                    continue
                modules = [node.module or ""]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top == "mstar_async":
                    assert any(
                        module == ok or module.startswith(ok + ".") for ok in ALLOWED_OURS
                    ), f"{path.name} imports {module}"
                elif top in ALLOWED_THIRD_PARTY or top == "__future__":
                    continue
                else:
                    assert top in _stdlib(), f"{path.name} imports {module}"


def _stdlib() -> frozenset[str]:
    import sys

    return frozenset(sys.stdlib_module_names)
