"""``gcp``: Google Compute Engine GPU VMs through the official clients (``google-cloud-compute`` REST transport,
``google-cloud-quotas``, ``google-cloud-billing``, ``google-auth``), imported lazily.

What it does (facts: ``docs/reference/gcp-fixtures.md``):

* **offers** -- N1 + T4 / V100 / P4 / P100, G2 (L4) and A2 (A100) from the dated snapshot
  ``providers/snapshots/gcp.csv`` (on-demand total per type; spot total and zones in the notes), one offer per zone
  that offers the GPU when configured; ``broker catalog refresh`` reprices the GPU part from the Cloud Billing
  Catalog API (:attr:`live_price_list` ``"api"``).
* **quotas** -- ``regions.get``: ``NVIDIA_<MODEL>_GPUS`` (``PREEMPTIBLE_NVIDIA_*`` for spot) and the CPU metric
  of the machine family (``CPUS``, ``A2_CPUS``); ``projects.get``: ``GPUS_ALL_REGIONS`` (0 on new projects: the plan
  says "quota GPUS_ALL_REGIONS 0 of 0 gpus available").
* **Spot VMs** -- the snapshot's Spot total of each type is its interruptible price (the planner's interruptible
  twin, beside on-demand); an interruptible node is inserted with ``provisioningModel SPOT`` and
  ``instanceTerminationAction DELETE``; :meth:`GCPProvider.preemption` reads Google's ``compute.instances.preempted``
  zone operation; Spot options are judged by ``PREEMPTIBLE_*`` quota where the project has it (else by the
  standard metrics they then draw on).  Facts: ``docs/reference/gcp-fixtures.md`` "Spot VMs".
* **lifecycle** -- per run a custom-mode VPC and subnet (or ``GCP_NETWORK``, e.g. ``default``), firewall rules by
  network tag (all traffic between the run's VMs; SSH from ``GCP_SSH_SOURCE_RANGES``, default anywhere), one
  single-GPU VM per node (Deep Learning VM image, ``install-nvidia-driver``, ``startup-script`` with the dead-man
  switch, labels ``broker-run`` / ``broker-install``), deletes in dependency order (instances, left-over disks,
  subnet, firewalls, network).  Stockout (``ZONE_RESOURCE_POOL_EXHAUSTED``) -> CapacityError (next zone, then next
  option); ``QUOTA_EXCEEDED`` -> QuotaError naming metric and region.
* **quota requests** -- Cloud Quotas ``QuotaPreference`` (duplicates not filed), or the console form.

Layout: :mod:`.api` (credentials, clients, operation polling, the one error mapping), :mod:`.offers`,
:mod:`.network`, :mod:`.lifecycle`, :mod:`.scripts`, :mod:`.quota_requests`.

Settings (environment): ``GOOGLE_APPLICATION_CREDENTIALS`` / the gcloud ADC file, ``GOOGLE_CLOUD_PROJECT``,
``GCP_REGION`` (default us-central1), ``GCP_ZONES`` (comma list), ``GCP_IMAGE``, ``GCP_NETWORK``,
``GCP_SSH_SOURCE_RANGES``, ``GCP_QUOTA_CONTACT_EMAIL``, ``GCP_COMPUTE_ENDPOINT`` / ``GCP_QUOTAS_ENDPOINT`` /
``GCP_BILLING_ENDPOINT`` (tests).  They are Google's own variables or adapter-local ones, read here, so the core
settings need no GCP field.
"""

from __future__ import annotations

import os
import re
import time
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable

from broker.core.model import Capacity, Offer, Quota, Requirements
from broker.core.provider import AuthError, Provider, ProviderCheck, ProviderError, Recorder
from broker.providers.declared import GCP
from broker.providers.gcp import lifecycle, network, offers as _offers, quota_requests
from broker.providers.gcp.api import CREDENTIALS_HINT, PROVIDER, GCPApi, find_credentials, install_hint
from broker.providers.gcp.lifecycle import DEFAULT_IMAGE, TOKEN_TAG
from broker.providers.gcp.network import DELETE_ORDER
from broker.providers.gcp.offers import parse_type, snapshot_offers

if TYPE_CHECKING:
    from broker.core.records import Ingress, InstanceInfo, NodeRequest, QuotaRequest, TaggedResource

__all__ = ["DEFAULT_IMAGE", "DELETE_ORDER", "GCPApi", "GCPProvider", "PROVIDER", "TOKEN_TAG", "parse_type",
           "snapshot_offers"]

_NAME = r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?"


class GCPProvider(Provider):
    """Google Compute Engine.  Topologies: ``simulated`` (one multi-GPU VM), ``multi-node`` (N single-GPU VMs in
    one VPC subnet), ``hybrid`` (the VMs of a hybrid run).

    Args (all optional): ``project``, ``credentials`` (a google-auth credentials object), ``region``, ``zones``,
    ``compute_endpoint`` / ``quotas_endpoint`` / ``billing_endpoint``, ``image``, ``network`` (an existing network
    to use instead of a per-run one), ``ssh_user`` (default ``broker``), ``ssh_sources`` (CIDRs allowed to SSH),
    ``poll_s`` / ``op_timeout_s`` (operation polling, seconds), ``sleep``.  The constructor does no I/O.
    """

    name = PROVIDER
    #: what it can do, and why not (providers/declared.py; the registry reads the same object)
    caps = GCP
    #: Compute Engine regions are ``<area>-<direction><n>`` (``us-central1``, ``europe-west4``)
    region_pattern = r"[a-z]+-[a-z]+\d+"
    region_words = "<area>-<direction><n>, e.g. us-central1"
    region_sample = "us-central1"
    owner_tags = True
    delete_order: ClassVar[tuple[str, ...]] = DELETE_ORDER

    @classmethod
    def valid_id(cls, kind: str, provider_id: str) -> bool:
        """``<zone>:<name>`` for instances and disks, ``<region>:<name>`` for subnets, a GCE name otherwise."""
        if not isinstance(provider_id, str):
            return False
        if kind in ("instance", "boot_volume"):
            return re.fullmatch(rf"[a-z]+-[a-z]+\d+-[a-z]:{_NAME}", provider_id) is not None
        if kind == "subnet":
            return re.fullmatch(rf"[a-z]+-[a-z]+\d+:{_NAME}", provider_id) is not None
        return re.fullmatch(_NAME, provider_id) is not None

    @classmethod
    def id_form(cls, kind: str) -> str:
        return {"instance": "<zone>:<name>", "boot_volume": "<zone>:<name>",
                "subnet": "<region>:<name>"}.get(kind, "a GCE name ([a-z][-a-z0-9]*, at most 63)")

    @classmethod
    def quota_limit(cls, instance_type: str, *, spot: bool = False) -> tuple[str, str, str] | None:
        """The regional GPU metric that must allow ``instance_type`` (``NVIDIA_T4_GPUS``, ``PREEMPTIBLE_...`` for
        spot), counted in GPUs per region: ``(metric, description, "compute")``; None for a type broker does not
        know."""
        t = parse_type(instance_type)
        metric = t.gpu_metric(spot=spot) if t else None
        if metric is None:
            return None
        return metric, f"Compute Engine {metric} (GPUs per region)", "compute"

    @classmethod
    def quota_counts(cls, instance_type: str, *, spot: bool = False) -> tuple[str, ...]:
        """Every Compute metric one VM of ``instance_type`` counts: its GPU metric, the CPU metric of its machine
        family (``CPUS`` for N1, ``G2_CPUS``, ``A2_CPUS``) and ``GPUS_ALL_REGIONS``; a Spot VM also the standard
        metrics (it draws on them where no ``PREEMPTIBLE_*`` quota is granted).  () for a type broker does not
        know.  A ``CPUS`` quota error thus skips the N1 options only, never the G2 ones."""
        t = parse_type(instance_type)
        if t is None:
            return ()
        sides = (True, False) if spot else (False,)
        out = [m for s in sides for m in (t.gpu_metric(spot=s), t.cpu_metric(spot=s)) if m]
        return tuple(dict.fromkeys(out + [_offers.GLOBAL_GPU_METRIC]))

    @classmethod
    def quota_account_limits(cls) -> tuple[tuple[str, str, str], ...]:
        """``GPUS_ALL_REGIONS``: every GPU of the project in all regions (0 on new projects)."""
        return ((_offers.GLOBAL_GPU_METRIC, "Compute Engine GPUs in all regions (project-wide; 0 on new projects)",
                 "compute"),)

    def __init__(self, *, project: str | None = None, credentials: Any = None, region: str | None = None,
                 zones: list[str] | None = None, compute_endpoint: str | None = None,
                 quotas_endpoint: str | None = None, billing_endpoint: str | None = None, image: str | None = None,
                 network: str | None = None, ssh_user: str | None = None, ssh_sources: list[str] | None = None,
                 poll_s: float = 1.0, op_timeout_s: float = 600.0, sleep: Callable[[float], None] = time.sleep):
        self.api = GCPApi(project=project, credentials=credentials, compute_endpoint=compute_endpoint,
                          quotas_endpoint=quotas_endpoint, billing_endpoint=billing_endpoint, poll_s=poll_s,
                          op_timeout_s=op_timeout_s, sleep=sleep)
        self.region = region or os.environ.get("GCP_REGION") or None
        env_zones = [z.strip() for z in os.environ.get("GCP_ZONES", "").split(",") if z.strip()]
        self._zones = list(zones) if zones else (env_zones or None)
        self._image = image or os.environ.get("GCP_IMAGE") or DEFAULT_IMAGE
        self._network = network or os.environ.get("GCP_NETWORK") or None
        self.ssh_user = ssh_user or os.environ.get("GCP_SSH_USER") or "broker"
        src = ssh_sources or [s.strip() for s in os.environ.get("GCP_SSH_SOURCE_RANGES", "").split(",")
                              if s.strip()]
        self._ssh_sources = src or None
        #: accelerator type -> zones offering it (acceleratorTypes.aggregatedList); {} = not readable: snapshot
        self._acc_zones: dict[str, list[str]] | None = None
        self._zones_note: str | None = None
        #: instances this adapter sent a delete for (before the call): their end is broker's, not a preemption
        self._terminated_here: set[str] = set()

    # ------------------------------------------------------------------------------------ read side
    def check(self) -> ProviderCheck:
        """Which credentials were found (GOOGLE_APPLICATION_CREDENTIALS or the gcloud ADC file) and the project
        (GOOGLE_CLOUD_PROJECT or the file's); no network call, no secret printed."""
        import importlib.util

        try:  # found, not imported: `broker plan` asks check() and must import no SDK
            installed = importlib.util.find_spec("google.auth") is not None
        except (ImportError, ValueError):
            installed = False
        if not installed:
            return ProviderCheck(provider=PROVIDER, configured=False, detail="the Google Cloud clients are not "
                                 "installed", hint=install_hint())
        if self.api.source and self.api._credentials is not None:
            where = self.api.source
        else:
            path, where = find_credentials()
            if path is None:
                return ProviderCheck(provider=PROVIDER, configured=False, detail=where,
                                     hint=CREDENTIALS_HINT)
            try:
                self.api.credentials()
            except AuthError as e:
                return ProviderCheck(provider=PROVIDER, configured=True, usable=False, detail=e.message,
                                     hint=e.hint)
        project = self.api.project
        if not project:
            return ProviderCheck(provider=PROVIDER, configured=False, detail=f"{where}; no project",
                                 hint="export GOOGLE_CLOUD_PROJECT=<your project id>")
        ep = self.api.compute_endpoint
        return ProviderCheck(provider=PROVIDER, configured=True, usable=None,
                             detail=f"{where}, project {project} (from {self.api.project_source()})"
                                    + (f", endpoint {ep}" if ep else ""))

    def price_note(self) -> str | None:
        from broker.plan.catalog import snapshot_info

        # the note names what the user sees (the plan's interruptible prices), not the snapshot file's column
        return (f"prices: GCP list-price snapshot {snapshot_info(PROVIDER)[0]}, Spot VM prices from the same "
                "snapshot" + (f"; {self._zones_note}" if self._zones_note else ""))

    def live_prices(self, types: Iterable[str]) -> dict[str, float]:
        """instance type -> $/hour with live GPU prices (:func:`.offers.live_prices`).  Raises AuthError /
        TransientError / ProviderError."""
        return _offers.live_prices(self.api, types)

    def offers(self, req: Requirements) -> list[Offer]:
        """Snapshot offers; when configured, one per zone that offers the GPU now (``acceleratorTypes``
        aggregatedList, read once per adapter; the snapshot's zones when it cannot be read: offline, refused,
        throttled), ``zones`` / ``GCP_ZONES`` narrowing."""
        base = snapshot_offers(req)
        if self.region:
            base = [o for o in base if o.region in (None, self.region)]
        if not self.api.configured():
            return base
        if self._acc_zones is None:
            try:
                self._acc_zones = _offers.accelerator_zones(self.api)
            except ProviderError as e:
                self._acc_zones = {}
                self._zones_note = (f"zones from the snapshot: acceleratorTypes could not be read "
                                    f"({e.message[:200]})")
        if self._acc_zones:
            base = _offers.with_api_zones(base, self._acc_zones)
        return _offers.offers_per_zone(base, self._zones)

    def quotas(self, req: Requirements, offers: list[Offer]) -> list[Quota]:
        """GPU and CPU metrics per region (``regions.get``) and ``GPUS_ALL_REGIONS`` (``projects.get``) for
        ``offers``; [] unconfigured.  Raises AuthError, TransientError, ProviderError."""
        if not self.api.configured():
            return []
        return _offers.quotas(self.api, offers, interruptible=getattr(req, "interruptible", "false") != "false")

    def capacity(self, offers: list[Offer]) -> list[Capacity]:
        """GCP has no capacity report: capacity shows only at insert (stockout -> next zone)."""
        return []

    def quota_scope_of(self, offer: Offer) -> str | None:
        return None

    # ------------------------------------------------------------------------------------ lifecycle
    def bootstrap(self, run_id: str, offers: list[Offer], topology: str, rec: Recorder) -> dict[str, Any]:
        """The run's network (:func:`.network.bootstrap`), each object recorded before and after its insert."""
        region = next((o.region for o in offers if o.region), None) or self.region or "us-central1"
        return network.bootstrap(self.api, run_id, region, rec, network=self._network,
                                 ssh_sources=self._ssh_sources)

    def open_ingress(self, net: dict[str, Any], rules: list[Ingress], rec: Recorder) -> None:
        """One firewall rule per rule (:func:`.network.open_ingress`)."""
        network.open_ingress(self.api, net, rules, rec)

    def create_instance(self, req: NodeRequest) -> str:
        """``instances.insert`` in ``req.offer.zone`` (the first zone of the type when none); see
        :func:`.lifecycle.create_instance` for the errors."""
        zone = req.offer.zone or next(iter(req.offer.attrs.get("zones") or []), None)
        if not zone:
            raise ProviderError(PROVIDER, "instances.insert", f"no zone known for {req.offer.instance_type}",
                                hint="set GCP_ZONES (e.g. us-central1-a)")
        return lifecycle.create_instance(self.api, req, zone=zone, image=req.image or self._image,
                                         ssh_user=self.ssh_user, workroot=self.node_workroot, say=self.progress)

    def find_by_token(self, client_token: str, region: str | None = None) -> str | None:
        return lifecycle.find_by_token(self.api, client_token)

    def describe_instance(self, provider_id: str, *, region: str | None = None) -> InstanceInfo:
        return lifecycle.describe_instance(self.api, self.require_id("instance", provider_id, "instances.get"))

    def terminate(self, kind: str, provider_id: str, *, region: str | None = None,
                  attrs: dict[str, Any] | None = None) -> bool:
        """Idempotent delete; gone (404) is True.  ``instance``: ``instances.delete`` (False until
        :meth:`describe_instance` shows it gone; its boot disk auto-deletes); ``boot_volume``: ``disks.delete``;
        ``firewall`` / ``subnet`` / ``vpc``: delete and wait (a dependant still there: TransientError)."""
        self.require_id(kind, provider_id, f"delete {kind}")
        if kind == "instance":
            self._terminated_here.add(provider_id)  # before the call: a delete that reached Google is broker's
            return lifecycle.terminate_instance(self.api, provider_id)
        if kind == "boot_volume":
            return lifecycle.delete_disk(self.api, provider_id)
        return network.delete_network_object(self.api, kind, provider_id)

    def preemption(self, resource_id: str) -> str | None:
        """Google preempted Spot VM ``resource_id`` (``<zone>:<name>``): its ``compute.instances.preempted`` zone
        operation, in Google's words (:func:`.lifecycle.preemption`); None for a VM this adapter deleted, one still
        running, an on-demand VM.  Raises ProviderError (AuthError, TransientError) when Google cannot be read."""
        rid = self.require_id("instance", resource_id, "zoneOperations.list")
        return lifecycle.preemption(self.api, rid, rid in self._terminated_here)

    def list_tagged(self, run_id: str | None = None) -> list[TaggedResource]:
        return lifecycle.list_tagged(self.api, run_id)

    # ------------------------------------------------------------------------------------ quota requests
    def request_quota(self, quota: Quota, value: float, reason: str, *, draft: bool = False) -> QuotaRequest:
        """File (or draft) a Cloud Quotas QuotaPreference (:func:`.quota_requests.request_quota`)."""
        return quota_requests.request_quota(self.api, quota, value, reason, draft=draft)

    def quota_request_status(self, request: QuotaRequest) -> QuotaRequest:
        return quota_requests.quota_request_status(self.api, request)
