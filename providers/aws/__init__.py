"""AWS adapter (boto3): GPU instance types, vCPU quotas, zone offerings, lifecycle, quota requests.

Facts (docs/reference/cloud-apis.md section C):

* Offers are instance types with an on-demand price from the price snapshot in effect (:mod:`broker.plan.catalog`);
  when credentials are present each type is expanded into one offer per availability zone that offers it
  (``describe_instance_type_offerings``; offered is not capacity).  Live list prices come from the Pricing API
  (:meth:`AWSProvider.live_prices`, used by ``broker catalog refresh``).
* Quotas are EC2 Service Quotas counted in **vCPUs**: ``L-DB2E81BA`` (running on-demand G and VT) and
  ``L-417A185B`` (running on-demand P); spot codes only when spot is asked for.  Usage comes from CloudWatch
  ``AWS/Usage`` ``ResourceCount``; when that read fails ``used`` is 0 and the quota's ``description`` says so.
* Lifecycle: a security group per run in the default VPC (or the VPC of ``AWS_SUBNET_ID``) with an all-protocol
  self-referencing rule (nodes talk to each other on any port) and tcp/22 from 0.0.0.0/0 (SSH from wherever the
  CLI runs; key-only login), a cluster placement group for ``multi-node``, and ``run_instances`` with
  ``InstanceInitiatedShutdownBehavior="terminate"`` and user data that schedules ``shutdown -h`` at the hard
  deadline plus grace: the node terminates itself even if no broker process is alive anywhere.  Everything
  created carries RUN_TAG (run id) and INSTALL_TAG (installation id).
* Launch calls go through a client with one attempt and carry ``ClientToken`` = the ledger resource id plus the
  tag ``broker-client-token``, looked up before launching (:meth:`AWSProvider.find_by_token`).

Layout (this module binds the verbs; each file below owns one concern):

* :mod:`.api` -- credentials, boto3 clients, retries, the one error mapping (``AWSApi.errors``), fail-closed
  readers;
* :mod:`.offers` -- snapshot offers per zone, instance-type facts, capacity, live prices, vCPU quotas;
* :mod:`.network` -- security group and placement group, their deletes, the delete order;
* :mod:`.lifecycle` -- launch, describe, terminate, tag listing, lookup by client token, run cleanup;
* :mod:`.userdata` -- the boot script (dead-man switch, idle stop, SSH key, boot-done marker);
* :mod:`.quota_requests` -- Service Quotas increase requests.

Offline rule: creating a boto3 client resolves credentials and may probe the instance metadata service, so no
client is created unless :meth:`AWSProvider.check` finds credentials in the environment or ``~/.aws`` files (or a
session / client factory was injected).  boto3 is imported lazily inside functions.
"""

from __future__ import annotations

import re

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from broker.core.model import Capacity, Offer, Quota, Requirements
from broker.core.provider import Provider, ProviderCheck, Recorder
from broker.providers.declared import AWS
from broker.providers.aws import lifecycle, network, offers as _offers, quota_requests
from broker.providers.aws.api import (CREDENTIALS_HINT, PROVIDER, AWSApi, ClientFactory, credentials_present,
                                      install_hint, map_error, quota_scope)
from broker.providers.aws.lifecycle import DLAMI_NAME, TOKEN_TAG
from broker.providers.aws.network import DELETE_ORDER
from broker.providers.aws.offers import PRICING_REGION, REGION_LOCATIONS
from broker.providers.aws.userdata import BOOT_DONE, NODE_STATE_DIR, SSH_USER, boot_wait_command, user_data_script

if TYPE_CHECKING:
    from broker.core.records import Ingress, InstanceInfo, NodeRequest, QuotaRequest, TaggedResource

__all__ = ["AWSApi", "AWSProvider", "BOOT_DONE", "DELETE_ORDER", "DLAMI_NAME", "NODE_STATE_DIR",
           "PRICING_REGION", "REGION_LOCATIONS", "SSH_USER", "TOKEN_TAG", "boot_wait_command", "credentials_present",
           "map_error", "quota_scope", "user_data_script"]


_AWS_ID = r"([a-z]+)-[0-9a-f]{1,17}"
_AWS_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}"
#: an AWS region code (docs.aws.amazon.com "Regions and Zones"): us-east-1, us-gov-west-1, ap-southeast-2
#: ledger kind -> EC2 id prefix
_AWS_PREFIX = {"instance": "i", "security_group": "sg", "volume": "vol", "subnet": "subnet", "vpc": "vpc",
               "route_table": "rtb", "internet_gateway": "igw", "nat_gateway": "nat"}


class AWSProvider(Provider):
    """Amazon EC2 GPU instances (``simulated`` on a multi-GPU type, ``multi-node`` in one security group).

    Arguments (all optional, for tests and embedding): ``session`` a ``boto3.session.Session``; ``endpoint_url``
    (default ``AWS_ENDPOINT_URL``); ``region`` (default ``AWS_DEFAULT_REGION``, else the session's, else
    us-east-1); ``client_factory(service, region, config)`` returning a client (e.g. one wrapped in a Stubber);
    ``ssh_user`` (default ``AWS_SSH_USER``, else ``ubuntu``: the Deep Learning AMI's) the image's login user.
    The constructor does no I/O.
    """

    name = PROVIDER
    #: what it can do, and why not (providers/declared.py; the registry reads the same object)
    caps = AWS
    #: AWS region codes are ``<geo>[-gov]-<direction>-<n>`` (``us-east-1``, ``us-gov-west-1``, ``ap-southeast-2``);
    #: boto3 builds ``ec2.<region>.amazonaws.com`` from them, so nothing else is accepted
    region_pattern = r"[a-z]{2}(?:-gov)?-[a-z]+-\d{1,2}"
    region_words = "<geo>[-gov]-<direction>-<number>, e.g. us-east-1"
    region_sample = "us-east-1"
    #: describe's / list's ``usd_per_hour`` prices the EBS root volume really created (tag broker-disk-gib), so the
    #: core adds no storage rate of its own (the image's snapshot may make it larger than the recipe's disk)
    reported_rate_includes_storage = True
    owner_tags = True  # tags broker-run / broker-install on every instance, security group, placement group

    @classmethod
    def valid_id(cls, kind: str, provider_id: str) -> bool:
        """EC2 ids are ``<prefix>-<hex>`` (``i-`` instances, ``sg-`` security groups, ``vol-`` volumes, ``subnet-``,
        ``vpc-`` ...; 8 or 17 hex digits in practice); a placement group is named (letters, digits, ``._-``)."""
        if not isinstance(provider_id, str):
            return False
        if kind == "placement_group":
            return re.fullmatch(_AWS_NAME, provider_id) is not None
        m = re.fullmatch(_AWS_ID, provider_id)
        return m is not None and m.group(1) == _AWS_PREFIX.get(kind, m.group(1))

    @classmethod
    def quota_limit(cls, instance_type: str, *, spot: bool = False) -> tuple[str, str, str] | None:
        from broker.providers.aws.limits import aws_quota_code

        q = aws_quota_code(instance_type, spot=spot)
        return None if q is None else (q.code, q.name, "ec2")

    @classmethod
    def snapshot_rows(cls, reference_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        from broker.providers.aws.snapshot import snapshot_rows

        return snapshot_rows(reference_dir)

    @classmethod
    def id_form(cls, kind: str) -> str:
        if kind == "placement_group":
            return "a placement group name: letters, digits and . _ -"
        return f"{_AWS_PREFIX.get(kind, '<prefix>')}-<hex digits>, e.g. {_AWS_PREFIX.get(kind, 'i')}-0123456789abcdef0"

    def tagged_resource(self, kind: str, provider_id: str, *, region: str | None = None,
                        run_id: str | None = None) -> TaggedResource | None:
        """One object's broker tags read in its own region (``list_tagged`` sees the configured region only).
        Raises AuthError when no credentials are configured (never None: that would read as "gone")."""
        if not self.configured():
            from broker.core.provider import AuthError

            raise AuthError(PROVIDER, f"describe {kind} {provider_id}", "no AWS credentials configured",
                            hint="configure AWS credentials (see .env.example), then retry")
        return lifecycle.tagged_resource(self.api, kind, self.require_id(kind, provider_id, f"describe {kind}"),
                                         region or self.region, run_id)

    def __init__(self, session: Any = None, endpoint_url: str | None = None, region: str | None = None,
                 client_factory: ClientFactory | None = None, ssh_user: str | None = None):
        import os

        self.api = AWSApi(session=session, endpoint_url=endpoint_url, region=region, client_factory=client_factory)
        #: the image's login user: the key goes into its home, broker logs in as it (AWS_AMI_ID may name an image
        #: whose user is not the Deep Learning AMI's ``ubuntu``: ec2-user on Amazon Linux, say)
        self.ssh_user = ssh_user or os.environ.get("AWS_SSH_USER") or SSH_USER
        self._cache = _offers.OfferCache()

    @property
    def region(self) -> str:
        return self.api.region

    @property
    def endpoint_url(self) -> str | None:
        return self.api.endpoint_url

    def configured(self) -> bool:
        return self.api.configured()

    # ------------------------------------------------------------------ read side
    def check(self) -> ProviderCheck:
        """Credentials present? Decided from env vars and ``~/.aws`` files only (no network)."""
        if self.api.factory is not None or self.api.session is not None:
            return ProviderCheck(provider=PROVIDER, configured=True, detail="injected session/client factory")
        ok, where = credentials_present()
        if not ok and self.api.configured():  # keys or a profile given in .env (the settings object)
            ok, where = True, "AWS keys / profile in .env"
        if importlib.util.find_spec("boto3") is None:  # the whole fix in one hint: install, then credentials
            detail = f"{where}, but boto3 is not installed" if ok else f"boto3 is not installed and {where}"
            return ProviderCheck(provider=PROVIDER, configured=False, detail=detail,
                                 hint=install_hint() + ("" if ok else "; then " + CREDENTIALS_HINT))
        return ProviderCheck(provider=PROVIDER, configured=ok, detail=where,
                             hint=None if ok else "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE "
                                                  "(prices and plans work from the snapshot without them)")

    def price_note(self) -> str:
        from broker.plan.catalog import snapshot_info

        return (f"prices: AWS us-east-1 on-demand snapshot {snapshot_info('aws')[0]} (third-party); live list prices "
                "via `broker catalog refresh` (AWS Pricing API, needs AWS credentials)")

    def offers(self, req: Requirements) -> list[Offer]:
        """GPU instance types with on-demand $/hour; one offer per offering AZ when configured, else one per type
        with ``zone=None`` (region = the snapshot's).  Raises AuthError, TransientError, ProviderError."""
        base = _offers.snapshot(req)
        if not base or not self.configured():
            return base
        return _offers.offers(self.api, base, self._cache)

    def offered_zones(self, instance_types: list[str], region: str | None = None) -> dict[str, set[str]]:
        """Instance type -> AZs of ``region`` offering it (``describe_instance_type_offerings``)."""
        return _offers.offered_zones(self.api, instance_types, self._cache, region)

    def capacity(self, offers: list[Offer]) -> list[Capacity]:
        """Per (type, AZ): ``NOT_OFFERED`` where the AZ does not offer the type, else ``UNKNOWN`` (EC2 exposes no
        capacity figure: offered is not capacity).  Empty when not configured."""
        if not offers or not self.configured():
            return []
        return _offers.capacity(self.api, offers, self._cache)

    def live_prices(self, instance_types: list[str], region: str | None = None) -> dict[str, float]:
        """On-demand Linux list price ($/hour) per instance type from the AWS Pricing API."""
        return _offers.live_prices(self.api, instance_types, region)

    def quotas(self, req: Requirements, offers: list[Offer]) -> list[Quota]:
        """The vCPU quotas covering ``offers`` (:func:`.offers.quotas`).  Empty when not configured.
        Raises AuthError, TransientError, ProviderError."""
        if not offers or not self.configured():
            return []
        return _offers.quotas(self.api, req, offers)

    def boot_wait_command(self, ssh_user: str) -> str:
        """Shell that waits for this adapter's boot script on a node of ``ssh_user`` (cloud-init, then
        ``<workroot>/boot.done``); exit 0 = booted.  Run it after SSH accepts logins, before preflight."""
        from broker.core.nodescripts import node_workroot

        return boot_wait_command(node_workroot(ssh_user, self.node_workroot))

    # ------------------------------------------------------------------ lifecycle
    def bootstrap(self, run_id: str, offers: list[Offer], topology: str, rec: Recorder) -> dict[str, Any]:
        """Security group and, for ``multi-node``, a cluster placement group (:func:`.network.bootstrap`), each
        recorded with ``rec`` and tagged RUN_TAG + INSTALL_TAG.  Returns ``{"region", "zone", "vpc_id",
        "subnet_id", "security_group_id", "placement_group", "nodes"}``."""
        from broker.core.config import settings

        region = (offers[0].region if offers else None) or self.region
        zone = offers[0].zone if offers else None
        return network.bootstrap(self.api, run_id, region, zone, topology, len(offers), rec,
                                 getattr(settings(), "aws_subnet_id", None))

    def open_ingress(self, net: dict[str, Any], rules: list[Ingress], rec: Recorder) -> None:
        """``authorize_security_group_ingress`` on the run's security group (:func:`.network.open_ingress`): one
        ``IpPermissions`` entry per rule (protocol, port range, the rule's CIDR).  Raises ProviderError,
        TransientError."""
        network.open_ingress(self.api, net, rules, rec)

    def find_by_token(self, client_token: str, region: str | None = None) -> str | None:
        """A live instance launched with ``client_token`` (tag ``broker-client-token``), if any."""
        return lifecycle.find_by_token(self.api, client_token, region)

    def create_instance(self, req: NodeRequest) -> str:
        """``run_instances`` for one node (:func:`.lifecycle.create_instance`); returns the instance id.

        Raises CapacityError, QuotaError (``scope`` = region + family bucket), AuthError, AmbiguousCreate,
        TransientError."""
        region = req.offer.region or req.network.get("region") or self.region
        zone = req.offer.zone or req.network.get("zone")
        return lifecycle.create_instance(self.api, req, region, zone, ssh_user=self.ssh_user,
                                         workroot=self.node_workroot)

    def describe_instance(self, provider_id: str, *, region: str | None = None) -> InstanceInfo:
        """State (pending/running/terminating/terminated/stopped) and addresses; ``terminated`` when unknown."""
        return lifecycle.describe_instance(self.api, self.require_id("instance", provider_id, "describe_instances"),
                                           region, self.ssh_user)

    def preemption(self, resource_id: str) -> str | None:
        """EC2's reason when it interrupted spot instance ``resource_id`` (state reason
        ``Server.SpotInstanceTermination``, spot request status ``instance-terminated-by-price`` ...,
        :func:`.lifecycle.preemption`); None when it did not or the instance is not spot.  Raises ProviderError."""
        return lifecycle.preemption(self.api, self.require_id("instance", resource_id, "describe_instances"), None)

    def terminate(self, kind: str, provider_id: str, *, region: str | None = None,
                  attrs: dict[str, Any] | None = None) -> bool:
        """Idempotent; a gone resource is True.  instance: True once describe shows ``terminated``; security_group
        / placement_group: True once deleted (TransientError while instances still hold them: DependencyViolation,
        InUse; and on 429/5xx: the core retries)."""
        return lifecycle.terminate(self.api, kind, self.require_id(kind, provider_id, f"terminate {kind}"), region)

    def stop(self, provider_id: str, *, region: str | None = None) -> None:
        """``StopInstances``: the EBS volumes stay (and bill, see :meth:`stopped_rate`).  Spot instances cannot be
        stopped (EC2 answers UnsupportedOperation: a ProviderError).  Raises TransientError, ProviderError."""
        lifecycle.set_running(self.api, self.require_id("instance", provider_id, "stop_instances"), region, False)

    def start(self, provider_id: str, *, region: str | None = None) -> None:
        """``StartInstances``; the public IP changes (no Elastic IP): describe again.  Raises CapacityError
        (InsufficientInstanceCapacity), TransientError, ProviderError."""
        lifecycle.set_running(self.api, self.require_id("instance", provider_id, "start_instances"), region, True)

    def stopped_rate(self, provider_id: str, *, region: str | None = None,
                     attrs: dict[str, Any] | None = None) -> tuple[float, str]:
        """The EBS volumes' $/h (sizes from ``DescribeVolumes``)."""
        return lifecycle.stopped_rate(self.api, self.require_id("instance", provider_id, "describe_instances"),
                                      region, attrs)

    def list_tagged(self, run_id: str | None = None) -> list[TaggedResource]:
        """Instances (not terminated), security groups and placement groups carrying ``broker-run`` (= ``run_id``
        when given) in the configured region, with ``installation_id``.  Empty when not configured; an unreadable
        answer is a ProviderError."""
        if not self.configured():
            return []
        return lifecycle.list_tagged(self.api, run_id)

    def delete_run_network(self, run_id: str) -> list[TaggedResource]:
        """Everything tagged ``run_id`` deleted in dependency order (:data:`DELETE_ORDER`); returns the instances
        still shutting down."""
        return lifecycle.delete_run_network(self.api, run_id)

    # ------------------------------------------------------------------ quota requests
    def request_quota(self, quota: Quota, value: float, reason: str, *, draft: bool = False) -> QuotaRequest:
        """``request_service_quota_increase`` in vCPUs, or the draft form (:func:`.quota_requests.request_quota`)."""
        return quota_requests.request_quota(self.api, quota, value, reason, draft=draft)

    def quota_request_status(self, request: QuotaRequest) -> QuotaRequest:
        """``get_requested_service_quota_change``: the request's state refreshed."""
        return quota_requests.quota_request_status(self.api, request)
