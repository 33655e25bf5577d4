"""OCI network for a run: bootstrap (VCN, internet gateway, default route, security list, regional subnet) and the
deletes, in dependency order.

Ledger-first: every create is preceded by ``rec.intent`` and followed by ``rec.created``; a create that failed
for sure is ``rec.failed``; an ambiguous one (5xx / timeout, :class:`broker.core.provider.AmbiguousCreate`) keeps its
intent row, because the object may exist: :meth:`OCIProvider.list_tagged` finds it by its tags.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any, Callable

from broker.core.provider import INSTALL_TAG, RUN_TAG, AmbiguousCreate, ProviderError, Recorder
from broker.providers.oci.sdk import PROVIDER, expect_fields, expect_list, expect_tags

if TYPE_CHECKING:
    from broker.providers.oci.sdk import OCIApi
    from broker.core.records import Ingress

VCN_CIDR, SUBNET_CIDR = "10.0.0.0/16", "10.0.1.0/24"
#: Deletion order of the kinds this adapter creates: instances, then subnets, then what the subnets used (security
#: lists, route rules, gateways), the VCN last.  A kind missing here sorts last.
DELETE_ORDER: tuple[str, ...] = ("instance", "subnet", "security_list", "route_table", "internet_gateway", "vcn")


def delete_rank(kind: str) -> int:
    """Position of ``kind`` in :data:`DELETE_ORDER` (unknown kinds last)."""
    return DELETE_ORDER.index(kind) if kind in DELETE_ORDER else len(DELETE_ORDER)


def run_tags(run_id: str, installation_id: str | None) -> dict[str, str]:
    """Freeform tags of every object created for a run: RUN_TAG and, when known, INSTALL_TAG."""
    return {RUN_TAG: run_id, **({INSTALL_TAG: installation_id} if installation_id else {})}


def created_object(call: str, data: Any) -> Any:
    """The object a create answered; an answer without an id is an :class:`AmbiguousCreate` (the create was
    accepted, so the object may exist: verify by listing its tags)."""
    try:
        return expect_fields(call, data, "id")
    except ProviderError as err:
        raise AmbiguousCreate(PROVIDER, call, f"{err.message.split(' failed: ', 1)[-1]}; the create may have happened",
                              hint="list by tag / retry token before creating again") from err


def wait_available(api: "OCIApi", call: str, get: Callable[[str], Any], rid: str, data: Any,
                   timeout_s: float = 120.0) -> Any:
    """Poll ``get(rid)`` until lifecycle_state is AVAILABLE (returns at once when it already is)."""
    deadline = time.monotonic() + timeout_s
    while getattr(data, "lifecycle_state", "AVAILABLE") not in ("AVAILABLE",):
        if data.lifecycle_state in ("TERMINATING", "TERMINATED", "FAILED") or time.monotonic() > deadline:
            raise ProviderError(PROVIDER, call, f"{rid} is {data.lifecycle_state}, not AVAILABLE")
        api.sleep(2.0)
        data = api.call(call, get, rid).data
    return data


def reuse_subnet(api: "OCIApi", subnet_id: str, rec: Recorder) -> dict[str, Any]:
    """The network of an existing subnet (``OCI_SUBNET_ID``): nothing created, nothing recorded."""
    vn = api.client("vnet")
    sub = expect_fields("get_subnet", api.call("get_subnet", vn.get_subnet, subnet_id).data, "id", "vcn_id")
    vcn = expect_fields("get_vcn", api.call("get_vcn", vn.get_vcn, sub.vcn_id).data, "id")
    cidr = (vcn.cidr_blocks or [vcn.cidr_block])[0]
    rec.event(f"oci: reusing subnet {sub.id} (OCI_SUBNET_ID) in VCN {vcn.id} {cidr}: nothing created")
    return {"subnet_id": sub.id, "vcn_id": vcn.id, "vcn_cidr": cidr, "reused": True}


def bootstrap(api: "OCIApi", run_id: str, rec: Recorder) -> dict[str, Any]:
    """VCN 10.0.0.0/16, internet gateway, default route 0.0.0.0/0 via it, a security list (ingress: all protocols
    from the VCN CIDR, stateful; TCP 22 from anywhere; egress: all) and a regional subnet 10.0.1.0/24.  Every
    object (the VCN's default route table included, tagged when its rule is set) carries ``freeform_tags``
    RUN_TAG = ``run_id`` and INSTALL_TAG = ``rec.installation_id``.

    Returns ``{"subnet_id", "vcn_id", "vcn_cidr", ...}`` for :attr:`NodeRequest.network`.
    Raises AuthError, QuotaError (VCN limits), AmbiguousCreate, TransientError, ProviderError.
    """
    import oci

    m = oci.core.models
    vn = api.client("vnet")
    cidr = VCN_CIDR
    tags = run_tags(run_id, getattr(rec, "installation_id", None))
    comp, region = api.compartment, api.region
    label = "b" + re.sub(r"[^a-z0-9]", "", run_id.lower())[:14]

    def create(kind: str, name: str, call: str, fn: Callable[[], Any], **attrs: Any) -> Any:
        rid = rec.intent(kind, name, region=region, attrs={"vcn_cidr": cidr})
        try:
            with api.errors(call, scope=region, create=True):
                data = fn().data
            data = created_object(call, data)
        except AmbiguousCreate as err:  # it may exist: keep the intent row; list_tagged finds it by its tags
            rec.event(f"oci: {call} for {name}: {err.message}; it may exist, left for reconcile to verify")
            raise
        except ProviderError as err:
            rec.failed(rid, err.message)
            raise
        rec.created(rid, data.id, **attrs)
        return data

    vcn = create("vcn", f"broker-{run_id}-vcn", "create_vcn", lambda: vn.create_vcn(m.CreateVcnDetails(
        compartment_id=comp, cidr_blocks=[cidr], display_name=f"broker-{run_id}-vcn", dns_label=label,
        freeform_tags=tags)))
    vcn = wait_available(api, "get_vcn", vn.get_vcn, vcn.id, vcn)
    igw = create("internet_gateway", f"broker-{run_id}-igw", "create_internet_gateway",
                 lambda: vn.create_internet_gateway(m.CreateInternetGatewayDetails(
                     compartment_id=comp, vcn_id=vcn.id, is_enabled=True, display_name=f"broker-{run_id}-igw",
                     freeform_tags=tags)),
                 vcn_id=vcn.id, route_table_id=vcn.default_route_table_id)  # terminate() clears the route
    rt_id = vcn.default_route_table_id
    rec.event(f"oci: route 0.0.0.0/0 -> {igw.id} on the VCN's default route table {rt_id}")
    api.call("update_route_table", vn.update_route_table, rt_id, m.UpdateRouteTableDetails(route_rules=[
        m.RouteRule(destination="0.0.0.0/0", destination_type="CIDR_BLOCK", network_entity_id=igw.id)],
        freeform_tags=tags))
    sl = create("security_list", f"broker-{run_id}-sl", "create_security_list",
                lambda: vn.create_security_list(m.CreateSecurityListDetails(
                    compartment_id=comp, vcn_id=vcn.id, display_name=f"broker-{run_id}-sl", freeform_tags=tags,
                    ingress_security_rules=[
                        m.IngressSecurityRule(protocol="all", source=cidr, source_type="CIDR_BLOCK",
                                              is_stateless=False, description="intra-cluster (VCN only)"),
                        m.IngressSecurityRule(protocol="6", source="0.0.0.0/0", source_type="CIDR_BLOCK",
                                              is_stateless=False, description="SSH",
                                              tcp_options=m.TcpOptions(destination_port_range=m.PortRange(
                                                  min=22, max=22)))],
                    egress_security_rules=[m.EgressSecurityRule(destination="0.0.0.0/0", protocol="all",
                                                                destination_type="CIDR_BLOCK")])))
    sub = create("subnet", f"broker-{run_id}-subnet", "create_subnet",
                 lambda: vn.create_subnet(m.CreateSubnetDetails(
                     compartment_id=comp, vcn_id=vcn.id, cidr_block=SUBNET_CIDR,
                     display_name=f"broker-{run_id}-subnet", dns_label="nodes", security_list_ids=[sl.id],
                     route_table_id=rt_id, prohibit_public_ip_on_vnic=False, freeform_tags=tags)))
    wait_available(api, "get_subnet", vn.get_subnet, sub.id, sub)
    return {"subnet_id": sub.id, "vcn_id": vcn.id, "vcn_cidr": cidr, "security_list_id": sl.id,
            "internet_gateway_id": igw.id, "route_table_id": rt_id}


def open_ingress(api: "OCIApi", net: dict[str, Any], rules: list[Ingress], rec: Recorder) -> None:
    """Add ``rules`` to the run's security list (``net["security_list_id"]`` from :func:`bootstrap`): one stateful
    ingress rule each, protocol 6 (TCP) / 17 (UDP) with ``destination_port_range``, from ``rule.cidr``; rules
    already present are not added twice.  A reused subnet (``OCI_SUBNET_ID``) is not changed: the event says which
    ports to open there.  Raises ProviderError / TransientError."""
    import oci

    m = oci.core.models
    sl_id = net.get("security_list_id")
    if not sl_id:
        rec.event("oci: reused subnet (OCI_SUBNET_ID): its security list is not changed by broker; open "
                  + ", ".join(f"{r.protocol} {r.port}-{r.last_port} from {r.cidr}" for r in rules) + " there")
        return
    vn = api.client("vnet")
    sl = api.call("get_security_list", vn.get_security_list, sl_id).data
    have = list(sl.ingress_security_rules or [])
    added = []
    for r in rules:
        rng = m.PortRange(min=r.port, max=r.last_port)
        rule = m.IngressSecurityRule(protocol="17" if r.protocol == "udp" else "6", source=r.cidr,
                                     source_type="CIDR_BLOCK", is_stateless=False, description=r.description or None,
                                     **({"udp_options": m.UdpOptions(destination_port_range=rng)} if r.protocol == "udp"
                                        else {"tcp_options": m.TcpOptions(destination_port_range=rng)}))
        opts = rule.udp_options or rule.tcp_options

        def same(x: Any) -> bool:
            o = x.udp_options if r.protocol == "udp" else x.tcp_options
            pr = getattr(o, "destination_port_range", None)
            return (x.protocol == rule.protocol and x.source == r.cidr and pr is not None
                    and (pr.min, pr.max) == (opts.destination_port_range.min, opts.destination_port_range.max))

        if not any(same(x) for x in have):
            have.append(rule)
            added.append(f"{r.protocol} {r.port}" + (f"-{r.last_port}" if r.last_port != r.port else "")
                         + f" from {r.cidr}")
    if added:
        api.call("update_security_list", vn.update_security_list, sl_id,
                 m.UpdateSecurityListDetails(ingress_security_rules=have))
        rec.event(f"oci: security list {sl_id} opened inbound: " + ", ".join(added))


# ---------------------------------------------------------------------------------------------- deletes
def _gone(e: ProviderError) -> bool:
    return e.status == 404 and e.code != "NotAuthenticated"


def delete(api: "OCIApi", call: str, fn: Callable[[str], Any], rid: str, conflict_wait_s: float) -> bool:
    """A network delete: 404 = gone -> True; 409 (dependents still going away) retried with exponential backoff
    (2, 4, 8, 15 s ...) until ``conflict_wait_s`` seconds were spent waiting, then TransientError (the caller
    retries later); 429/5xx are TransientError at once."""
    from tenacity import Retrying, retry_if_exception, wait_exponential

    def conflict(e: BaseException) -> bool:
        return isinstance(e, ProviderError) and e.status == 409

    try:
        for attempt in Retrying(retry=retry_if_exception(conflict), wait=wait_exponential(multiplier=2, max=15),
                                stop=lambda rs: rs.idle_for >= conflict_wait_s, sleep=api.sleep, reraise=True):
            with attempt:
                api.call(call, fn, rid)
    except ProviderError as e:
        if _gone(e):
            return True
        raise
    return True


def clear_routes(api: "OCIApi", rt_id: str, target_id: str) -> None:
    """Remove the rules of route table ``rt_id`` that target ``target_id`` (a gateway about to be deleted)."""
    import oci

    vn = api.client("vnet")
    try:
        rt = api.call("get_route_table", vn.get_route_table, rt_id).data
    except ProviderError as e:
        if e.status == 404:
            return
        raise
    rules = rt.route_rules or []
    keep = [r for r in rules if r.network_entity_id != target_id]
    if len(keep) != len(rules):
        api.call("update_route_table", vn.update_route_table, rt_id,
                 oci.core.models.UpdateRouteTableDetails(route_rules=keep))


def delete_internet_gateway(api: "OCIApi", igw_id: str, route_table_id: str | None, conflict_wait_s: float) -> bool:
    """Clear the route rules targeting the gateway (its VCN's default route table unless ``route_table_id``),
    then delete it."""
    vn = api.client("vnet")
    try:
        igw = api.call("get_internet_gateway", vn.get_internet_gateway, igw_id).data
    except ProviderError as e:
        if _gone(e):
            return True
        raise
    rt_id = route_table_id
    if not rt_id:
        try:
            rt_id = api.call("get_vcn", vn.get_vcn, igw.vcn_id).data.default_route_table_id
        except ProviderError as e:
            if e.status != 404:
                raise
    if rt_id:
        clear_routes(api, rt_id, igw_id)
    return delete(api, "delete_internet_gateway", vn.delete_internet_gateway, igw_id, conflict_wait_s)


def delete_network_object(api: "OCIApi", kind: str, provider_id: str, attrs: dict[str, Any] | None,
                          conflict_wait_s: float) -> bool:
    """Delete one network object of ``kind`` (subnet, security_list, vcn, internet_gateway, route_table)."""
    vn = api.client("vnet")
    if kind == "subnet":
        return delete(api, "delete_subnet", vn.delete_subnet, provider_id, conflict_wait_s)
    if kind == "security_list":
        return delete(api, "delete_security_list", vn.delete_security_list, provider_id, conflict_wait_s)
    if kind == "vcn":
        return delete(api, "delete_vcn", vn.delete_vcn, provider_id, conflict_wait_s)
    if kind == "internet_gateway":
        return delete_internet_gateway(api, provider_id, (attrs or {}).get("route_table_id"), conflict_wait_s)
    if kind == "route_table":
        return True  # the default route table goes with its VCN; our rules are cleared with the IGW
    raise ProviderError(PROVIDER, "terminate", f"unknown resource kind {kind!r}")


def list_network(api: "OCIApi") -> list[tuple[str, str, Any]]:
    """(kind, call, object) of every VCN, subnet, internet gateway and security list in the compartment."""
    vn = api.client("vnet")
    out = []
    for kind, call, fn in (("vcn", "list_vcns", vn.list_vcns), ("subnet", "list_subnets", vn.list_subnets),
                           ("internet_gateway", "list_internet_gateways", vn.list_internet_gateways),
                           ("security_list", "list_security_lists", vn.list_security_lists)):
        for r in expect_list(call, api.all_pages(call, fn, api.compartment)):
            expect_fields(call, r, "id")
            expect_tags(call, r)
            out.append((kind, call, r))
    return out
