"""The OCI and AWS adapters depend on the core contract only, and their SDKs stay lazy.

Read from the source (AST), so a new import anywhere in ``providers/oci/`` or ``providers/aws/`` is caught."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "providers"
ALLOWED = {"broker.core.model", "broker.core.provider", "broker.core.records", "broker.core.config", "broker.core.nodescripts",
           "broker.plan.catalog", "broker.providers", "broker.providers.declared",
           "broker.core.prose"}  # the one money formatter every message uses
SDKS = ("oci", "boto3", "botocore", "google")


def _is_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at module level) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("broker") and all(_is_module(f"{node.module}.{a.name}") for a in node.names):
                out += [(f"{node.module}.{a.name}", id(node) in top) for a in node.names]  # `from broker.plan import catalog`
            else:
                out.append((node.module, id(node) in top))
    return out


FILES = sorted((ROOT / "oci").glob("*.py")) + sorted((ROOT / "aws").glob("*.py")) + sorted((ROOT / "gcp").glob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_adapter_imports_only_the_contract_and_sdks_lazily(path: Path):
    own = f"broker.providers.{path.parent.name}"
    for mod, top_level in imports(path):
        if mod.startswith("broker"):
            assert mod in ALLOWED or mod == own or mod.startswith(own + "."), f"{path.name} imports {mod}"
        if mod.split(".")[0] in SDKS:
            assert not top_level, f"{path.name} imports {mod} at module level"


def test_both_packages_are_split_into_client_and_verbs():
    for pkg, client in (("oci", "sdk.py"), ("aws", "api.py")):
        names = {p.name for p in (ROOT / pkg).glob("*.py")}
        assert {"__init__.py", client, "offers.py", "network.py", "lifecycle.py", "quota_requests.py"} <= names
        assert not (ROOT / f"{pkg}.py").exists()
