"""Provider capabilities: each provider declares them once (one Declaration in providers/declared.py, grouped, with
the reason a feature is absent), the registry and the adapter class read that same object, no class body or second
declaration writes one again, the core's provider lists are derived from them (without importing any adapter), and
the cloud-name string constants still left in the core are exactly the ones listed here."""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import broker.providers as registry
from broker.core import capabilities as capmod
from broker.core.capabilities import CAPABILITIES, FEATURES, GROUPS, Declaration
from broker.plan import pricing
from broker.core.provider import Provider
from broker.providers.declared import DECLARED

REPO = Path(__file__).resolve().parents[2]
NAMES = list(registry.REGISTRY)
TOPOLOGIES = {"simulated", "multi-node", "local", "slurm", "hybrid"}
#: the files allowed to write capability values: the schema (defaults) and the one declaration per provider
SCHEMA = REPO / "broker" / "core" / "capabilities.py"
DECLARATIONS = REPO / "providers" / "declared.py"


def test_every_capability_is_in_one_group_documented_and_typed_on_the_contract():
    source = SCHEMA.read_text().splitlines()
    for group in GROUPS.values():
        start = next(i for i, ln in enumerate(source) if ln.startswith(f"class {group.__name__}("))
        assert group.FIELDS
        for f in group.FIELDS:
            at = next(i for i, ln in enumerate(source) if i > start and ln.strip().startswith(f"{f}:"))
            assert source[at - 1].strip().startswith("#:"), f"{group.__name__}.{f} has no #: doc comment"
    assert len(set(CAPABILITIES)) == len(CAPABILITIES)
    assert set(Provider.__annotations__) >= set(CAPABILITIES)  # the flat attributes the core reads, typed
    assert "live_prices_source" in CAPABILITIES  # read by broker catalog refresh: declared like the rest


@pytest.mark.parametrize("name", NAMES)
def test_the_registry_and_the_class_read_the_same_declaration(name):
    cls = registry.provider_class(name)
    assert cls.caps is DECLARED[name] is registry.capabilities(name).declaration
    assert registry.capabilities(name).as_dict() == {c: getattr(cls, c) for c in CAPABILITIES}
    assert cls.name == name == DECLARED[name].name and registry.REGISTRY[name] == DECLARED[name].adapter


# ---------------------------------------------------------------------- written once: the source holds it
def _assigned_names(body: list[ast.stmt]) -> list[tuple[str, int]]:
    out = []
    for st in body:
        targets = (st.targets if isinstance(st, ast.Assign)
                   else [st.target] if isinstance(st, ast.AnnAssign) and st.value is not None else [])
        out += [(t.id, st.lineno) for t in targets if isinstance(t, ast.Name)]
    return out


def written_twice(sources: dict[str, str]) -> list[str]:
    """What in ``sources`` (path -> text) writes a capability outside its one declaration: an adapter's class body
    (any class in providers/, any ``...Provider`` subclass) assigning a capability attribute (or ``caps`` to
    anything but a name imported from providers/declared.py), a Declaration or a group built outside
    providers/declared.py, a provider declared twice there."""
    bad: list[str] = []
    group_names = {g.__name__ for g in GROUPS.values()}
    for path, text in sources.items():
        tree = ast.parse(text)
        declared_names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                          and n.module == "broker.providers.declared" for a in n.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and (path.startswith("providers/") or any(
                    (b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")).endswith("Provider")
                    for b in node.bases)):  # an adapter, its mixins, a provider class anywhere
                for attr, line in _assigned_names(node.body):
                    if attr in CAPABILITIES:
                        bad.append(f"{path}:{line}: class {node.name} writes capability {attr!r} in its body")
                for st in node.body:
                    if (isinstance(st, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "caps"
                                                           for t in st.targets)
                            and not (isinstance(st.value, ast.Name) and st.value.id in declared_names)):
                        bad.append(f"{path}:{st.lineno}: class {node.name} sets caps to something other than its "
                                   "declaration in providers/declared.py")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in group_names | {"Declaration"} and path != "providers/declared.py"):
                bad.append(f"{path}:{node.lineno}: {node.func.id}(...) built outside providers/declared.py")
        if path == "providers/declared.py":
            named = Counter(kw.value.value for n in ast.walk(tree)
                            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "Declaration"
                            for kw in n.keywords if kw.arg == "name" and isinstance(kw.value, ast.Constant))
            bad += [f"{path}: provider {n!r} declared {k} times" for n, k in named.items() if k > 1]
    return bad


def _product_sources() -> dict[str, str]:
    out = {}
    for root in ("broker", "providers"):
        for p in sorted((REPO / root).rglob("*.py")):
            if p != SCHEMA:  # the schema holds the defaults (DEFAULT) and nothing per provider
                out[str(p.relative_to(REPO))] = p.read_text(encoding="utf-8")
    return out


def test_no_capability_is_written_twice():
    assert written_twice(_product_sources()) == []


def test_the_check_finds_a_planted_second_declaration():
    """The check above is not empty: a class body that writes a capability again, a caps built in the adapter, a
    provider declared twice are each found."""
    src = _product_sources()
    vast = src["providers/vast/__init__.py"]
    assert "    caps = VAST\n" in vast
    planted = dict(src, **{"providers/vast/__init__.py": vast.replace(
        "    caps = VAST\n", "    caps = VAST\n    rents = True\n")})
    assert [b for b in written_twice(planted) if "writes capability 'rents'" in b]
    planted = dict(src, **{"providers/vast/__init__.py": vast.replace(
        "    caps = VAST\n", "    caps = Declaration(name='vast', adapter='x')\n")})
    found = written_twice(planted)
    assert any("sets caps" in b for b in found) and any("built outside" in b for b in found)
    decl = src["providers/declared.py"]
    planted = dict(src, **{"providers/declared.py": decl + "\nVAST2 = Declaration(name='vast', adapter='x')\n"})
    assert any("'vast' declared 2 times" in b for b in written_twice(planted))


def test_a_rented_cloud_says_why_each_missing_feature_is_missing():
    """The reason is what a refusal shows (broker stop, broker quota, broker slurm up, a hybrid plan)."""
    for name, d in DECLARED.items():
        if d.renting.rents and not d.renting.pretend:
            silent = [f for f in FEATURES if not d.supports(f) and f not in d.unsupported]
            assert not silent, f"{name} lacks {silent} without saying why (Declaration.unsupported)"
    assert registry.why_not("vast", "stop") is None
    assert registry.capabilities("gcp").refusal("stop").startswith("stop/start: Compute Engine can stop a VM")
    assert registry.why_not("nosuch", "quota") == "nosuch has no quota check/request"


def test_a_provider_lists_the_settings_it_reads():
    """Each provider's own environment settings (broker.core.config.EnvSettings) are listed in its declaration."""
    from dataclasses import fields as dc_fields

    from broker.core.config import EnvSettings

    owner = {"vast_": "vast", "oci_": "oci", "aws_": "aws", "broker_slurm_": "slurm"}
    for f in dc_fields(EnvSettings):
        env = f.metadata.get("env", f.name).upper()
        for prefix, name in owner.items():
            if f.name.startswith(prefix):
                assert env in DECLARED[name].access.env_vars, f"{env} is not in {name}'s declared env_vars"


@pytest.mark.parametrize("name", NAMES)
def test_capability_values_are_ones_the_core_understands(name):
    from broker.plan import catalog
    from broker.run import wireguard
    c = registry.capabilities(name)
    cls = registry.provider_class(name)
    assert set(c.topologies) <= TOPOLOGIES and c.topologies
    assert isinstance(c.setup_allowance_s, int) and c.setup_allowance_s >= 0
    assert c.ssh_ready_timeout_s > 0 and c.create_settle_s >= 0
    if c.quota:
        assert c.quota_unit in ("gpus", "vcpus") and c.quota_scope in ("AD", "region")
        assert cls.request_quota is not Provider.request_quota
    else:
        assert c.quota_unit is None and c.quota_scope is None
    assert c.node_switch_requires is None or c.node_switch
    assert c.live_price_list in (None, "api", "public")
    if c.live_price_list == "api":
        assert callable(getattr(cls, "live_prices", None)) and isinstance(c.live_prices_source, str)
    if c.live_price_list == "public":
        assert callable(getattr(cls, "public_price_offers", None))
    assert not c.live_offer_search or callable(getattr(cls, "live_offers", None))
    assert not c.native_query or "vast_query" in inspect.signature(cls.offers).parameters
    if c.snapshot is not None:
        assert (catalog.SHIPPED_DIR / c.snapshot).is_file(), c.snapshot
    assert c.ingress_rule_format is None or c.ingress_rule_format in wireguard.INGRESS_RULE_FORMATS
    assert not c.pretend or c.rents
    if c.rents and not c.pretend:
        assert c.credentials_hint and c.snapshot  # a cloud says what to configure and plans offline


def test_the_derived_lists_are_what_the_core_used_to_keep_by_hand():
    """Behaviour stays: the lists (and per-provider values) the core held as constants, now derived."""
    from broker.plan import catalog
    from broker.plan import facts
    from broker.run import hybrid
    from broker.cli import quota as quota_cmd

    # gcp came as one registry line (docs/architecture.md "Adding a provider") and joined every list it matches
    assert registry.CLOUD == facts.CLOUD == ("vast", "oci", "aws", "gcp")
    assert facts.DEFAULT_PROVIDERS == ("local", "vast", "oci", "aws", "gcp")
    assert catalog.PROVIDERS == ("vast", "oci", "aws", "gcp")
    assert quota_cmd.QUOTA_PROVIDERS == ("oci", "aws", "gcp")
    assert hybrid.TUN_PROVIDERS == ("oci", "aws", "gcp")
    assert "(use oci or aws or gcp for the cloud side)" in hybrid.NO_TUN_REASON
    assert set(facts.CREDENTIALS_HINT) == {"vast", "oci", "aws", "gcp"}
    assert {n: pricing.setup_allowance_seconds(n) for n in NAMES} == {
        "local": 0, "vast": 600, "oci": 900, "aws": 600, "gcp": 900, "netns": 0, "slurm": 0, "fake": 0}
    assert pricing.setup_allowance_seconds("nosuch") == pricing.DEFAULT_SETUP_ALLOWANCE_SECONDS
    from broker.run import pipeline
    from broker.slurm import cluster

    assert cluster.UP_PROVIDERS == registry.SLURM_NODES == ("netns", "oci", "aws", "gcp")
    assert set(pipeline.RUN_PROVIDERS) == {"local", "netns", "slurm", "vast", "oci", "aws", "gcp", "fake"}
    assert registry.PRETEND == ("fake",)


def test_each_adapter_decides_what_the_core_used_to_decide_by_its_name(monkeypatch):
    """What the core read from hand-kept tables keyed by cloud name now comes from the adapters: the SSH wait
    (pipeline.READY_TIMEOUT_S used to give OCI and AWS 300 s while the adapters declared 600 s and 420 s), the node
    switch words (accounting.node_layer), the quota tables (plan.quota.limit_for), the fake-state switch
    (provision.reconcile_providers)."""
    from broker.money import accounting
    from broker.plan import quota
    from broker.run.pipeline import CloudTarget
    from broker.core.records import Resource

    t = CloudTarget.__new__(CloudTarget)
    t.providers = None
    assert {n: t._adapter_ready_timeout(n) for n in ("oci", "aws", "vast")} == {
        n: registry.provider_class(n).ssh_ready_timeout_s for n in ("oci", "aws", "vast")} == {
        "oci": 600.0, "aws": 420.0, "vast": 180.0}
    assert t._adapter_ready_timeout("test-double") == Provider.ssh_ready_timeout_s
    ref = quota.limit_for("aws", "g5.xlarge")
    assert (ref.name, ref.unit, ref.scope_kind, ref.service) == ("L-DB2E81BA", "vcpus", "region", "ec2")
    ref = quota.limit_for("oci", "VM.GPU.A10.1")
    assert (ref.name, ref.unit, ref.scope_kind, ref.service) == ("gpu-a10-count", "gpus", "AD", "compute")
    assert quota.limit_for("vast", "1x RTX_4090") is None
    ref = quota.limit_for("gcp", "n1-standard-4+t4")
    assert (ref.name, ref.unit, ref.scope_kind, ref.service) == ("NVIDIA_T4_GPUS", "gpus", "region", "compute")

    def row(provider, **attrs):
        return Resource(id="r1", run_id="run1", provider=provider, kind="instance", name="n0",
                        attrs={"deadman_grace_s": 300, **attrs})

    deadline = {"deadline": "2030-01-01T00:00:00+00:00"}
    monkeypatch.setattr(accounting, "effective_deadline", lambda res, run: deadline["deadline"])
    assert accounting.node_layer(row("vast")) == "self-destroy via the Vast API at deadline + 300 s grace"
    assert accounting.node_layer(row("aws")) == ("scheduled shutdown at deadline + 300 s grace, "
                                                 "InstanceInitiatedShutdownBehavior=terminate")
    assert accounting.node_layer(row("oci", instance_principal=True)) == (
        "self-terminate with an instance principal at deadline + 300 s grace")
    assert accounting.node_layer(row("oci", instance_principal=False)) is None
    assert accounting.node_layer(row("netns")) is None
    assert accounting.node_layer(row("gcp")) == ("self-delete with the VM's service account at deadline + 300 s grace "
                                                 "(else power off)")

    fake = registry.provider_class("fake")
    monkeypatch.delenv("BROKER_FAKE_STATE", raising=False)
    assert not fake.pretend_active()
    monkeypatch.setenv("BROKER_FAKE_STATE", "/nonexistent/state.json")
    assert fake.pretend_active()


def test_a_new_declaration_reaches_every_derived_list():
    """What adding a provider does: one declaration, and each list that matches its capabilities names it."""
    caps = registry.Capabilities(Declaration(
        name="gcp2", adapter="x:Y", topologies=("simulated", "multi-node", "hybrid"),
        renting=capmod.Renting(rents=True, planned_by_default=True),
        quotas=capmod.Quotas(quota=True, quota_unit="gpus", quota_scope="region"),
        prices=capmod.Prices(snapshot="gcp.csv")))
    assert caps.rents and caps.setup_allowance_s == Provider.setup_allowance_s and caps.local_exec is False
    saved = dict(registry._CAPS)
    try:
        registry._CAPS["gcp2"] = caps
        assert registry.names_where(lambda c: c.rents and not c.pretend)[-1] == "gcp2"
        assert "gcp2" in registry.names_where(lambda c: "hybrid" in c.topologies)
        assert registry.capability("gcp2", "quota_scope") == "region"
    finally:
        registry._CAPS.clear()
        registry._CAPS.update(saved)
    with pytest.raises(TypeError):
        capmod.Renting(rent=True)  # a typo never passes silently
    with pytest.raises(TypeError, match="unknown features"):
        Declaration(name="p", adapter="x:Y", unsupported={"stopping": "no"})
    with pytest.raises(TypeError, match="drop the reason"):  # a reason for what it has would mislead
        Declaration(name="p", adapter="x:Y", renting=capmod.Renting(stoppable=True), unsupported={"stop": "no"})
    with pytest.raises(AttributeError):
        caps.no_such_capability  # noqa: B018


def test_unregistered_names_read_the_base_defaults_and_unknown_lookups_say_what_to_do():
    from broker.core.provider import BadInput

    assert registry.capability("test-double", "ssh_ready_timeout_s") == Provider.ssh_ready_timeout_s
    with pytest.raises(BadInput, match="choose one of: local, vast"):
        registry.capabilities("gcpp")


def test_reading_the_capabilities_imports_no_adapter(tmp_path):
    """``broker plan`` derives its lists from the registry lines: importing the registry and every module that reads
    it imports no adapter module, no SDK and no pydantic."""
    code = ("import sys, json\nimport broker.providers as r, broker.plan.facts, broker.plan.catalog, broker.plan.pricing, "
            "broker.run.hybrid, broker.plan.quota, broker.plan.planner\n"
            "[r.capabilities(n).as_dict() for n in r.REGISTRY]\nbroker.plan.pricing.setup_allowance_seconds('oci')\n"
            "sys.stderr.write('MODS=' + json.dumps(sorted(sys.modules)) + '\\n')")
    cp = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, PYTHONPATH=str(REPO)))
    line = [ln for ln in cp.stderr.splitlines() if ln.startswith("MODS=")]
    assert line, cp.stderr
    mods = set(json.loads(line[-1][5:]))
    adapters = {m for m in mods if m.startswith("broker.providers.") and m != "broker.providers.declared"}
    assert not adapters, adapters
    for heavy in ("pydantic", "oci", "boto3", "botocore", "httpx", "google"):
        assert heavy not in mods, heavy


# ------------------------------------------------------------------------------------ cloud names in the core
#: core files that still hold cloud-name string constants, with how many: each needs a capability (or a move into
#: its adapter) and leaves this list when done.  A file not listed here must hold none; none is left.
NOT_YET_DONE: dict[str, int] = {}


def _cloud_names() -> set[str]:
    return set(registry.names_where(lambda c: c.rents))


def _constants(path: Path) -> Counter:
    names = _cloud_names()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return Counter(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in names)


def census() -> dict[str, int]:
    out = {}
    for path in sorted((REPO / "broker").rglob("*.py")):
        n = sum(_constants(path).values())
        if n:
            out[str(path.relative_to(REPO))] = n
    return out


def test_no_new_cloud_name_constants_in_the_core():
    found = census()
    new = {f: n for f, n in found.items() if f not in NOT_YET_DONE}
    assert not new, (f"cloud-name string constants in {new}: read a capability instead "
                     "(broker.providers.capability / the derived lists; docs/architecture.md 'Adding a provider')")
    grew = {f: (n, NOT_YET_DONE[f]) for f, n in found.items() if n > NOT_YET_DONE[f]}
    assert not grew, f"more cloud-name constants than listed (found, listed): {grew}"


def test_the_not_yet_done_list_is_not_stale():
    """A file that no longer names a cloud leaves the list (so the list shrinks to nothing as the work is done)."""
    found = census()
    stale = {f: n for f, n in NOT_YET_DONE.items() if found.get(f, 0) < n}
    assert not stale, f"fewer cloud-name constants than listed (lower the counts / drop the files): {stale}, {found}"


def test_preemption_defaults_to_cannot_tell():
    """The base class says None ("not preempted, or cannot tell") for any id; it makes no call."""
    class P(Provider):
        name = "p"
    assert P().preemption("i-123") is None
    assert "ProviderError" in (Provider.preemption.__doc__ or "")


@pytest.mark.parametrize("name", NAMES)
def test_an_interruptible_adapter_tells_preemption_itself(name):
    """A provider that rents interruptible capacity must be able to tell a preemption from a crash."""
    cls = registry.provider_class(name)
    if cls.interruptible:
        assert cls.preemption is not Provider.preemption, f"{cls.__name__} is interruptible but has no preemption()"


def test_refusals_show_the_declared_reason(monkeypatch, tmp_path):
    """broker stop, broker quota, broker slurm up and a hybrid plan refuse a provider without the feature with the
    reason its declaration gives (no reason kept beside the command)."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from broker.cli.app import app
    from broker.cli.stopstart import _stoppable_rows
    from broker.core.provider import BadInput
    from broker.plan.planner import why_not_hybrid
    from broker.slurm.cluster import UpOptions, _target

    row = SimpleNamespace(kind="instance", provider="gcp", state="running", provider_id="i-1")
    ledger = SimpleNamespace(resources=lambda run_id, live_only: [row])
    with pytest.raises(BadInput) as e:
        _stoppable_rows(ledger, SimpleNamespace(id="r1", status="running"), ("running",))
    assert "gcp: " + DECLARED["gcp"].unsupported["stop"] in str(e.value)
    row.provider = "slurm"
    with pytest.raises(BadInput, match="slurm: Slurm allocations cannot be suspended by broker"):
        _stoppable_rows(ledger, SimpleNamespace(id="r1", status="running"), ("running",))

    monkeypatch.setenv("BROKER_HOME", str(tmp_path))
    out = CliRunner().invoke(app, ["quota", "check", "--provider", "vast"])
    assert isinstance(out.exception, BadInput) and DECLARED["vast"].unsupported["quota"] in str(out.exception)

    with pytest.raises(BadInput) as e:
        _target(UpOptions(provider="fake"), SimpleNamespace(cpu_only=True))
    assert DECLARED["fake"].unsupported["slurm-nodes"] in str(e.value)

    assert why_not_hybrid("vast").startswith(DECLARED["vast"].unsupported["hybrid"] + " (use oci or aws")
    assert why_not_hybrid("aws") is None
    assert "/dev/net/tun" in why_not_hybrid("test-double")  # not registered: the general reason
