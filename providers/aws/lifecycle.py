"""AWS instance lifecycle: image choice, launch, describe, terminate, the tag listing reconcile reads, the lookup by
client token and the run's cleanup in dependency order.

Launch calls go through a client with ``retries={"mode": "standard", "total_max_attempts": 1}`` (botocore would
otherwise send a 500 ``InsufficientInstanceCapacity`` three times) and carry ``ClientToken`` = the ledger resource
id; the instance is also tagged :data:`TOKEN_TAG` and looked up by that tag before launching, so a retried create
after a crash or an :class:`broker.core.provider.AmbiguousCreate` returns the instance that exists instead of a second
one.  Nodes run the AWS Deep Learning AMI (Ubuntu): SSH user ``ubuntu``.
"""

from __future__ import annotations

import logging
import math
import re
from typing import TYPE_CHECKING, Any, NamedTuple

from broker.core.model import utcnow
from broker.core.prose import usd

from broker.core.provider import INSTALL_TAG, RUN_TAG, NotSupported, ProviderError, TransientError
from broker.core.nodescripts import job_done_path
from broker.providers.aws import network
from broker.providers.aws.api import PROVIDER, error_code, expect_list, expect_str, instances_of, map_error, tags_of
from broker.providers.aws.offers import list_price
from broker.providers.aws.userdata import SSH_USER, user_data_script

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from broker.providers.aws.api import AWSApi
    from broker.core.records import InstanceInfo, NodeRequest, TaggedResource

#: Tag carrying the idempotency token (the ledger resource id) on every instance broker launches.
TOKEN_TAG = "broker-client-token"
#: Tag carrying the root volume's size (GiB) broker asked for: the disk the instance's rate is priced with.
DISK_TAG = "broker-disk-gib"
#: Name patterns of the default image: the AWS Deep Learning OSS Nvidia Driver AMIs with PyTorch on the Ubuntu
#: releases broker's boot script supports (x86_64 and ARM64 names; the architecture filter picks one).
DLAMI_NAMES = ("Deep Learning OSS Nvidia Driver AMI GPU PyTorch * (Ubuntu 24.04) *",
               "Deep Learning OSS Nvidia Driver AMI GPU PyTorch * (Ubuntu 22.04) *",
               "Deep Learning ARM64 OSS Nvidia Driver AMI GPU PyTorch * (Ubuntu 24.04) *",
               "Deep Learning ARM64 OSS Nvidia Driver AMI GPU PyTorch * (Ubuntu 22.04) *")
#: The first pattern (kept for callers that name one).
DLAMI_NAME = DLAMI_NAMES[0]

_STATE_MAP = {"pending": "pending", "running": "running", "shutting-down": "terminating",
              "terminated": "terminated", "stopping": "stopped", "stopped": "stopped"}
LIVE_STATES = ["pending", "running", "shutting-down", "stopping", "stopped"]


class Image(NamedTuple):
    """The image a node boots: id, name (None when unknown), root device and its snapshot's size (GiB)."""

    image_id: str
    name: str | None
    root_device: str | None
    root_snapshot_gib: int | None


def architecture(instance_type: str) -> str:
    """``arm64`` for Graviton types (a ``g`` in the family after the generation: g5g, c7gn; Grace: ``*-gb200``),
    else ``x86_64``: the DLAMI's ``architecture`` filter value."""
    family = instance_type.split(".", 1)[0].lower()
    if re.fullmatch(r"[a-z]+\d+[a-z]*g[a-z]*", family) or re.search(r"-gb\d+", family):
        return "arm64"
    return "x86_64"


def _image(call: str, img: dict[str, Any]) -> Image:
    """An ``Images[]`` item of ``DescribeImages``: its root device and that device's snapshot size."""
    root = img.get("RootDeviceName") if isinstance(img.get("RootDeviceName"), str) else None
    size = None
    for m in img.get("BlockDeviceMappings") or []:
        ebs = m.get("Ebs") if isinstance(m, dict) else None
        if isinstance(ebs, dict) and m.get("DeviceName") == root and isinstance(ebs.get("VolumeSize"), int):
            size = int(ebs["VolumeSize"])
    return Image(expect_str(call, img, "ImageId"), img.get("Name") if isinstance(img.get("Name"), str) else None,
                 root, size)


def _deprecated(img: dict[str, Any], now: str) -> bool:
    dep = img.get("DeprecationTime")
    return isinstance(dep, str) and bool(dep) and dep <= now


def image_for(api: "AWSApi", ec2: Any, req: NodeRequest, region: str) -> Image:
    """The image for ``req``: ``req.image``, else ``AWS_AMI_ID``, else the newest PyTorch DLAMI
    (:data:`DLAMI_NAMES`, Ubuntu 24.04 or 22.04) for the instance type's architecture that is available and not
    deprecated.  Raises ProviderError naming the region, architecture and patterns when none is found (hint: set
    ``AWS_AMI_ID``), and the mapped error of ``DescribeImages``."""
    from broker.core.config import settings

    image = req.image or settings().aws_ami_id
    call = "describe_images"
    if image:
        try:
            imgs = ec2.describe_images(ImageIds=[image]).get("Images", [])
            return _image(call, imgs[0]) if imgs else Image(image, None, None, None)
        except Exception:  # noqa: BLE001 - the launch reports a bad image id itself
            return Image(image, None, None, None)
    arch = architecture(req.offer.instance_type)
    imgs = expect_list(call, api.call(ec2, call, {"region": region}, Owners=["amazon"], Filters=[
        {"Name": "name", "Values": list(DLAMI_NAMES)}, {"Name": "state", "Values": ["available"]},
        {"Name": "architecture", "Values": [arch]}]), "Images")
    now = utcnow().strftime("%Y-%m-%dT%H:%M:%S")
    imgs = [i for i in imgs if not _deprecated(i, now)]
    if not imgs:
        raise ProviderError(PROVIDER, call, f"no available PyTorch Deep Learning AMI for {arch} in {region} (owner "
                            f"amazon, names {', '.join(DLAMI_NAMES[:2])} and their ARM64 forms)",
                            hint="set AWS_AMI_ID to an Ubuntu GPU image with PyTorch in that region (and AWS_SSH_USER "
                                 "when its login user is not ubuntu)")
    best = max(imgs, key=lambda i: str(i.get("CreationDate", "")))
    return _image(call, best)


def find_by_token(api: "AWSApi", client_token: str, region: str | None = None) -> str | None:
    """A live instance launched with ``client_token`` (tag ``broker-client-token``), if any."""
    ec2 = api.client("ec2", region)
    call = "describe_instances"
    resp = api.call(ec2, call, {"region": region},
                    Filters=[{"Name": f"tag:{TOKEN_TAG}", "Values": [client_token]},
                             {"Name": "instance-state-name", "Values": LIVE_STATES}])
    for i in instances_of(call, resp):
        return i["InstanceId"]
    return None


def create_instance(api: "AWSApi", req: NodeRequest, region: str, zone: str | None, *,
                    ssh_user: str = SSH_USER, workroot: str | None = None) -> str:
    """``run_instances`` for one node (one attempt, ``ClientToken``, tags RUN_TAG, INSTALL_TAG, TOKEN_TAG, Name);
    returns the instance id.  An instance already launched with the token is returned instead.  ``ssh_user``: the
    image's login user (the key goes into its home, the boot-done marker into its workroot, or ``workroot``).

    Raises CapacityError (InsufficientInstanceCapacity: next zone; Unsupported: not offered), QuotaError
    (VcpuLimitExceeded..., ``scope`` = region + family bucket, with the ``broker quota request`` command),
    AuthError, AmbiguousCreate (5xx / timeout: verify with :func:`find_by_token`), TransientError."""
    o = req.offer
    existing = find_by_token(api, req.client_token, region)
    if existing:
        return existing
    ec2 = api.client("ec2", region)
    img = image_for(api, ec2, req, region)
    image, root_dev = img.image_id, img.root_device
    # the root volume cannot be smaller than the image's snapshot (RunInstances: InvalidBlockDeviceMapping)
    disk_gib = max(int(math.ceil(req.disk_gib)), img.root_snapshot_gib or 0)
    _log.info("aws: %s in %s boots image %s (%s), root volume %d GiB", o.instance_type, region, image,
              img.name or "named by AWS_AMI_ID / the recipe", disk_gib)
    tags = network.run_tags(req.run_id, req.installation_id, req.name) + [
        {"Key": TOKEN_TAG, "Value": req.client_token}]
    if root_dev:
        tags.append({"Key": DISK_TAG, "Value": str(disk_gib)})
    tags += [{"Key": k, "Value": v} for k, v in req.tags.items()
             if k not in (RUN_TAG, INSTALL_TAG, "Name", TOKEN_TAG, DISK_TAG)]
    params: dict[str, Any] = {
        "ImageId": image, "InstanceType": o.instance_type, "MinCount": 1, "MaxCount": 1,
        "InstanceInitiatedShutdownBehavior": "terminate", "ClientToken": req.client_token[:64],
        "UserData": user_data_script(req.deadline, req.grace_seconds, req.ssh_public_key, req.onstart,
                                     idle_minutes=req.idle_minutes, ssh_user=ssh_user,
                                     done_file=job_done_path(ssh_user, workroot)),
        "TagSpecifications": [{"ResourceType": "instance", "Tags": tags},
                              {"ResourceType": "volume", "Tags": tags}],
    }
    placement: dict[str, str] = {}
    if zone:
        placement["AvailabilityZone"] = zone
    if req.network.get("placement_group"):
        placement["GroupName"] = req.network["placement_group"]
    if placement:
        params["Placement"] = placement
    if req.network.get("security_group_id"):
        params["SecurityGroupIds"] = [req.network["security_group_id"]]
    if req.network.get("subnet_id"):
        params["SubnetId"] = req.network["subnet_id"]
    if root_dev:
        params["BlockDeviceMappings"] = [{"DeviceName": root_dev, "Ebs": {
            "VolumeSize": disk_gib, "VolumeType": "gp3", "DeleteOnTermination": True}}]
    if o.attrs.get("market") == "spot" or o.attrs.get("interruptible") is True:
        # one-time + terminate: a preempted node is gone (billing ends), broker rents again; MaxPrice = the plan's
        # bid caps what the spot price can bill (AWS interrupts instead: instance-terminated-by-price)
        spot_options: dict[str, Any] = {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}
        cap = o.attrs.get("bid_usd_per_hour")
        if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0.001:
            spot_options["MaxPrice"] = f"{cap:.4f}"
        params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": spot_options}
    launch = api.client("ec2", region, launch=True)
    ctx = {"instance_type": o.instance_type, "vcpus": o.vcpus or None, "nodes": int(req.network.get("nodes") or 1),
           "zone": zone, "region": region, "create": True}
    try:
        resp = api.call(launch, "run_instances", ctx, **params)
    except ProviderError as e:
        if e.code == "InvalidBlockDeviceMapping":
            raise ProviderError(
                PROVIDER, "run_instances", f"image {image} ({img.name or 'no name'}) refused a {disk_gib} GiB root "
                f"volume: {e.message}", code=e.code, status=e.status,
                hint=(f"its root snapshot is {img.root_snapshot_gib} GiB" if img.root_snapshot_gib else
                      "its root snapshot size could not be read") + "; set the recipe's disk_gib to at least the "
                      "snapshot's size, or AWS_AMI_ID to an image with a smaller root snapshot") from e
        raise
    try:
        return expect_str("run_instances", expect_list("run_instances", resp, "Instances")[0], "InstanceId")
    except (ProviderError, IndexError):
        from broker.core.provider import AmbiguousCreate

        raise AmbiguousCreate(PROVIDER, "run_instances", "answer without an instance id: the launch may have "
                              "happened", hint=f"look it up by client token {req.client_token}") from None


def describe_instance(api: "AWSApi", provider_id: str, region: str | None, ssh_user: str = SSH_USER) -> InstanceInfo:
    """State (pending/running/terminating/terminated/stopped) and addresses, logins as ``ssh_user``; ``terminated``
    when unknown to EC2.
    An answer broker cannot read is a ProviderError (never "terminated")."""
    from broker.core.records import InstanceInfo

    ec2 = api.client("ec2", region)
    call = "describe_instances"
    try:
        resp = ec2.describe_instances(InstanceIds=[provider_id])
    except Exception as e:  # noqa: BLE001
        if error_code(e)[0] in ("InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"):
            return InstanceInfo(provider_id=provider_id, state="terminated", raw_state="not-found",
                                ssh_user=ssh_user, message="instance not found (gone)")
        raise map_error(e, call, region=region) from e
    inst = instances_of(call, resp)
    if not inst:
        return InstanceInfo(provider_id=provider_id, state="terminated", raw_state="not-found", ssh_user=ssh_user)
    i = inst[0]
    state = i.get("State")
    raw = state.get("Name") if isinstance(state, dict) else None
    if not isinstance(raw, str):
        from broker.providers.aws.api import unreadable

        raise unreadable(call, f"instance {provider_id} without State.Name")
    pub = i.get("PublicIpAddress")
    reason = (i.get("StateReason") or {}).get("Message")
    # what the instance bills (the provider's rate, not the plan's): the core records it in the ledger
    rate = instance_rate(api, ec2, i, region)
    return InstanceInfo(provider_id=provider_id, state=_STATE_MAP.get(raw, "unknown"), raw_state=raw,
                        public_ip=pub, private_ip=i.get("PrivateIpAddress"), ssh_host=pub, ssh_port=22,
                        ssh_user=ssh_user, message=reason, usd_per_hour=rate)


#: seconds a spot price read from ``DescribeSpotPriceHistory`` is reused for describe / list
SPOT_PRICE_TTL_S = 300.0


def spot_rate(api: "AWSApi", ec2: Any, i: dict[str, Any], region: str | None) -> float | None:
    """$/h a running spot instance bills: the current spot price of its type in its zone
    (``DescribeSpotPriceHistory``, reused for :data:`SPOT_PRICE_TTL_S`), else its spot request's ``SpotPrice``
    (the launch's cap: an upper bound), else None (unknown).  Never the on-demand list price."""
    import time

    from broker.providers.aws.offers import spot_prices

    it, zone = i.get("InstanceType"), (i.get("Placement") or {}).get("AvailabilityZone")
    region = region or api.region
    if isinstance(it, str) and isinstance(zone, str):
        cache = api.__dict__.setdefault("_spot_rates", {})
        hit = cache.get((region, it, zone))
        if hit is not None and time.monotonic() - hit[1] < SPOT_PRICE_TTL_S:
            return hit[0]
        try:
            price = spot_prices(api, [it], region).get((it, zone))
        except ProviderError as e:
            _log.info("aws: spot price of %s in %s not read (%s)", it, zone, e.message)
            price = None
        if price is not None:
            cache[(region, it, zone)] = (price[0], time.monotonic())
            return price[0]
    req_id = i.get("SpotInstanceRequestId")
    if isinstance(req_id, str) and req_id:
        try:
            items = ec2.describe_spot_instance_requests(SpotInstanceRequestIds=[req_id]).get(
                "SpotInstanceRequests") or []
            cap = float(items[0]["SpotPrice"]) if items and items[0].get("SpotPrice") else None
        except Exception as e:  # noqa: BLE001 - a rate only: unknown when unreadable
            _log.info("aws: spot request %s not read (%s)", req_id, error_code(e)[0])
            cap = None
        return cap
    return None


def disk_rate(ec2: Any, i: dict[str, Any]) -> float | None:
    """$/h of the instance's EBS volumes: the root size broker asked for (tag :data:`DISK_TAG`), else the sizes
    ``DescribeVolumes`` reports, x :data:`EBS_USD_PER_GB_MONTH` / 730 h; None when neither can be read."""
    try:
        tags = tags_of("describe_instances", i)
        if tags.get(DISK_TAG, "").isdigit():
            return int(tags[DISK_TAG]) * EBS_USD_PER_GB_MONTH / 730.0
        vols = [m["Ebs"]["VolumeId"] for m in i.get("BlockDeviceMappings") or []
                if isinstance(m.get("Ebs"), dict) and m["Ebs"].get("VolumeId")]
        if not vols:
            return None
        sizes = [float(v.get("Size") or 0) for v in ec2.describe_volumes(VolumeIds=vols).get("Volumes", [])]
    except Exception as e:  # noqa: BLE001 - a rate only: unknown when unreadable
        _log.info("aws: volumes of %s not read (%s)", i.get("InstanceId"), error_code(e)[0])
        return None
    return sum(sizes) * EBS_USD_PER_GB_MONTH / 730.0 if sizes else None


def instance_rate(api: "AWSApi", ec2: Any, i: dict[str, Any], region: str | None) -> float | None:
    """$/h one ``DescribeInstances`` item bills, its disk included (the adapter's reported rate includes storage):
    a spot instance (``InstanceLifecycle`` ``spot``) at :func:`spot_rate`, an on-demand one at its type's list
    price, plus :func:`disk_rate`.  None when either part is unknown (never the plan's or another market's
    price)."""
    compute = spot_rate(api, ec2, i, region) if i.get("InstanceLifecycle") == "spot" else \
        list_price(i.get("InstanceType"))
    if compute is None:
        return None
    disk = disk_rate(ec2, i)
    return None if disk is None else round(compute + disk, 6)


#: ``StateReason.Code`` of an instance EC2 took back (interruptible.md 2.6): terminated / stopped by Spot
SPOT_STATE_REASONS = ("Server.SpotInstanceTermination", "Server.SpotInstanceShutdown")
#: spot request ``Status.Code`` values that mean an interruption (done or under its two-minute notice)
SPOT_REQUEST_INTERRUPTED = ("instance-terminated-by-price", "instance-terminated-no-capacity",
                            "instance-terminated-capacity-oversubscribed", "instance-terminated-launch-group-constraint",
                            "instance-stopped-by-price", "instance-stopped-no-capacity",
                            "instance-stopped-capacity-oversubscribed", "marked-for-termination", "marked-for-stop")


def preemption(api: "AWSApi", provider_id: str, region: str | None) -> str | None:
    """EC2's own reason when it interrupted spot instance ``provider_id``: ``StateReason.Code``
    ``Server.SpotInstanceTermination`` / ``Server.SpotInstanceShutdown``, or its spot request's ``Status.Code``
    (``instance-terminated-by-price``, ``-no-capacity``, ``marked-for-termination`` under the two-minute notice,
    :data:`SPOT_REQUEST_INTERRUPTED`).  None for an on-demand instance, a running spot instance without a notice,
    one terminated by broker (``Client.UserInitiatedShutdown``) or the OS, and one EC2 no longer knows.  Raises
    ProviderError (AuthError, TransientError) when a call fails or its answer cannot be read."""
    ec2 = api.client("ec2", region)
    call = "describe_instances"
    try:
        resp = ec2.describe_instances(InstanceIds=[provider_id])
    except Exception as e:  # noqa: BLE001
        if error_code(e)[0] in ("InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"):
            return None
        raise map_error(e, call, region=region) from e
    inst = instances_of(call, resp)
    if not inst:
        return None
    i = inst[0]
    if i.get("InstanceLifecycle") != "spot":
        return None
    sr = i.get("StateReason") if isinstance(i.get("StateReason"), dict) else {}
    state = (i.get("State") or {}).get("Name") if isinstance(i.get("State"), dict) else None
    if sr.get("Code") in SPOT_STATE_REASONS:
        return f"spot interruption: {sr.get('Code')} ({sr.get('Message') or 'no message'}), state {state}"
    req_id = i.get("SpotInstanceRequestId")
    if not isinstance(req_id, str) or not req_id:
        return None  # moto gives none; real RunInstances spot instances carry one
    call = "describe_spot_instance_requests"
    try:
        r = ec2.describe_spot_instance_requests(SpotInstanceRequestIds=[req_id])
    except Exception as e:  # noqa: BLE001
        if error_code(e)[0] == "InvalidSpotInstanceRequestID.NotFound":
            return None
        raise map_error(e, call, region=region) from e
    for item in expect_list(call, r, "SpotInstanceRequests"):
        status = item.get("Status") if isinstance(item.get("Status"), dict) else {}
        code = status.get("Code")
        if code in SPOT_REQUEST_INTERRUPTED:
            return (f"spot interruption: request {req_id} status {code} ({status.get('Message') or 'no message'}), "
                    f"instance state {state}")
    return None


def terminate_instance(api: "AWSApi", provider_id: str, region: str | None) -> bool:
    """True once describe shows ``terminated`` (or the id is gone); False while shutting down; 429/5xx are
    TransientError (the core retries)."""
    ec2 = api.client("ec2", region)
    try:
        ec2.terminate_instances(InstanceIds=[provider_id])
    except Exception as e:  # noqa: BLE001
        if error_code(e)[0] in ("InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"):
            return True
        raise map_error(e, "terminate_instances", region=region) from e
    return describe_instance(api, provider_id, region).state == "terminated"


#: $/GB/month of an EBS volume (gp3, us-east-1), the snapshot's documented ASSUMPTION; other types bill more
EBS_USD_PER_GB_MONTH = 0.08


def set_running(api: "AWSApi", provider_id: str, region: str | None, run: bool) -> None:
    """``StartInstances`` (``run``) or ``StopInstances``; a stopped instance stays stopped, and so on (EC2 accepts
    both as no-ops).  ``IncorrectInstanceState`` (e.g. stopping an instance that is still pending) and 429/5xx
    are mapped (TransientError / ProviderError); an unknown id is a ProviderError naming it."""
    ec2 = api.client("ec2", region)
    call = "start_instances" if run else "stop_instances"
    try:
        (ec2.start_instances if run else ec2.stop_instances)(InstanceIds=[provider_id])
    except Exception as e:  # noqa: BLE001
        if error_code(e)[0] in ("InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"):
            from broker.core.provider import ProviderError

            raise ProviderError("aws", call, f"instance {provider_id} no longer exists",
                                hint="`broker down RUN` records it gone") from None
        raise map_error(e, call, region=region) from e


def stopped_rate(api: "AWSApi", provider_id: str, region: str | None,
                 attrs: dict[str, Any] | None) -> tuple[float, str]:
    """$/h of ``provider_id`` while stopped: its EBS volumes (``DescribeVolumes`` sizes, GiB) x
    :data:`EBS_USD_PER_GB_MONTH` / 730 h; ``attrs["storage_usd_per_hour"]`` when EC2 lists no volume."""
    ec2 = api.client("ec2", region)
    call = "describe_instances"
    try:
        inst = instances_of(call, ec2.describe_instances(InstanceIds=[provider_id]))
        vols = [m["Ebs"]["VolumeId"] for i in inst for m in i.get("BlockDeviceMappings") or []
                if isinstance(m.get("Ebs"), dict) and m["Ebs"].get("VolumeId")]
        sizes = [float(v.get("Size") or 0) for v in
                 ec2.describe_volumes(VolumeIds=vols).get("Volumes", [])] if vols else []
    except Exception as e:  # noqa: BLE001
        raise map_error(e, call, region=region) from e
    if sizes:
        gb = sum(sizes)
        return (gb * EBS_USD_PER_GB_MONTH / 730.0,
                f"EBS {gb:g} GiB x {usd(EBS_USD_PER_GB_MONTH, up_to=4)}/GB/month (gp3 price: broker's assumption)")
    a = attrs or {}
    if a.get("storage_usd_per_hour"):
        return float(a["storage_usd_per_hour"]), "EBS (recorded storage rate)"
    gb = float(a.get("disk_gib") or 0)
    return (gb * EBS_USD_PER_GB_MONTH / 730.0,
            f"EBS {gb:g} GiB (recorded disk) x {usd(EBS_USD_PER_GB_MONTH, up_to=4)}/GB/month")


def terminate(api: "AWSApi", kind: str, provider_id: str, region: str | None) -> bool:
    """Idempotent terminate / delete of one ``instance``, ``security_group`` or ``placement_group``."""
    if kind == "instance":
        return terminate_instance(api, provider_id, region)
    if kind == "security_group":
        return network.delete_security_group(api, provider_id, region)
    if kind == "placement_group":
        return network.delete_placement_group(api, provider_id, region)
    raise NotSupported(PROVIDER, "terminate", f"unknown resource kind {kind!r}")


def list_tagged(api: "AWSApi", run_id: str | None = None) -> list[TaggedResource]:
    """Instances (not terminated), security groups and placement groups carrying RUN_TAG (= ``run_id`` when
    given) in the configured region; ``installation_id`` from INSTALL_TAG.  An answer broker cannot read (a
    missing list, items without ids) is a ProviderError naming the call, never an empty list."""
    from broker.core.records import TaggedResource

    region = api.region
    ec2 = api.client("ec2", region)
    tag_filter = ({"Name": f"tag:{RUN_TAG}", "Values": [run_id]} if run_id
                  else {"Name": "tag-key", "Values": [RUN_TAG]})
    out: list[TaggedResource] = []
    token = None
    call = "describe_instances"
    while True:
        params: dict[str, Any] = {"Filters": [tag_filter, {"Name": "instance-state-name", "Values": LIVE_STATES}]}
        if token:
            params["NextToken"] = token
        resp = api.call(ec2, call, {"region": region}, **params)
        for i in instances_of(call, resp):
            tags = tags_of(call, i)
            out.append(TaggedResource(provider=PROVIDER, kind="instance", provider_id=i["InstanceId"],
                                      run_id=tags.get(RUN_TAG), region=region,
                                      state=(i.get("State") or {}).get("Name"), created_at=i.get("LaunchTime"),
                                      usd_per_hour=instance_rate(api, ec2, i, region), name=tags.get("Name"),
                                      installation_id=tags.get(INSTALL_TAG)))
        token = resp.get("NextToken")
        if not token:
            break
    call = "describe_security_groups"
    sgs = api.call(ec2, call, {"region": region}, Filters=[tag_filter])
    for g in expect_list(call, sgs, "SecurityGroups"):
        tags = tags_of(call, g)
        out.append(TaggedResource(provider=PROVIDER, kind="security_group", provider_id=expect_str(call, g, "GroupId"),
                                  run_id=tags.get(RUN_TAG), region=region, name=g.get("GroupName"),
                                  installation_id=tags.get(INSTALL_TAG)))
    call = "describe_placement_groups"
    try:  # one attempt (emulators without placement groups answer 500s that botocore would retry)
        pgs = api.client("ec2", region, launch=True).describe_placement_groups(Filters=[tag_filter])
    except Exception as e:  # noqa: BLE001
        if not api.unimplemented(e):
            raise map_error(e, call, region=region) from e
        pgs = {"PlacementGroups": []}
    for g in expect_list(call, pgs, "PlacementGroups"):
        tags = tags_of(call, g)
        name = expect_str(call, g, "GroupName")
        out.append(TaggedResource(provider=PROVIDER, kind="placement_group", provider_id=name,
                                  run_id=tags.get(RUN_TAG), region=region, state=g.get("State"), name=name,
                                  installation_id=tags.get(INSTALL_TAG)))
    return out


#: EC2 error codes that mean "no such object" for the describe calls of :func:`tagged_resource`
_NOT_FOUND = ("InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed", "InvalidGroup.NotFound",
              "InvalidGroupId.Malformed", "InvalidPlacementGroup.Unknown", "InvalidPlacementGroup.NotFound")


def tagged_resource(api: "AWSApi", kind: str, provider_id: str, region: str | None,
                    run_id: str | None = None) -> TaggedResource | None:
    """One instance / security group / placement group with its tags, read in ``region``; None when EC2 does not
    hold it (or it is terminated, or it carries no RUN_TAG / another run's when ``run_id`` is given).  Other kinds:
    NotSupported.  An unreadable answer is a ProviderError."""
    from broker.core.records import TaggedResource

    ec2 = api.client("ec2", region)
    ops = {"instance": ("describe_instances", {"InstanceIds": [provider_id]}),
           "security_group": ("describe_security_groups", {"GroupIds": [provider_id]}),
           "placement_group": ("describe_placement_groups", {"GroupNames": [provider_id]})}
    if kind not in ops:
        raise NotSupported(PROVIDER, f"describe {kind}", "broker creates no such AWS resource")
    call, params = ops[kind]
    try:
        resp = getattr(ec2, call)(**params)
    except Exception as e:  # noqa: BLE001
        if error_code(e)[0] in _NOT_FOUND:
            return None
        raise map_error(e, call, region=region) from e
    if kind == "instance":
        items = instances_of(call, resp)
        items = [i for i in items if (i.get("State") or {}).get("Name") != "terminated"]
    else:
        items = expect_list(call, resp, "SecurityGroups" if kind == "security_group" else "PlacementGroups")
    for i in items:
        tags = tags_of(call, i)
        if RUN_TAG not in tags or (run_id is not None and tags[RUN_TAG] != run_id):
            continue
        return TaggedResource(provider=PROVIDER, kind=kind, provider_id=provider_id, run_id=tags.get(RUN_TAG),
                              region=region, state=(i.get("State") or {}).get("Name")
                              if isinstance(i.get("State"), dict) else i.get("State"),
                              installation_id=tags.get(INSTALL_TAG))
    return None


def delete_run_network(api: "AWSApi", run_id: str) -> list[TaggedResource]:
    """The run's own cleanup: everything tagged ``run_id`` in dependency order (instances, then security groups,
    then placement groups).  Returns the instances still shutting down; the groups wait for them (TransientError
    when a group is still in use: retry later)."""
    from broker.core.records import TaggedResource

    left: list[TaggedResource] = []
    for t in sorted(list_tagged(api, run_id), key=lambda t: network.delete_rank(t.kind)):
        if t.kind != "instance" and left:
            raise TransientError(PROVIDER, "delete_run_network", f"instances of run {run_id} are still shutting "
                                 "down", hint="retry when they are terminated")
        if not terminate(api, t.kind, t.provider_id, t.region):
            left.append(t)
    return left
