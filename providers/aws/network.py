"""AWS network for a run: a security group (members talk freely, SSH in) and, for ``multi-node``, a cluster
placement group; their deletes, in dependency order (instances -> security groups -> placement groups).

Ledger-first: each create is preceded by ``rec.intent`` and followed by ``rec.created``; a create refused for sure
is ``rec.failed``; an ambiguous one (5xx / timeout, :class:`broker.core.provider.AmbiguousCreate`) keeps its intent row
because the object may exist (found by its tags).  Every object carries RUN_TAG and INSTALL_TAG.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from broker.core.provider import INSTALL_TAG, RUN_TAG, AmbiguousCreate, ProviderError, Recorder, TransientError
from broker.providers.aws.api import PROVIDER, error_code, expect_list, expect_str, map_error

if TYPE_CHECKING:
    from broker.providers.aws.api import AWSApi
    from broker.core.records import Ingress

#: Deletion order of the kinds this adapter creates (a kind missing here sorts last).
DELETE_ORDER: tuple[str, ...] = ("instance", "security_group", "placement_group")


def delete_rank(kind: str) -> int:
    """Position of ``kind`` in :data:`DELETE_ORDER` (unknown kinds last)."""
    return DELETE_ORDER.index(kind) if kind in DELETE_ORDER else len(DELETE_ORDER)


def run_tags(run_id: str, installation_id: str | None, name: str | None = None) -> list[dict[str, str]]:
    """EC2 tags of every object created for a run: RUN_TAG, INSTALL_TAG (when known), ``Name``."""
    tags = [{"Key": RUN_TAG, "Value": run_id}]
    if installation_id:
        tags.append({"Key": INSTALL_TAG, "Value": installation_id})
    if name:
        tags.append({"Key": "Name", "Value": name})
    return tags


def _record_failure(rec: Recorder, rid: str, err: ProviderError, what: str) -> None:
    if isinstance(err, AmbiguousCreate):  # it may exist: keep the intent row for reconcile to verify by tag
        rec.event(f"aws: {what}: {err.message}; it may exist, left for reconcile to verify")
    else:
        rec.failed(rid, str(err))


def bootstrap(api: "AWSApi", run_id: str, region: str, zone: str | None, topology: str, nodes: int,
              rec: Recorder, subnet_id: str | None) -> dict[str, Any]:
    """Security group (self-referencing all-protocol rule + tcp/22) in the default VPC (or ``subnet_id``'s VPC)
    and, for ``multi-node``, a cluster placement group; each create recorded with ``rec`` before and after and
    tagged RUN_TAG + INSTALL_TAG (``rec.installation_id``).  Returns ``{"region", "zone", "vpc_id",
    "subnet_id", "security_group_id", "placement_group", "nodes"}``."""
    ec2 = api.client("ec2", region)
    if subnet_id:
        subs = expect_list("describe_subnets", api.call(ec2, "describe_subnets", {"region": region},
                                                         SubnetIds=[subnet_id]), "Subnets")
        if not subs:
            raise ProviderError(PROVIDER, "describe_subnets", f"subnet {subnet_id} not found in {region}",
                                hint="check AWS_SUBNET_ID and the region")
        vpc_id = expect_str("describe_subnets", subs[0], "VpcId")
    else:
        vpcs = expect_list("describe_vpcs", api.call(ec2, "describe_vpcs", {"region": region},
                                                     Filters=[{"Name": "isDefault", "Values": ["true"]}]), "Vpcs")
        if not vpcs:
            raise ProviderError(PROVIDER, "describe_vpcs", f"no default VPC in {region}",
                                hint="set AWS_SUBNET_ID to a subnet (with a public IP on launch) to use")
        vpc_id = expect_str("describe_vpcs", vpcs[0], "VpcId")
    installation_id = getattr(rec, "installation_id", None)
    name = f"broker-{run_id}"
    rid = rec.intent("security_group", name, region=region, attrs={"vpc_id": vpc_id})
    try:
        resp = api.call(ec2, "create_security_group", {"region": region, "create": True}, GroupName=name,
                        VpcId=vpc_id, Description=f"broker run {run_id}: members talk freely, SSH in",
                        TagSpecifications=[{"ResourceType": "security-group",
                                            "Tags": run_tags(run_id, installation_id, name)}])
        sg = resp.get("GroupId") if isinstance(resp, dict) else None
        if not isinstance(sg, str) or not sg:
            raise AmbiguousCreate(PROVIDER, "create_security_group", "answer without GroupId: the create may "
                                  "have happened", hint="look it up by tag before creating again")
    except ProviderError as e:
        _record_failure(rec, rid, e, f"security group {name}")
        raise
    rec.created(rid, sg, vpc_id=vpc_id)
    api.call(ec2, "authorize_security_group_ingress", {"region": region}, GroupId=sg, IpPermissions=[
        {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": sg, "Description": "broker nodes of this run"}]},
        {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22,
         "IpRanges": [{"CidrIp": "0.0.0.0/0", "Description": "SSH (key only) from the broker CLI"}]},
    ])
    rec.event(f"aws: security group {sg} in {vpc_id} (all protocols between members, tcp/22 in)")
    pg: str | None = None
    if topology == "multi-node":  # one attempt: a blind retry of a create that succeeded gives Duplicate
        pg = placement_group(api, api.client("ec2", region, launch=True), run_id, region, rec)
    return {"region": region, "zone": zone, "vpc_id": vpc_id, "subnet_id": subnet_id,
            "security_group_id": sg, "placement_group": pg, "nodes": nodes}


def ip_permission(rule: Ingress) -> dict[str, Any]:
    """The ``IpPermissions`` entry of one :class:`broker.core.provider.Ingress` rule (IPv4 ``IpRanges`` or IPv6
    ``Ipv6Ranges`` by the CIDR)."""
    perm: dict[str, Any] = {"IpProtocol": rule.protocol, "FromPort": rule.port, "ToPort": rule.last_port}
    desc = rule.description or "broker run"
    if ":" in rule.cidr:
        perm["Ipv6Ranges"] = [{"CidrIpv6": rule.cidr, "Description": desc}]
    else:
        perm["IpRanges"] = [{"CidrIp": rule.cidr, "Description": desc}]
    return perm


def open_ingress(api: "AWSApi", net: dict[str, Any], rules: list[Ingress], rec: Recorder) -> None:
    """``authorize_security_group_ingress`` of ``rules`` on ``net["security_group_id"]`` (the run's group from
    :func:`bootstrap`); a rule already there (``InvalidPermission.Duplicate``) counts as done."""
    sg, region = net.get("security_group_id"), net.get("region")
    if not sg:
        raise ProviderError(PROVIDER, "authorize_security_group_ingress", "the run's network has no security group")
    perms = [ip_permission(r) for r in rules]
    ec2 = api.client("ec2", region)
    try:
        ec2.authorize_security_group_ingress(GroupId=sg, IpPermissions=perms)
    except Exception as e:  # noqa: BLE001
        if error_code(e)[0] != "InvalidPermission.Duplicate":
            raise map_error(e, "authorize_security_group_ingress", region=region) from e
    rec.event(f"aws: security group {sg} opened inbound: " + ", ".join(
        f"{r.protocol} {r.port}" + (f"-{r.last_port}" if r.last_port != r.port else "") + f" from {r.cidr}"
        for r in rules))


def placement_group(api: "AWSApi", ec2: Any, run_id: str, region: str, rec: Recorder) -> str | None:
    """A cluster placement group ``broker-<run_id>`` (``Duplicate`` = ours from an earlier attempt); None when the
    endpoint (an emulator) does not implement placement groups."""
    name = f"broker-{run_id}"
    rid = rec.intent("placement_group", name, region=region, attrs={"strategy": "cluster"})
    try:
        ec2.create_placement_group(GroupName=name, Strategy="cluster", TagSpecifications=[
            {"ResourceType": "placement-group",
             "Tags": run_tags(run_id, getattr(rec, "installation_id", None), name)}])
    except Exception as e:  # noqa: BLE001
        if error_code(e)[0] == "InvalidPlacementGroup.Duplicate":  # ours, from an earlier attempt of this run
            rec.created(rid, name)
            return name
        if api.unimplemented(e):
            rec.failed(rid, f"endpoint {api.endpoint_url} does not implement create_placement_group")
            rec.event("aws: placement groups not implemented by this endpoint; nodes launched without one")
            return None
        err = map_error(e, "create_placement_group", region=region, create=True)
        _record_failure(rec, rid, err, f"placement group {name}")
        raise err from e
    rec.created(rid, name)
    rec.event(f"aws: cluster placement group {name}")
    return name


def delete_security_group(api: "AWSApi", group_id: str, region: str | None) -> bool:
    """True once deleted or gone; TransientError while instances still hold it (DependencyViolation) or on
    429/5xx (the core retries)."""
    ec2 = api.client("ec2", region)
    try:
        ec2.delete_security_group(GroupId=group_id)
    except Exception as e:  # noqa: BLE001
        code = error_code(e)[0]
        if code == "InvalidGroup.NotFound":
            return True
        if code == "DependencyViolation":
            raise TransientError(PROVIDER, "delete_security_group",
                                 f"{group_id} is still used by instances that are shutting down",
                                 hint="retry after the instances are terminated", code=code) from e
        raise map_error(e, "delete_security_group", region=region) from e
    return True


def delete_placement_group(api: "AWSApi", name: str, region: str | None) -> bool:
    """True once deleted or gone; TransientError while it still holds instances or on 429/5xx."""
    ec2 = api.client("ec2", region)
    try:
        ec2.delete_placement_group(GroupName=name)
    except Exception as e:  # noqa: BLE001
        code = error_code(e)[0]
        if code in ("InvalidPlacementGroup.Unknown", "InvalidPlacementGroup.NotFound"):
            return True
        if code == "InvalidPlacementGroup.InUse":
            raise TransientError(PROVIDER, "delete_placement_group", f"{name} still holds instances",
                                 hint="retry after the instances are terminated", code=code) from e
        raise map_error(e, "delete_placement_group", region=region) from e
    return True
