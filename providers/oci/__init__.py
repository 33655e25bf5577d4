"""``oci``: Oracle Cloud Infrastructure GPU shapes through the official ``oci`` SDK (2.189.0).

What it does (facts: ``docs/reference/cloud-apis.md`` section B):

* **offers** -- GPU shapes with list prices (OCI has no per-account price API, so prices always come from the
  price snapshot in effect: ``broker.plan.catalog.snapshot_offers("oci", req)``),
  expanded per availability domain (``IdentityClient.list_availability_domains``) when configured.
* **quotas** -- service limits of service ``compute`` (``gpu-a10-count`` ...), AD-scoped, counted in GPUs, read with
  ``LimitsClient.get_resource_availability`` per AD (``limit = used + available``).
* **capacity** -- ``ComputeClient.create_compute_capacity_report`` per AD.
* **lifecycle** -- a VCN, internet gateway, default-route rule, security list (all protocols from the VCN CIDR + SSH)
  and regional subnet per run (or ``OCI_SUBNET_ID``), ``launch_instance`` with cloud-init that opens the host
  firewall to the VCN CIDR only, ``terminate_instance(preserve_boot_volume=False)``, network deletes in dependency
  order.  Everything created carries freeform tags RUN_TAG (run id) and INSTALL_TAG (installation id).
* **quota requests** -- ``LimitsIncreaseClient`` (questionnaire answered, open requests not duplicated).
* **dead-man switch** -- :func:`deadman_cloud_init`: the node terminates itself at deadline + grace with an
  instance-principal signer, only when the user set up :data:`INSTANCE_PRINCIPAL_SETUP`.

Layout (this module binds the verbs; each file below owns one concern):

* :mod:`.sdk` -- config, SDK clients, retries, the one error mapping (``OCIApi.errors``), fail-closed readers;
* :mod:`.offers` -- shapes, limits, offers per AD, quotas, capacity;
* :mod:`.network` -- bootstrap and the network deletes, in dependency order;
* :mod:`.lifecycle` -- launch, describe, terminate, tag listing, lookup by client token, run network cleanup;
* :mod:`.scripts` -- cloud-init (host firewall, dead-man switch, idle stop, boot-done marker);
* :mod:`.quota_requests` -- limit increase requests.

The SDK is imported lazily inside functions only.  Configuration: ``oci.config.from_file(OCI_CONFIG_FILE,
OCI_PROFILE)`` (or a dict passed to the constructor); ``OCI_SERVICE_ENDPOINT`` overrides the endpoint of every
client; ``OCI_COMPARTMENT_ID`` (default: the tenancy), ``OCI_REGION`` (default: the profile's region),
``OCI_IMAGE_ID``, ``OCI_SUBNET_ID``, ``OCI_INSTANCE_PRINCIPAL``.  Key material is never printed: error messages name
the file and profile, never the key or its contents.
"""

from __future__ import annotations

import re

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable

from broker.core.model import Capacity, Offer, Quota, Requirements
from broker.core.provider import AuthError, Provider, ProviderCheck, ProviderError, Recorder
from broker.providers.declared import OCI
from broker.providers.oci import lifecycle, network, offers as _offers, quota_requests
from broker.providers.oci.lifecycle import TOKEN_TAG
from broker.providers.oci.network import DELETE_ORDER
from broker.providers.oci.offers import UNCONFIRMED_LIMITS, limit_for_shape, shape_gpus, snapshot_offers
from broker.providers.oci.scripts import (BOOT_DONE, INSTANCE_PRINCIPAL_SETUP, boot_wait_command, cloud_init,
                                          deadman_cloud_init, deadman_watcher, firewall_script, idle_cloud_init,
                                          node_layers, self_terminate_function)
from broker.providers.oci.sdk import PROVIDER, OCIApi, exceeded_limits, install_hint, quota_request_command

if TYPE_CHECKING:
    from broker.core.records import Ingress, InstanceInfo, NodeRequest, QuotaRequest, TaggedResource

__all__ = ["BOOT_DONE", "DELETE_ORDER", "INSTANCE_PRINCIPAL_SETUP", "OCIApi", "OCIProvider", "PROVIDER", "TOKEN_TAG",
           "UNCONFIRMED_LIMITS", "boot_wait_command", "cloud_init", "deadman_cloud_init", "deadman_watcher",
           "exceeded_limits", "firewall_script", "idle_cloud_init", "limit_for_shape", "node_layers",
           "quota_request_command", "self_terminate_function", "shape_gpus", "snapshot_offers"]


#: an OCID (docs.oracle.com "Resource Identifiers"): ocid1.<resource type>.<realm>.[region][.future use].<unique id>
_OCID = r"(?i)ocid1\.[a-z0-9_-]+\.[a-z0-9_-]+\.[a-z0-9_-]*(\.[a-z0-9_-]+)?\.[a-z0-9_-]+"


#: an OCI region identifier (docs.oracle.com "Regions and Availability Domains"): us-ashburn-1, ap-chuncheon-1


class OCIProvider(Provider):
    """Oracle Cloud Infrastructure.  Topologies: ``simulated`` (one multi-GPU shape) and ``multi-node`` (N shapes in
    one VCN subnet).

    Args (all optional; defaults come from :func:`broker.core.config.settings`):
        config: an OCI config dict (``user``, ``tenancy``, ``fingerprint``, ``key_file``/``key_content``,
            ``region``) instead of the file and profile.
        service_endpoint: base URL for every client (``OCI_SERVICE_ENDPOINT``).
        compartment_id: where instances and networks go (``OCI_COMPARTMENT_ID``; default the tenancy).
        availability_domains: AD names to use instead of listing them.
        retry_strategy / circuit_breaker_strategy: passed to every client (tests pass the "none" strategies).
        instance_principal: arm the node-side dead-man switch (``OCI_INSTANCE_PRINCIPAL``).
        conflict_wait_s: how long a network delete retries a 409 (dependents still going away), seconds.
    The constructor does no I/O and imports nothing from the SDK.
    """

    name = PROVIDER
    #: what it can do, and why not (providers/declared.py; the registry reads the same object)
    caps = OCI
    #: OCI region identifiers are ``<area>-<city>-<n>`` (``us-ashburn-1``, ``eu-frankfurt-1``); the SDK builds
    #: ``iaas.<region>.oraclecloud.com`` from them, so nothing else is accepted
    region_pattern = r"[a-z]+-[a-z]+-\d+"
    region_words = "<area>-<city>-<number>, e.g. us-ashburn-1"
    region_sample = "us-ashburn-1"
    owner_tags = True  # freeform tags broker-run / broker-install on every instance and network object

    @classmethod
    def valid_id(cls, kind: str, provider_id: str) -> bool:
        """An OCID: ``ocid1.<type>.<realm>.[region][.future].<unique>`` (letters, digits, ``-``/``_`` per part; the
        region part may be empty, as in ``ocid1.tenancy.oc1..aaaa``)."""
        return isinstance(provider_id, str) and re.fullmatch(_OCID, provider_id) is not None

    @classmethod
    def quota_limit(cls, instance_type: str, *, spot: bool = False) -> tuple[str, str, str] | None:
        from broker.providers.oci.limits import oci_limit_name

        name = oci_limit_name(instance_type)
        return None if name is None else (name, f"compute limit {name} (GPUs per AD)", "compute")

    @classmethod
    def snapshot_rows(cls, reference_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        from broker.providers.oci.snapshot import snapshot_rows

        return snapshot_rows(reference_dir)

    @classmethod
    def id_form(cls, kind: str) -> str:
        return "an OCID, ocid1.<type>.<realm>.[region].<unique>"

    def __init__(self, config: dict[str, Any] | None = None, *, service_endpoint: str | None = None,
                 compartment_id: str | None = None, availability_domains: list[str] | None = None,
                 region: str | None = None, image_id: str | None = None, subnet_id: str | None = None,
                 retry_strategy: Any = None, circuit_breaker_strategy: Any = None,
                 instance_principal: bool | None = None, conflict_wait_s: float = 120.0,
                 sleep: Callable[[float], None] = time.sleep):
        from broker.core.config import settings

        s = settings()
        self.api = OCIApi(config, service_endpoint=service_endpoint, compartment_id=compartment_id, region=region,
                          retry_strategy=retry_strategy, circuit_breaker_strategy=circuit_breaker_strategy,
                          sleep=sleep)
        self._ads = list(availability_domains) if availability_domains else None
        self._image_id = image_id or s.oci_image_id
        self._subnet_id = subnet_id or s.oci_subnet_id
        self.instance_principal = s.oci_instance_principal if instance_principal is None else instance_principal
        self._conflict_wait_s = conflict_wait_s
        #: instance ids this adapter sent a terminate for (preemption() tells them from OCI's reclaims)
        self._terminated_here: set[str] = set()

    @property
    def region(self) -> str | None:
        return self.api.region

    @property
    def tenancy(self) -> str:
        return self.api.tenancy

    @property
    def compartment(self) -> str:
        return self.api.compartment

    # ------------------------------------------------------------------------------------ read side
    def check(self) -> ProviderCheck:
        """Configured = the config file/profile (or dict) is present and passes ``oci.config.validate_config``.
        No network call (``usable`` stays None)."""
        try:
            cfg = self.api.load_config()
        except ImportError:
            return ProviderCheck(provider=PROVIDER, configured=False, detail="the oci SDK is not installed",
                                 hint=install_hint())
        except AuthError as e:
            detail = "the oci SDK is not installed" if e.call == "import oci" else e.message
            return ProviderCheck(provider=PROVIDER, configured=False, detail=detail, hint=e.hint)
        src = self.api.config_source
        region = self.api.region or cfg.get("region")
        try:
            self.api.client("identity")  # loads the private key (local, no network): catches a bad key or passphrase
        except AuthError as e:
            return ProviderCheck(provider=PROVIDER, configured=True, usable=False, detail=f"{src}: {e.message}",
                                 hint=e.hint)
        ep = self.api.endpoint
        return ProviderCheck(provider=PROVIDER, configured=True, usable=None,
                             detail=f"{src}, region {region}" + (f", endpoint {ep}" if ep else ""))

    def armed_layers(self) -> list[str]:
        """Teardown layers armed for nodes this adapter launches (:func:`node_layers` of ``instance_principal``)."""
        return node_layers(self.instance_principal)

    def price_note(self) -> str | None:
        from broker.plan.catalog import snapshot_info

        return f"prices: OCI list-price snapshot {snapshot_info(PROVIDER)[0]} (OCI has no per-account price API)"

    @classmethod
    def public_price_offers(cls) -> tuple[list[Offer], str]:
        """(the snapshot's shapes repriced from Oracle's public price list, that source in words) for ``broker
        catalog refresh`` (:attr:`live_price_list` ``"public"``: no credentials).  Raises httpx errors when the list
        cannot be fetched, ValueError when it holds no GPU SKU."""
        from broker.providers.oci import prices

        return prices.oci_live_offers(), f"Oracle public price list {prices.OCI_PRICE_LIST_URL}"

    def availability_domains(self) -> list[str]:
        """AD names of the region (``IdentityClient.list_availability_domains(tenancy)``), or the constructor's."""
        if self._ads is None:
            self._ads = _offers.availability_domains(self.api)
        return list(self._ads)

    def offers(self, req: Requirements) -> list[Offer]:
        """GPU shapes priced from the snapshot; per AD (zone) and with the profile's region when configured.

        Raises AuthError / TransientError when configured but the AD listing fails."""
        base = _offers.with_preemptible_price(snapshot_offers(req))
        if not self.api.configured():
            return base
        return _offers.offers_per_ad(base, self.region, self.availability_domains())

    def quotas(self, req: Requirements, offers: list[Offer]) -> list[Quota]:
        """``compute`` GPU limits per AD for the shapes in ``offers`` (``limit = used + available``, unit GPUs).

        Unconfigured -> []. Limits a tenancy does not know (404) are skipped."""
        if not self.api.configured():
            return []
        ads = self.availability_domains() if not any(o.zone for o in offers if o.provider == PROVIDER) else []
        return _offers.quotas(self.api, offers, ads)

    def limit_values(self, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Service-limit values of ``compute`` (``list_limit_values``, all pages), for ``broker quota check``."""
        return _offers.limit_values(self.api, names)

    def capacity(self, offers: list[Offer]) -> list[Capacity]:
        """One ``create_compute_capacity_report`` per AD for the shapes offered there.  Unconfigured -> []."""
        if not self.api.configured():
            return []
        ads = self.availability_domains() if any(o.provider == PROVIDER and not o.zone for o in offers) else []
        return _offers.capacity(self.api, offers, ads)

    def boot_wait_command(self, ssh_user: str) -> str:
        """Shell that waits for this adapter's boot script on a node of ``ssh_user`` (cloud-init, then
        ``<workroot>/boot.done``); exit 0 = booted.  Run it after SSH accepts logins, before preflight."""
        from broker.core.nodescripts import node_workroot

        return boot_wait_command(node_workroot(ssh_user, self.node_workroot))

    # ------------------------------------------------------------------------------------ lifecycle
    def bootstrap(self, run_id: str, offers: list[Offer], topology: str, rec: Recorder) -> dict[str, Any]:
        """Network for a run (:func:`broker.providers.oci.network.bootstrap`): VCN, internet gateway, default
        route, security list, regional subnet, each recorded with ``rec`` before and after its create and tagged
        RUN_TAG + INSTALL_TAG (``rec.installation_id``).  With ``OCI_SUBNET_ID`` set, reuses that subnet and
        creates nothing.  Returns ids for :attr:`NodeRequest.network`.
        Raises AuthError, QuotaError (VCN limits), AmbiguousCreate, TransientError, ProviderError."""
        if self._subnet_id:
            return network.reuse_subnet(self.api, self._subnet_id, rec)
        return network.bootstrap(self.api, run_id, rec)

    def open_ingress(self, net: dict[str, Any], rules: list[Ingress], rec: Recorder) -> None:
        """Add ``rules`` to the run's security list (:func:`broker.providers.oci.network.open_ingress`: protocol
        17 / 6 with a destination port range, from each rule's CIDR).  Raises ProviderError, TransientError."""
        network.open_ingress(self.api, net, rules, rec)

    def create_instance(self, req: NodeRequest) -> str:
        """``launch_instance`` of ``req.offer`` in AD ``req.offer.zone`` into ``req.network["subnet_id"]``
        (:func:`broker.providers.oci.lifecycle.create_instance`).  ``opc_retry_token`` = ``client_token``, also
        tagged; not retried.

        Returns the instance OCID.  Raises CapacityError ("Out of host capacity."), QuotaError (LimitExceeded, with
        a ready ``broker quota request`` command; ``scope`` = the AD), AuthError, AmbiguousCreate (5xx / timeout:
        verify with :meth:`find_by_token`), TransientError, ProviderError.
        """
        ad = req.offer.zone or self.availability_domains()[0]
        subnet = req.network.get("subnet_id") or self._subnet_id
        if not subnet:
            raise ProviderError(PROVIDER, "launch_instance", "no subnet: call bootstrap first or set OCI_SUBNET_ID")
        shape = req.offer.instance_type
        image = (req.image, "opc") if req.image else lifecycle.image_for(self.api, shape, self._image_id)
        return lifecycle.create_instance(self.api, req, ad=ad, subnet=subnet, image=image,
                                         instance_principal=self.instance_principal, workroot=self.node_workroot)

    def find_by_token(self, client_token: str, region: str | None = None) -> str | None:
        """A live instance launched with ``client_token`` (tag ``broker-client-token``), if any."""
        return lifecycle.find_by_token(self.api, client_token)

    def describe_instance(self, provider_id: str, *, region: str | None = None) -> InstanceInfo:
        """State (pending/running/stopped/terminating/terminated) and, when running, the primary VNIC's private and
        public IP.  A 404 means gone: ``terminated``."""
        return lifecycle.describe_instance(self.api, self.require_id("instance", provider_id, "get_instance"))

    def terminate(self, kind: str, provider_id: str, *, region: str | None = None,
                  attrs: dict[str, Any] | None = None) -> bool:
        """Idempotent terminate / delete; a gone resource is True.  429 / 5xx / 409 Conflict: TransientError (the
        core retries).

        * ``instance``: ``terminate_instance(id, preserve_boot_volume=False)``; True when already gone (404 or
          TERMINATED), else False (termination is asynchronous: poll :meth:`describe_instance`).
        * ``subnet`` / ``security_list`` / ``vcn``: ``delete_*``; 404 = gone -> True.
        * ``internet_gateway``: route rules targeting it are first removed from its VCN's default route table.
        """
        self.require_id(kind, provider_id, f"terminate {kind}")
        if kind == "instance":
            self._terminated_here.add(provider_id)  # before the call: a terminate that reached OCI is broker's
            return lifecycle.terminate_instance(self.api, provider_id)
        return network.delete_network_object(self.api, kind, provider_id, attrs, self._conflict_wait_s)

    def preemption(self, resource_id: str) -> str | None:
        """OCI reclaimed preemptible instance ``resource_id``: it is TERMINATING / TERMINATED and this adapter did
        not terminate it (:func:`.lifecycle.preemption`; OCI records no reason on the instance, so a terminate sent
        by another broker process reads as a preemption here: the caller asks the ledger first,
        :func:`broker.run.attempts.broker_ended`).  Raises ProviderError."""
        rid = self.require_id("instance", resource_id, "get_instance")
        return lifecycle.preemption(self.api, rid, rid in self._terminated_here)
    def stop(self, provider_id: str, *, region: str | None = None) -> None:
        """``instance_action(id, "STOP")``: the boot volume stays (and bills; most GPU shapes keep billing in
        full, see :meth:`stopped_rate`).  Raises TransientError (429 / 5xx / 409 in progress), ProviderError."""
        lifecycle.instance_action(self.api, self.require_id("instance", provider_id, "instance_action"), "STOP")

    def start(self, provider_id: str, *, region: str | None = None) -> None:
        """``instance_action(id, "START")``; the public IP may change (ephemeral): describe again.  Raises
        TransientError, ProviderError (e.g. out of host capacity)."""
        lifecycle.instance_action(self.api, self.require_id("instance", provider_id, "instance_action"), "START")

    def stopped_rate(self, provider_id: str, *, region: str | None = None,
                     attrs: dict[str, Any] | None = None) -> tuple[float, str]:
        """Boot volume $/h, plus the shape's full list price for GPU shapes OCI bills while stopped (all but
        VM.GPU.A10.x; :func:`.lifecycle.keeps_billing_stopped`)."""
        return lifecycle.stopped_rate(self.api, self.require_id("instance", provider_id, "get_instance"), attrs)

    def list_tagged(self, run_id: str | None = None) -> list[TaggedResource]:
        """Instances (not TERMINATED) and network objects (VCNs, subnets, internet gateways, security lists) in the
        compartment whose freeform tag ``broker-run`` is ``run_id`` (any value when None); ``installation_id``
        from ``broker-install``.  An unreadable answer is a ProviderError, never an empty list."""
        return lifecycle.list_tagged(self.api, run_id)

    def delete_run_network(self, run_id: str) -> list[TaggedResource]:
        """Everything tagged with ``run_id`` deleted in dependency order (:data:`DELETE_ORDER`); returns the
        instances still terminating."""
        return lifecycle.delete_run_network(self.api, run_id, self._conflict_wait_s)

    # ------------------------------------------------------------------------------------ quota requests
    def request_quota(self, quota: Quota, value: float, reason: str, *, draft: bool = False) -> QuotaRequest:
        """File (or draft) an increase of an OCI ``compute`` limit (:func:`.quota_requests.request_quota`)."""
        return quota_requests.request_quota(self.api, quota, value, reason, draft=draft)

    def quota_request_status(self, request: QuotaRequest) -> QuotaRequest:
        """The request refreshed with ``get_limits_increase_request``."""
        return quota_requests.quota_request_status(self.api, request)
