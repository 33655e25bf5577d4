"""GCP instance lifecycle: insert (one single-GPU VM per node, in the run's subnet, tagged for the run's firewall
rules), describe, delete, the label listing reconcile reads and the lookup by client token.

An instance id is ``<zone>:<name>``; its boot disk (auto-deleted with it) is ``<zone>:<name>`` of kind
``boot_volume``.  Labels (``broker-run``, ``broker-install``, ``broker-node``) are lowercase-only, so the exact
values also travel in metadata items of the same names, which :func:`list_tagged` reads back.  The insert carries
``requestId`` = a UUID derived from the ledger row id: a retried insert of the same row is a no-op server-side.

**Spot VMs** (an interruptible offer, ``docs/reference/gcp-fixtures.md`` "Spot VMs"; shared reference gcp.md
sections 1.2 and 9; https://docs.cloud.google.com/compute/docs/instances/create-use-spot):
``scheduling.provisioningModel = SPOT`` with ``instanceTerminationAction = DELETE``, ``onHostMaintenance =
TERMINATE`` and ``automaticRestart = false`` (Spot VMs cannot migrate or restart by themselves).  DELETE rather than
the console's default STOP: a stopped Spot VM stays TERMINATED with its boot disk billing, and broker never starts a
preempted node again (it rents a new one and restores the checkpoint), so DELETE ends every charge the moment
Google takes the VM back and leaves nothing for teardown to find.  Google records the preemption as a zone
operation of type ``compute.instances.preempted`` whose ``targetLink`` is the instance (the type name is
UNCONFIRMED in the reference: the emulator models it); :func:`preemption` reads it, and it outlives the deleted VM.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from broker.core.provider import INSTALL_TAG, RUN_TAG, ProviderError
from broker.providers.gcp.api import PROVIDER
from broker.providers.gcp.network import gce_name, run_tag
from broker.providers.gcp.offers import list_price, parse_type
from broker.providers.gcp.scripts import startup_script

if TYPE_CHECKING:
    from broker.core.records import InstanceInfo, NodeRequest, TaggedResource
    from broker.providers.gcp.api import GCPApi

TOKEN_TAG = "broker-client-token"
#: Deep Learning VM image family with the NVIDIA driver installed on first boot (install-nvidia-driver=True);
#: UNCONFIRMED against the current DLVM list: resolved by the server at insert (or set GCP_IMAGE).
DEFAULT_IMAGE = "projects/deeplearning-platform-release/global/images/family/common-cu124-ubuntu-2204-py310"

_STATE = {"PROVISIONING": "pending", "STAGING": "pending", "PENDING": "pending", "RUNNING": "running",
          "REPAIRING": "pending", "STOPPING": "stopped", "PENDING_STOP": "stopped", "SUSPENDING": "stopped",
          "SUSPENDED": "stopped", "STOPPED": "stopped", "TERMINATED": "stopped", "DEPROVISIONING": "terminating"}


def is_spot_offer(offer: Any) -> bool:
    """An offer broker rents as a Spot VM: an interruptible variant (:mod:`broker.plan.interruptible`, attrs
    ``interruptible`` True) or one marked ``market: spot``."""
    return offer.attrs.get("interruptible") is True or offer.attrs.get("market") == "spot"


def label_value(v: str) -> str:
    """A GCE label value (lowercase letters, digits, ``_`` and ``-``; at most 63)."""
    return re.sub(r"[^a-z0-9_-]", "-", str(v).lower())[:63]


def split_id(provider_id: str) -> tuple[str, str]:
    zone, sep, name = provider_id.partition(":")
    if not sep or not zone or not name:
        raise ProviderError(PROVIDER, "instance id", f"{provider_id!r} is not <zone>:<name>")
    return zone, name


def instance_body(req: "NodeRequest", *, project: str, zone: str, net: dict[str, Any], image: str, ssh_user: str,
                  workroot: str | None, service_account: bool = True) -> Any:
    """The ``compute_v1.Instance`` for one node (see the module docstring)."""
    from google.cloud import compute_v1 as c

    from broker.core.nodescripts import job_done_path

    t = parse_type(req.offer.instance_type)
    if t is None:
        raise ProviderError(PROVIDER, "instances.insert", f"{req.offer.instance_type!r} is not a GCP GPU type",
                            hint="instance types look like n1-standard-4+t4 or g2-standard-4")
    spot = is_spot_offer(req.offer)
    name = gce_name(req.name)
    run_id = req.run_id
    labels = {RUN_TAG: label_value(run_id), "broker-node": str(req.node_index)}
    if req.installation_id:
        labels[INSTALL_TAG] = label_value(req.installation_id)
    labels.update({gce_name(k)[:63]: label_value(v) for k, v in req.tags.items()})
    script = startup_script(deadline=req.deadline, grace_seconds=req.grace_seconds, onstart=req.onstart,
                            idle_minutes=req.idle_minutes, done_file=job_done_path(ssh_user, workroot),
                            ssh_user=ssh_user)
    items = {"ssh-keys": f"{ssh_user}:{req.ssh_public_key.strip()}", "startup-script": script,
             "install-nvidia-driver": "True", RUN_TAG: run_id, TOKEN_TAG: req.client_token,
             "broker-ssh-user": ssh_user, "broker-node": str(req.node_index)}
    if req.installation_id:
        items[INSTALL_TAG] = req.installation_id
    nic = c.NetworkInterface(network=f"projects/{project}/global/networks/{net.get('network') or 'default'}",
                             access_configs=[c.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")])
    if net.get("subnetwork"):
        nic.subnetwork = f"projects/{project}/regions/{net['region']}/subnetworks/{net['subnetwork']}"
    sched = c.Scheduling(on_host_maintenance="TERMINATE", automatic_restart=False,
                         provisioning_model="SPOT" if spot else "STANDARD")
    if spot:  # preempted = deleted by Google: billing ends, nothing is left (module docstring)
        sched.instance_termination_action = "DELETE"
    body = c.Instance(
        name=name, machine_type=f"zones/{zone}/machineTypes/{t.machine_type}", labels=labels,
        scheduling=sched, tags=c.Tags(items=[net.get("tag") or run_tag(run_id)]), network_interfaces=[nic],
        disks=[c.AttachedDisk(boot=True, auto_delete=True, initialize_params=c.AttachedDiskInitializeParams(
            source_image=image, disk_size_gb=max(50, int(req.disk_gib)), labels=labels))],
        metadata=c.Metadata(items=[c.Items(key=k, value=v) for k, v in items.items()]))
    if t.attached:
        body.guest_accelerators = [c.AcceleratorConfig(
            accelerator_type=f"zones/{zone}/acceleratorTypes/{t.accelerator}", accelerator_count=t.gpus)]
    if service_account:  # the dead-man switch deletes the VM with this account's token
        body.service_accounts = [c.ServiceAccount(email="default",
                                                  scopes=["https://www.googleapis.com/auth/compute"])]
    return body


def create_instance(api: "GCPApi", req: "NodeRequest", *, zone: str, image: str, ssh_user: str,
                    workroot: str | None, say: Any = None) -> str:
    """``instances.insert`` of one node in ``zone`` and wait for its operation; returns ``<zone>:<name>``.

    Raises CapacityError (ZONE_RESOURCE_POOL_EXHAUSTED[_WITH_DETAILS] in the operation: the core tries the next
    zone, then the next option), QuotaError (403 ``Quota 'X' exceeded ... in region R``: metric and region named),
    AuthError, AmbiguousCreate (5xx / no answer: verify with :func:`find_by_token`), TransientError (429),
    ProviderError."""
    project = api.require_project("instances.insert")
    body = instance_body(req, project=project, zone=zone, net=req.network, image=image, ssh_user=ssh_user,
                         workroot=workroot)
    import uuid  # here: uuid (and platform) would cost every `broker plan`, which inserts nothing

    rid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"broker:{req.client_token}:{zone}"))  # a retry of this row here
    ic = api.client("instances")
    region = zone.rsplit("-", 1)[0]
    from google.cloud import compute_v1 as c

    request = c.InsertInstanceRequest(project=project, zone=zone, instance_resource=body, request_id=rid)
    op = api.call("instances.insert", ic.insert_unary, request=request, _create=True, _region=region,
                  timeout=120.0)
    # bounded by the run's clock (req.deadline), a progress line to ``say`` while the operation is not DONE
    api.wait(op, "instances.insert", zone=zone, create=True, deadline=req.deadline, say=say)
    return f"{zone}:{body.name}"


def _meta(inst: Any) -> dict[str, str]:
    md = getattr(inst, "metadata", None)
    return {i.key: i.value for i in (md.items if md else [])}


def describe_instance(api: "GCPApi", provider_id: str) -> "InstanceInfo":
    """State and addresses (``networkIP``, the external ``natIP``); a 404 means gone: ``terminated``."""
    from broker.core.records import InstanceInfo

    project = api.require_project("instances.get")
    zone, name = split_id(provider_id)
    try:
        inst = api.call("instances.get", api.client("instances").get, project=project, zone=zone, instance=name)
    except ProviderError as e:
        if e.status == 404:
            return InstanceInfo(provider_id=provider_id, state="terminated", raw_state="notFound",
                                message="the instance no longer exists")
        raise
    raw = inst.status
    state = _STATE.get(raw, "unknown")
    md = _meta(inst)
    mt = (inst.machine_type or "").rsplit("/", 1)[-1]
    info = InstanceInfo(provider_id=provider_id, state=state, raw_state=raw,
                        ssh_user=md.get("broker-ssh-user", "root"), usd_per_hour=_price_of(inst, mt))
    if inst.network_interfaces:
        nic = inst.network_interfaces[0]
        info.private_ip = nic.network_i_p or None
        if nic.access_configs:
            info.public_ip = nic.access_configs[0].nat_i_p or None
        info.ssh_host = info.public_ip or info.private_ip
    return info


def _is_spot(inst: Any) -> bool:
    sched = getattr(inst, "scheduling", None)
    return bool(sched) and (sched.provisioning_model == "SPOT" or bool(sched.preemptible))


def _price_of(inst: Any, machine_type: str) -> float | None:
    """$/hour the instance bills: its type's snapshot on-demand price, or the snapshot's Spot price for a Spot VM
    (None when the snapshot has none: the plan's rate then stays the ledger's)."""
    accs = list(inst.guest_accelerators or [])
    it = machine_type
    if accs:
        a = accs[0]
        n = int(a.accelerator_count or 1)
        acc = (a.accelerator_type or "").rsplit("/", 1)[-1]
        from broker.providers.gcp.offers import ALIASES

        short = next((k for k, v in ALIASES.items() if v == acc), acc)
        it = f"{machine_type}+{'' if n == 1 else f'{n}x'}{short}"
    if _is_spot(inst):
        from broker.providers.gcp.offers import spot_list_price

        return spot_list_price(it)
    return list_price(it)


def terminate_instance(api: "GCPApi", provider_id: str) -> bool:
    """``instances.delete``: True when already gone (404), else False (the delete runs asynchronously: poll
    :func:`describe_instance`).  429 / 5xx: TransientError (the core retries)."""
    project = api.require_project("instances.delete")
    zone, name = split_id(provider_id)
    try:
        api.call("instances.delete", api.client("instances").delete_unary, project=project, zone=zone,
                 instance=name)
    except ProviderError as e:
        if e.status == 404:
            return True
        raise
    return False


def delete_disk(api: "GCPApi", provider_id: str) -> bool:
    """``disks.delete`` of a left-over boot disk (``<zone>:<name>``); True when gone (404 = gone)."""
    project = api.require_project("disks.delete")
    zone, name = split_id(provider_id)
    try:
        op = api.call("disks.delete", api.client("disks").delete_unary, project=project, zone=zone, disk=name)
        api.wait(op, "disks.delete", zone=zone)
    except ProviderError as e:
        if e.status == 404:
            return True
        raise
    return True


def _aggregated(api: "GCPApi", client: str, attr: str, call: str) -> list[tuple[str, Any]]:
    project = api.require_project(call)
    pages = api.call(call, lambda: list(api.client(client).aggregated_list(project=project)))
    out = []
    for scope, lst in pages:
        for x in getattr(lst, attr):
            out.append((scope.rsplit("/", 1)[-1], x))
    return out


def list_tagged(api: "GCPApi", run_id: str | None = None) -> list["TaggedResource"]:
    """Instances, boot disks, subnets, firewalls and networks broker made (instances and disks by the
    ``broker-run`` label, the exact run from the instance's metadata; network objects by their description) whose
    run is ``run_id`` (any when None).  An answer that cannot be read is a ProviderError, never an empty list."""
    from datetime import datetime

    from broker.core.records import TaggedResource
    from broker.providers.gcp.network import list_network

    out: list[TaggedResource] = []
    want_label = label_value(run_id) if run_id is not None else None
    for zone, inst in _aggregated(api, "instances", "instances", "instances.aggregatedList"):
        labels = dict(inst.labels or {})
        if RUN_TAG not in labels or (want_label is not None and labels[RUN_TAG] != want_label):
            continue
        md = _meta(inst)
        run = md.get(RUN_TAG, labels[RUN_TAG])
        if run_id is not None and run != run_id:
            continue
        mt = (inst.machine_type or "").rsplit("/", 1)[-1]
        created = None
        try:
            created = datetime.fromisoformat(inst.creation_timestamp) if inst.creation_timestamp else None
        except ValueError:
            created = None
        out.append(TaggedResource(provider=PROVIDER, kind="instance", provider_id=f"{zone}:{inst.name}",
                                  run_id=run, region=zone.rsplit("-", 1)[0], state=inst.status, created_at=created,
                                  usd_per_hour=_price_of(inst, mt), name=inst.name,
                                  installation_id=md.get(INSTALL_TAG), client_token=md.get(TOKEN_TAG)))
    live = {t.provider_id for t in out}
    for zone, d in _aggregated(api, "disks", "disks", "disks.aggregatedList"):
        labels = dict(d.labels or {})
        if RUN_TAG not in labels or (want_label is not None and labels[RUN_TAG] != want_label):
            continue
        pid = f"{zone}:{d.name}"
        if pid in live or list(d.users or []):  # the instance's own boot disk goes with it
            continue
        out.append(TaggedResource(provider=PROVIDER, kind="boot_volume", provider_id=pid,
                                  run_id=run_id or labels[RUN_TAG], region=zone.rsplit("-", 1)[0],
                                  state=d.status, name=d.name,
                                  installation_id=None if INSTALL_TAG not in labels else labels[INSTALL_TAG]))
    for kind, pid, region, tags, obj in list_network(api):
        run = tags.get(RUN_TAG)
        if run_id is not None and run != run_id:
            continue
        out.append(TaggedResource(provider=PROVIDER, kind=kind, provider_id=pid, run_id=run, region=region,
                                  name=obj.name, installation_id=tags.get(INSTALL_TAG)))
    return out


def find_by_token(api: "GCPApi", client_token: str) -> str | None:
    """The id of a live instance inserted for ledger row ``client_token`` (metadata item TOKEN_TAG), if any."""
    for t in list_tagged(api, None):
        if t.kind == "instance" and t.client_token == client_token:
            return t.provider_id
    return None


#: the zone operation type Compute Engine records when it preempts a Spot VM (shared reference gcp.md section 9;
#: the exact name is UNCONFIRMED there)
PREEMPTED_OP = "compute.instances.preempted"


def preemption(api: "GCPApi", provider_id: str, terminated_here: bool) -> str | None:
    """Compute Engine's own word that it preempted Spot VM ``provider_id`` (``<zone>:<name>``): a zone operation of
    type :data:`PREEMPTED_OP` on that VM (``zoneOperations.list`` filtered on the instance's ``targetLink``, every
    page; each operation is checked again here).  The operation outlives the VM, which instanceTerminationAction
    DELETE removes.  A node of a later attempt has the same name, so only an operation on the same incarnation
    counts: ``targetId`` equal to the live instance's ``id``, or, when the VM is gone, to the ``targetId`` of the
    latest ``insert`` operation of that name.

    None when this adapter sent the delete itself (``terminated_here``: broker's teardown is not a preemption), for
    a VM Google did not preempt (running; deleted by broker, by its dead-man switch or by a person: those are
    ``delete`` operations), and for an on-demand VM (Google never preempts one).  Raises ProviderError
    (AuthError, TransientError) when the instance or the operations cannot be read: "could not ask" is never
    None."""
    if terminated_here:
        return None
    project = api.require_project("zoneOperations.list")
    zone, name = split_id(provider_id)
    try:
        inst = api.call("instances.get", api.client("instances").get, project=project, zone=zone, instance=name)
    except ProviderError as e:
        if e.status != 404:
            raise
        inst = None
    if inst is not None and not _is_spot(inst):
        return None
    link = f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{zone}/instances/{name}"
    from google.cloud import compute_v1 as c

    request = c.ListZoneOperationsRequest(project=project, zone=zone, filter=f'targetLink = "{link}"')
    ops = api.call("zoneOperations.list", lambda: list(api.client("zone_operations").list(request=request)))
    suffix = f"/zones/{zone}/instances/{name}"
    ops = [op for op in ops if (op.target_link or "").endswith(suffix)]
    if inst is not None:
        incarnation: int | None = int(inst.id or 0) or None
    else:
        inserts = sorted((op for op in ops if op.operation_type == "insert"), key=lambda op: op.insert_time or "")
        incarnation = int(inserts[-1].target_id or 0) or None if inserts else None
    for op in ops:
        if op.operation_type != PREEMPTED_OP:
            continue
        if incarnation is not None and int(op.target_id or 0) != incarnation:
            continue  # an earlier VM of the same name (an earlier attempt)
        msg = (op.status_message or "").strip()
        return (f"preempted: Compute Engine operation {op.name} ({PREEMPTED_OP}) at {op.insert_time or '?'} on "
                f"Spot VM {name} in {zone}" + (f" ({msg[:200]})" if msg else ""))
    return None
