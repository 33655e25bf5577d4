"""OCI instance lifecycle: image choice, launch, describe, terminate, the tag listing reconcile reads, the lookup by
client token and the run's network cleanup in dependency order.

A launch is sent once (no SDK retry) with ``opc_retry_token`` = the ledger resource id and the same id in the
freeform tag :data:`TOKEN_TAG`: after an :class:`broker.core.provider.AmbiguousCreate` the core finds what exists with
:func:`find_by_token` or :func:`list_tagged` before it creates again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from broker.core.prose import usd
from broker.core.provider import INSTALL_TAG, RUN_TAG, ProviderError, TransientError
from broker.providers.oci import network
from broker.providers.oci.offers import list_price, shape_gpus
from broker.providers.oci.scripts import cloud_init
from broker.providers.oci.sdk import PROVIDER, expect_fields, expect_list, expect_tags

if TYPE_CHECKING:
    from broker.providers.oci.sdk import OCIApi
    from broker.core.records import InstanceInfo, NodeRequest, TaggedResource

def _b64(text: str) -> str:
    """``text`` as OCI's ``user_data`` metadata wants it (base64 of the UTF-8 bytes); base64 is imported here, not
    with the module: ``broker plan`` loads every adapter and never launches."""
    import base64

    return base64.b64encode(text.encode()).decode()


#: Freeform tag carrying the idempotency token (the ledger resource id) on every instance broker launches.
TOKEN_TAG = "broker-client-token"

_STATE = {"PROVISIONING": "pending", "STARTING": "pending", "MOVING": "pending", "CREATING_IMAGE": "running",
          "RUNNING": "running", "STOPPING": "stopped", "STOPPED": "stopped", "TERMINATING": "terminating",
          "TERMINATED": "terminated"}


def image_for(api: "OCIApi", shape: str, image_id: str | None) -> tuple[str, str]:
    """(image OCID, ssh user): ``image_id`` (``OCI_IMAGE_ID``) or the newest platform image for ``shape`` whose
    name says GPU (Oracle Linux GPU images ship the NVIDIA driver and CUDA)."""
    cc = api.client("compute")
    if image_id:
        try:
            img = cc.get_image(image_id).data
            os_name = img.operating_system or ""
        except Exception:  # noqa: BLE001 - the launch itself reports a bad image id
            os_name = ""
        return image_id, "ubuntu" if "ubuntu" in os_name.lower() else "opc"
    call = "list_images"
    imgs = api.all_pages(call, cc.list_images, api.compartment, shape=shape, operating_system="Oracle Linux",
                         sort_by="TIMECREATED", sort_order="DESC", lifecycle_state="AVAILABLE")
    for i in imgs:
        expect_fields(call, i, "id")
    gpu = [i for i in imgs if "gpu" in (i.display_name or "").lower()]
    pick = (gpu or imgs or [None])[0]
    if pick is None:
        raise ProviderError(PROVIDER, call, f"no Oracle Linux image found for shape {shape}",
                            hint="set OCI_IMAGE_ID to an image OCID that supports this shape")
    return pick.id, "ubuntu" if "ubuntu" in (pick.operating_system or "").lower() else "opc"


def create_instance(api: "OCIApi", req: NodeRequest, *, ad: str, subnet: str, image: tuple[str, str],
                    instance_principal: bool, workroot: str | None) -> str:
    """``launch_instance`` of ``req.offer`` in AD ``ad`` into ``subnet`` with a public IP, the SSH key, cloud-init
    (:func:`broker.providers.oci.scripts.cloud_init`) and freeform tags RUN_TAG, INSTALL_TAG (when
    ``req.installation_id``), TOKEN_TAG.  ``opc_retry_token`` = ``client_token``; sent once.

    Returns the instance OCID.  Raises CapacityError, QuotaError (``scope`` = the AD), AuthError, AmbiguousCreate
    (5xx / timeout after sending: verify with :func:`find_by_token`), TransientError, ProviderError."""
    import oci

    from broker.core.nodescripts import job_done_path

    m = oci.core.models
    shape = req.offer.instance_type
    cidr = req.network.get("vcn_cidr") or network.VCN_CIDR
    image_id, user = image
    ud = cloud_init(cidr, deadline=req.deadline, grace_seconds=req.grace_seconds,
                    instance_principal=instance_principal, onstart=req.onstart, region=api.region,
                    idle_minutes=req.idle_minutes, done_file=job_done_path(user, workroot), ssh_user=user)
    tags = {**req.tags, **network.run_tags(req.run_id, req.installation_id), "broker-node": str(req.node_index),
            "broker-ssh-user": user, TOKEN_TAG: req.client_token}
    details = m.LaunchInstanceDetails(
        compartment_id=api.compartment, availability_domain=ad, shape=shape, display_name=req.name,
        source_details=m.InstanceSourceViaImageDetails(image_id=image_id,
                                                       boot_volume_size_in_gbs=max(50, int(req.disk_gib))),
        create_vnic_details=m.CreateVnicDetails(subnet_id=subnet, assign_public_ip=True),
        metadata={"ssh_authorized_keys": req.ssh_public_key,
                  "user_data": _b64(ud)},
        freeform_tags=tags)
    if req.offer.attrs.get("interruptible") is True:
        # preemptible: OCI may reclaim it at any time; TERMINATE (the only action) without keeping the boot volume,
        # so nothing bills after a preemption and broker rents again
        details.preemptible_instance_config = m.PreemptibleInstanceConfigDetails(
            preemption_action=m.TerminatePreemptionAction(preserve_boot_volume=False))
    cc = api.client("compute")
    call = "launch_instance"
    try:
        with api.errors(call, scope=ad, shape=shape, gpus=shape_gpus(shape), create=True):
            inst = cc.launch_instance(details, opc_retry_token=req.client_token[:64],
                                      retry_strategy=oci.retry.NoneRetryStrategy()).data
    except TransientError as e:
        if e.status == 429:  # refused, nothing made: the core retries in this AD after OCI's Retry-After
            e.retry_after_s = retry_after_s(e.__cause__)  # type: ignore[attr-defined]
        raise
    return network.created_object(call, inst).id


def retry_after_s(e: BaseException | None) -> float | None:
    """Seconds from a ``Retry-After`` header of an SDK ServiceError (None when it carries none)."""
    headers = getattr(e, "headers", None) or {}
    try:
        value = next((v for k, v in dict(headers).items() if str(k).lower() == "retry-after"), None)
        return max(0.0, float(value)) if value is not None else None
    except (TypeError, ValueError):
        return None


def instance_state(api: "OCIApi", provider_id: str) -> str:
    """The broker state of one instance from ``get_instance`` alone (``terminated`` when gone)."""
    cc = api.client("compute")
    try:
        inst = api.call("get_instance", cc.get_instance, provider_id).data
    except ProviderError as e:
        if e.status == 404:
            return "terminated"
        raise
    return _STATE.get(expect_fields("get_instance", inst, "lifecycle_state").lifecycle_state, "unknown")


def describe_instance(api: "OCIApi", provider_id: str) -> InstanceInfo:
    """State (pending/running/stopped/terminating/terminated) and, when running, the primary VNIC's private and
    public IP.  A 404 means gone: ``terminated``.  An answer without a lifecycle state is a ProviderError."""
    from broker.core.records import InstanceInfo

    cc = api.client("compute")
    call = "get_instance"
    try:
        inst = api.call(call, cc.get_instance, provider_id).data
    except ProviderError as e:
        if e.status == 404:
            return InstanceInfo(provider_id=provider_id, state="terminated", raw_state="NotFound",
                                message="the instance no longer exists")
        raise
    expect_fields(call, inst, "lifecycle_state")
    raw = inst.lifecycle_state
    state = _STATE.get(raw, "unknown")
    user = expect_tags(call, inst).get("broker-ssh-user", "opc")
    rate = list_price(inst.shape)
    if rate is not None and getattr(inst, "preemptible_instance_config", None) is not None:
        from broker.providers.oci.offers import PREEMPTIBLE_FRACTION

        rate = round(rate * PREEMPTIBLE_FRACTION, 6)  # preemptible capacity bills half the on-demand rate
    info = InstanceInfo(provider_id=provider_id, state=state, raw_state=raw, ssh_user=user, usd_per_hour=rate)
    if state == "running":
        vn = api.client("vnet")
        atts = api.all_pages("list_vnic_attachments", cc.list_vnic_attachments, inst.compartment_id,
                             instance_id=provider_id)
        vnics = [api.call("get_vnic", vn.get_vnic, a.vnic_id).data for a in atts
                 if a.lifecycle_state == "ATTACHED" and a.vnic_id]
        vnics.sort(key=lambda v: not v.is_primary)
        if vnics:
            info.private_ip, info.public_ip = vnics[0].private_ip, vnics[0].public_ip
            info.ssh_host = vnics[0].public_ip or vnics[0].private_ip
    return info


def preemption(api: "OCIApi", provider_id: str, terminated_here: bool) -> str | None:
    """OCI's word that it reclaimed preemptible instance ``provider_id``: the instance carries a
    ``preemptibleInstanceConfig`` and is TERMINATING / TERMINATED although broker did not terminate it
    (``terminated_here``: this adapter sent the terminate).  OCI's Instance has no termination-reason field
    (interruptible.md 3.5): a preemptible instance that ends without broker's terminate can only have been
    reclaimed.  None for an on-demand instance, a live one, one broker terminated, or one OCI no longer knows
    (404).  Raises ProviderError (AuthError, TransientError) when the call fails or the answer is unreadable."""
    cc = api.client("compute")
    call = "get_instance"
    try:
        inst = api.call(call, cc.get_instance, provider_id).data
    except ProviderError as e:
        if e.status == 404 and e.code != "NotAuthenticated":
            return None
        raise
    expect_fields(call, inst, "lifecycle_state")
    pre = getattr(inst, "preemptible_instance_config", None)
    if pre is None or terminated_here or inst.lifecycle_state not in ("TERMINATING", "TERMINATED"):
        return None
    action = getattr(getattr(pre, "preemption_action", None), "type", None) or "?"
    return (f"preempted: OCI reclaimed preemptible instance {provider_id} (lifecycleState {inst.lifecycle_state}, "
            f"preemptionAction {action}) without a terminate from broker")


def terminate_instance(api: "OCIApi", provider_id: str) -> bool:
    """``terminate_instance(id, preserve_boot_volume=False)``: True when already gone (404, or TERMINATED after a
    409), else False (termination is asynchronous: poll :func:`describe_instance`).  429/5xx: TransientError."""
    cc = api.client("compute")
    try:
        api.call("terminate_instance", cc.terminate_instance, provider_id, preserve_boot_volume=False)
    except ProviderError as e:
        if e.status == 404 and e.code != "NotAuthenticated":
            return True
        if e.status != 409:
            raise
        # 409 IncorrectState: already terminating or terminated (else the 409 stays a TransientError: retry)
        state = instance_state(api, provider_id)
        if state in ("terminated", "terminating"):
            return state == "terminated"
        raise
    return False


def _tagged(api: "OCIApi", kind: str, call: str, r: Any, run_id: str | None) -> TaggedResource | None:
    from broker.core.records import TaggedResource

    expect_fields(call, r, "id")
    tags = expect_tags(call, r)
    tag = tags.get(RUN_TAG)
    if tag is None or (run_id is not None and tag != run_id):
        return None
    if r.lifecycle_state in ("TERMINATED",):
        return None
    return TaggedResource(provider=PROVIDER, kind=kind, provider_id=r.id, run_id=tag, region=api.region,
                          state=r.lifecycle_state, created_at=r.time_created, name=r.display_name,
                          usd_per_hour=list_price(getattr(r, "shape", None)), installation_id=tags.get(INSTALL_TAG))


def list_instances(api: "OCIApi") -> list[Any]:
    cc = api.client("compute")
    return expect_list("list_instances", api.all_pages("list_instances", cc.list_instances, api.compartment))


def list_tagged(api: "OCIApi", run_id: str | None = None) -> list[TaggedResource]:
    """Instances (not TERMINATED) and network objects (VCNs, subnets, internet gateways, security lists) in the
    compartment whose freeform tag RUN_TAG is ``run_id`` (any value when None); ``installation_id`` from
    INSTALL_TAG.  An answer broker cannot read (not a list, objects without ``id``, tags that are not an object)
    is a ProviderError, never an empty list."""
    from broker.core.records import TaggedResource

    out: list[TaggedResource] = []
    for r in list_instances(api):
        t = _tagged(api, "instance", "list_instances", r, run_id)
        if t is not None:
            out.append(t)
    for kind, call, r in network.list_network(api):
        t = _tagged(api, kind, call, r, run_id)
        if t is not None:
            out.append(t)
    return out


def find_by_token(api: "OCIApi", client_token: str) -> str | None:
    """The OCID of a live (not TERMINATED) instance launched with ``client_token`` (tag :data:`TOKEN_TAG`), if
    any: how the core verifies an ambiguous launch."""
    for r in list_instances(api):
        expect_fields("list_instances", r, "id")
        if expect_tags("list_instances", r).get(TOKEN_TAG) == client_token and r.lifecycle_state != "TERMINATED":
            return r.id
    return None


def delete_run_network(api: "OCIApi", run_id: str, conflict_wait_s: float) -> list[TaggedResource]:
    """The run's own network cleanup: every tagged object of ``run_id`` deleted in dependency order (instances
    terminated first, then subnets, security lists, gateways, the VCN last).  Returns what is not confirmed gone
    yet (instances still terminating); TransientError when a delete still conflicts (retry later)."""
    from broker.core.records import TaggedResource

    left: list[TaggedResource] = []
    items = sorted(list_tagged(api, run_id), key=lambda t: network.delete_rank(t.kind))
    for t in items:
        if t.kind == "instance":
            if not terminate_instance(api, t.provider_id):
                left.append(t)
            continue
        if any(x.kind == "instance" for x in left):
            raise TransientError(PROVIDER, "delete_run_network", f"instances of run {run_id} are still terminating",
                                 hint="retry when they are TERMINATED")
        network.delete_network_object(api, t.kind, t.provider_id, None, conflict_wait_s)
    return left



#: $/GB/month of a boot volume (Balanced: 0.0255 storage + 10 VPU x 0.0017), the snapshot's documented ASSUMPTION
BOOT_VOLUME_USD_PER_GB_MONTH = 0.0425


def keeps_billing_stopped(shape: str | None) -> bool:
    """Whether OCI keeps billing ``shape`` in full while it is stopped: every GPU shape except ``VM.GPU.A10.*``
    (Oracle, "Resource Billing for Stopped Instances": the GPUs stay reserved); standard shapes pause."""
    s = (shape or "").upper()
    return "GPU" in s and not s.startswith("VM.GPU.A10")


def instance_action(api: "OCIApi", provider_id: str, action: str) -> None:
    """``instance_action(id, "STOP" | "START")``; a 409 (already in that state or on its way) is accepted when
    ``get_instance`` shows the state asked for, else it stays an error (TransientError / ProviderError)."""
    cc = api.client("compute")
    try:
        api.call(f"instance_action {action}", cc.instance_action, provider_id, action)
    except ProviderError as e:
        if e.status == 404 and e.code != "NotAuthenticated":
            raise ProviderError(PROVIDER, f"instance_action {action}", f"instance {provider_id} no longer exists",
                                hint="`broker down RUN` records it gone") from None
        if e.status != 409:
            raise
        want = "stopped" if action == "STOP" else "running"
        if instance_state(api, provider_id) not in (want, "pending" if action == "START" else want):
            raise


def stopped_rate(api: "OCIApi", provider_id: str, attrs: dict[str, Any] | None) -> tuple[float, str]:
    """$/h of ``provider_id`` while stopped: its boot volume (``attrs["storage_usd_per_hour"]``, else
    ``disk_gib`` x :data:`BOOT_VOLUME_USD_PER_GB_MONTH` / 730 h), plus the shape's full price where OCI keeps
    billing it stopped (:func:`keeps_billing_stopped`)."""
    a = attrs or {}
    cc = api.client("compute")
    inst = api.call("get_instance", cc.get_instance, provider_id).data
    shape = getattr(inst, "shape", None) or a.get("instance_type")
    disk = float(a.get("storage_usd_per_hour") or 0.0)
    basis = "boot volume (recorded storage rate)"
    if not disk:
        gb = float(a.get("disk_gib") or 50)
        disk = gb * BOOT_VOLUME_USD_PER_GB_MONTH / 730.0
        basis = f"boot volume {gb:g} GB x {usd(BOOT_VOLUME_USD_PER_GB_MONTH, up_to=4)}/GB/month (broker's assumption)"
    if keeps_billing_stopped(shape):
        full = list_price(shape)
        if full is None:
            full = float(a.get("reported_usd_per_hour") or a.get("planned_usd_per_hour") or 0.0)
        return disk + float(full or 0.0), (f"{basis} + {shape} in full: OCI keeps billing this GPU shape while "
                                           "stopped (only VM.GPU.A10.x pauses); only `broker down` ends it")
    return disk, basis
