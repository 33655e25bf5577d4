"""GCP network for a run: a custom-mode VPC network and one regional subnet (or the project's ``default``
network), firewall rules by network tag (all traffic between the run's instances; SSH from the caller), extra
ingress for hybrid runs, and the deletes in dependency order.

Networks and firewalls carry no labels in GCP: broker's run and installation go into their ``description``
(``broker-run=<id> broker-install=<id>``) and names start with ``broker-<run>``.  Provider ids: a network or
firewall by its name, a subnet as ``<region>:<name>``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from broker.core.provider import INSTALL_TAG, RUN_TAG, ProviderError, TransientError
from broker.providers.gcp.api import PROVIDER

if TYPE_CHECKING:
    from broker.core.provider import Recorder
    from broker.core.records import Ingress
    from broker.providers.gcp.api import GCPApi

SUBNET_CIDR = "10.200.0.0/20"
#: kinds in the order their deletes succeed (instances and their disks first, the network last)
DELETE_ORDER = ("instance", "boot_volume", "subnet", "firewall", "vpc")


def gce_name(*parts: str, limit: int = 63) -> str:
    """A valid GCE resource name (``[a-z]([-a-z0-9]*[a-z0-9])?``, at most 63) from ``parts``."""
    s = re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")
    if not s or not s[0].isalpha():
        s = "b-" + s
    return s[:limit].rstrip("-")


def run_tag(run_id: str) -> str:
    """The network tag of a run's instances (firewall ``sourceTags`` / ``targetTags``)."""
    return gce_name("broker", run_id)


def description(run_id: str, installation_id: str | None) -> str:
    return f"{RUN_TAG}={run_id}" + (f" {INSTALL_TAG}={installation_id}" if installation_id else "")


def parse_description(text: str | None) -> dict[str, str]:
    out = {}
    for word in (text or "").split():
        k, sep, v = word.partition("=")
        if sep and k in (RUN_TAG, INSTALL_TAG):
            out[k] = v
    return out


def _insert(api: "GCPApi", rec: "Recorder", kind: str, name: str, pid: str, fn: Any, *, where: str | None,
            call: str, **kw: Any) -> str:
    """Ledger-first insert: intent, the call, created, then wait for the operation."""
    region = where
    rid = rec.intent(kind, name, region=region)
    try:
        op = api.call(call, fn, _create=True, **kw)
    except ProviderError as e:
        if not e.ambiguous:
            rec.failed(rid, e.message)
        raise
    rec.created(rid, pid)
    # bounded by the run's deadline where the recorder knows it, with a progress line while it waits
    api.wait(op, call, region=region if kind == "subnet" else None, say=rec.event,
             deadline=getattr(rec, "deadline", None))
    return pid


def bootstrap(api: "GCPApi", run_id: str, region: str, rec: "Recorder", *, network: str | None = None,
              ssh_sources: list[str] | None = None) -> dict[str, Any]:
    """The run's network: a custom-mode VPC ``broker-<run>`` with subnet ``broker-<run>`` (:data:`SUBNET_CIDR`) in
    ``region`` (or the existing ``network``, e.g. ``default``, and its subnets), then firewall
    ``broker-<run>-internal`` (tcp, udp, icmp from the run's tag to the run's tag) and ``broker-<run>-ssh`` (tcp:22
    from ``ssh_sources``, default ``0.0.0.0/0``, to the tag).  Each object is recorded before and after its
    insert; the operations are waited for.  Returns ``{network, subnetwork, region, tag, cidr}``."""
    from google.cloud import compute_v1 as c

    project = api.require_project("networks.insert")
    tag = run_tag(run_id)
    desc = description(run_id, rec.installation_id)
    base = gce_name("broker", run_id, limit=50)
    net_name, subnet = network, None
    cidr = "10.128.0.0/9" if network else SUBNET_CIDR
    if not network:
        net_name = base
        nets = api.client("networks")
        _insert(api, rec, "vpc", net_name, net_name, nets.insert_unary, where=None, call="networks.insert",
                project=project, network_resource=c.Network(name=net_name, auto_create_subnetworks=False,
                                                           description=desc))
        subnet = base
        subs = api.client("subnetworks")
        _insert(api, rec, "subnet", subnet, f"{region}:{subnet}", subs.insert_unary, where=region,
                call="subnetworks.insert", project=project, region=region, subnetwork_resource=c.Subnetwork(
                    name=subnet, network=f"projects/{project}/global/networks/{net_name}", ip_cidr_range=cidr,
                    region=region, description=desc))
    fw = api.client("firewalls")
    net_url = f"projects/{project}/global/networks/{net_name}"
    internal = c.Firewall(name=f"{base}-internal", network=net_url, direction="INGRESS", priority=1000,
                          description=desc, source_tags=[tag], target_tags=[tag],
                          allowed=[c.Allowed(I_p_protocol="tcp", ports=["0-65535"]),
                                   c.Allowed(I_p_protocol="udp", ports=["0-65535"]),
                                   c.Allowed(I_p_protocol="icmp")])
    _insert(api, rec, "firewall", internal.name, internal.name, fw.insert_unary, where=None,
            call="firewalls.insert", project=project, firewall_resource=internal)
    ssh = c.Firewall(name=f"{base}-ssh", network=net_url, direction="INGRESS", priority=1000, description=desc,
                     source_ranges=list(ssh_sources or ["0.0.0.0/0"]), target_tags=[tag],
                     allowed=[c.Allowed(I_p_protocol="tcp", ports=["22"])])
    _insert(api, rec, "firewall", ssh.name, ssh.name, fw.insert_unary, where=None, call="firewalls.insert",
            project=project, firewall_resource=ssh)
    return {"network": net_name, "subnetwork": subnet, "region": region, "tag": tag, "cidr": cidr,
            "run_id": run_id}


def open_ingress(api: "GCPApi", net: dict[str, Any], rules: list["Ingress"], rec: "Recorder") -> None:
    """One firewall rule per ``rules`` entry (its protocol and ports from its CIDR, to the run's tag), recorded
    ledger-first; an existing rule of that name (409) counts as done."""
    from google.cloud import compute_v1 as c

    project = api.require_project("firewalls.insert")
    fw = api.client("firewalls")
    base = gce_name("broker", net.get("run_id") or net["tag"].removeprefix("broker-"), limit=44)
    for r in rules:
        ports = f"{r.port}" if r.last_port == r.port else f"{r.port}-{r.last_port}"
        name = gce_name(base, "in", r.protocol, str(r.port))
        body = c.Firewall(name=name, network=f"projects/{project}/global/networks/{net['network']}",
                          direction="INGRESS", priority=1000, description=description(
                              net.get("run_id") or "", rec.installation_id),
                          source_ranges=[r.cidr], target_tags=[net["tag"]],
                          allowed=[c.Allowed(I_p_protocol=r.protocol, ports=[ports])])
        try:
            _insert(api, rec, "firewall", name, name, fw.insert_unary, where=None, call="firewalls.insert",
                    project=project, firewall_resource=body)
        except ProviderError as e:
            if e.status != 409:
                raise
        rec.event(f"gcp firewall {name}: {r.protocol} {ports} from {r.cidr} opened to the run's instances")


def delete_network_object(api: "GCPApi", kind: str, provider_id: str) -> bool:
    """Delete one network object (``firewall``, ``subnet`` = ``<region>:<name>``, ``vpc``) and wait for the
    operation; True when gone (404 = gone).  A dependant still in place (400 resourceInUseByAnotherResource) is a
    TransientError: the core retries after the dependants are gone."""
    project = api.require_project(f"delete {kind}")
    try:
        if kind == "firewall":
            op = api.call("firewalls.delete", api.client("firewalls").delete_unary, project=project,
                          firewall=provider_id)
            api.wait(op, "firewalls.delete")
        elif kind == "subnet":
            region, _, name = provider_id.partition(":")
            op = api.call("subnetworks.delete", api.client("subnetworks").delete_unary, project=project,
                          region=region, subnetwork=name)
            api.wait(op, "subnetworks.delete", region=region)
        elif kind == "vpc":
            op = api.call("networks.delete", api.client("networks").delete_unary, project=project,
                          network=provider_id)
            api.wait(op, "networks.delete")
        else:
            raise ProviderError(PROVIDER, f"delete {kind}", f"unknown resource kind {kind!r}")
    except TransientError:
        raise
    except ProviderError as e:
        if e.status == 404:
            return True
        raise
    return True


def list_network(api: "GCPApi") -> list[tuple[str, str, str | None, dict[str, str], Any]]:
    """(kind, provider id, region, broker tags from the description, object) of every network, subnet and
    firewall whose description carries RUN_TAG."""
    project = api.require_project("networks.list")
    out: list[tuple[str, str, str | None, dict[str, str], Any]] = []
    for n in api.call("networks.list", lambda: list(api.client("networks").list(project=project))):
        tags = parse_description(n.description)
        if RUN_TAG in tags:
            out.append(("vpc", n.name, None, tags, n))
    for f in api.call("firewalls.list", lambda: list(api.client("firewalls").list(project=project))):
        tags = parse_description(f.description)
        if RUN_TAG in tags:
            out.append(("firewall", f.name, None, tags, f))
    agg = api.call("subnetworks.aggregatedList",
                   lambda: list(api.client("subnetworks").aggregated_list(project=project)))
    for _scope, lst in agg:
        for s in lst.subnetworks:
            tags = parse_description(s.description)
            if RUN_TAG in tags:
                region = s.region.rsplit("/", 1)[-1]
                out.append(("subnet", f"{region}:{s.name}", region, tags, s))
    return out
