"""AWS adapter (boto3): GPU instance types, vCPU quotas, zone offerings, lifecycle, quota requests.

Facts (reference/cloud-apis.md section C):

* Offers are instance types with an on-demand price from the price snapshot in effect (:mod:`broker.catalog`);
  when credentials are present each type is expanded into one offer per availability zone that offers it
  (``describe_instance_type_offerings``; offered is not capacity).  Live list prices come from the Pricing API
  (:meth:`AWSProvider.live_prices`, used by ``broker catalog refresh``).
* Quotas are EC2 Service Quotas counted in **vCPUs**: ``L-DB2E81BA`` (running on-demand G and VT) and
  ``L-417A185B`` (running on-demand P); spot codes only when spot is asked for.  Usage comes from CloudWatch
  ``AWS/Usage`` ``ResourceCount`` (one ``get_metric_statistics`` per family, maximum over the last 15 minutes);
  when that read fails ``used`` is 0 and the quota's ``description`` says so.
* Lifecycle: a security group per run in the default VPC (or the VPC of ``AWS_SUBNET_ID``) with an all-protocol
  self-referencing rule (nodes talk to each other on any port) and tcp/22 from 0.0.0.0/0 (SSH from wherever the
  CLI runs; key-only login), a cluster placement group for ``multi-node``, and ``run_instances`` with
  ``InstanceInitiatedShutdownBehavior="terminate"`` and user data that schedules ``shutdown -h`` at the hard
  deadline plus grace: the node terminates itself even if no broker process is alive anywhere.
* Launch calls go through a client with ``retries={"mode": "standard", "total_max_attempts": 1}`` (botocore
  would otherwise send a 500 ``InsufficientInstanceCapacity`` three times) and carry ``ClientToken`` = the ledger
  resource id; the instance is also tagged ``broker-client-token`` and looked up by that tag before launching, so
  a retried create after a crash returns the instance that exists instead of a second one.
* Nodes run the AWS Deep Learning AMI (Ubuntu): SSH user ``ubuntu``.

Offline rule: creating a boto3 client resolves credentials and may probe the instance metadata service, so no
client is created unless :meth:`AWSProvider.check` finds credentials in the environment or ``~/.aws`` files (or a
session / client factory was injected).  boto3 is imported lazily inside methods.
"""

from __future__ import annotations

import configparser
import importlib.util
import math
import os
import shlex
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable

from broker.model import Capacity, Offer, Quota, Requirements, utcnow
from broker.provider import (RUN_TAG, AuthError, BadInput, CapacityError, InstanceInfo, NodeRequest, NotSupported,
                             Provider, ProviderCheck, ProviderError, QuotaError, QuotaRequest, Recorder,
                             TaggedResource, TransientError)

#: Tag carrying the idempotency token (the ledger resource id) on every instance broker launches.
TOKEN_TAG = "broker-client-token"
#: SSH user of the Deep Learning AMI (Ubuntu).
SSH_USER = "ubuntu"
#: Where the node keeps broker's own files (idle stop script, pid and log).
NODE_STATE_DIR = "/var/lib/broker"
#: What to do when boto3 is missing (the `aws` extra).
INSTALL_HINT = "install the AWS SDK: pip install -e '.[aws]' (or pip install boto3)"
#: Name pattern of the default image (AWS Deep Learning OSS Nvidia Driver AMI with PyTorch, Ubuntu 22.04).
DLAMI_NAME = "Deep Learning OSS Nvidia Driver AMI GPU PyTorch * (Ubuntu 22.04) *"
#: Region of the Pricing API endpoint.
PRICING_REGION = "us-east-1"

#: Region code -> the Pricing API's ``location`` attribute.
REGION_LOCATIONS = {
    "us-east-1": "US East (N. Virginia)", "us-east-2": "US East (Ohio)", "us-west-1": "US West (N. California)",
    "us-west-2": "US West (Oregon)", "ca-central-1": "Canada (Central)", "eu-west-1": "EU (Ireland)",
    "eu-west-2": "EU (London)", "eu-west-3": "EU (Paris)", "eu-central-1": "EU (Frankfurt)",
    "eu-north-1": "EU (Stockholm)", "ap-northeast-1": "Asia Pacific (Tokyo)", "ap-northeast-2": "Asia Pacific (Seoul)",
    "ap-southeast-1": "Asia Pacific (Singapore)", "ap-southeast-2": "Asia Pacific (Sydney)",
    "ap-south-1": "Asia Pacific (Mumbai)", "sa-east-1": "South America (Sao Paulo)",
}

_STATE_MAP = {"pending": "pending", "running": "running", "shutting-down": "terminating",
              "terminated": "terminated", "stopping": "stopped", "stopped": "stopped"}
_LIVE_STATES = ["pending", "running", "shutting-down", "stopping", "stopped"]

_AUTH_CODES = {"AuthFailure", "UnauthorizedOperation", "ExpiredToken", "ExpiredTokenException",
               "InvalidClientTokenId", "UnrecognizedClientException", "SignatureDoesNotMatch",
               "AccessDenied", "AccessDeniedException", "OptInRequired", "InvalidAccessKeyId"}
_THROTTLE_CODES = {"RequestLimitExceeded", "Throttling", "ThrottlingException", "TooManyRequestsException",
                   "ServiceUnavailable", "Unavailable", "InternalError", "InternalFailure", "ServiceException",
                   "RequestTimeout", "RequestTimeoutException"}
_QUOTA_CODES = {"VcpuLimitExceeded", "InstanceLimitExceeded", "MaxSpotInstanceCountExceeded"}
_CAPACITY_CODES = {"InsufficientInstanceCapacity", "InsufficientCapacityOnHost", "InsufficientHostCapacity",
                   "UnfulfillableCapacity", "InsufficientFreeAddressesInSubnet", "SpotMaxPriceTooLow",
                   "InsufficientReservedInstanceCapacity"}


# --------------------------------------------------------------------------------------------------- user data
def user_data_script(deadline: datetime | None, grace_seconds: float, ssh_public_key: str,
                     onstart: str | None = None, *, idle_minutes: float | None = None,
                     idle_poll_s: float = 30.0, state_dir: str = NODE_STATE_DIR,
                     done_file: str | None = None) -> str:
    """The user-data shell script run once by cloud-init (as root) at first boot.

    1. Arms the dead-man switch first: ``shutdown -h +M`` where ``M`` = whole minutes (rounded up) from *boot
       time* to ``deadline + grace_seconds`` (computed on the node from the absolute epoch, so slow boots do not
       push the deadline out; 0 when already past).  With ``InstanceInitiatedShutdownBehavior="terminate"`` the
       shutdown terminates the instance and stops all billing.  No deadline: nothing is scheduled.
    2. With ``idle_minutes``: starts the idle stop (:func:`broker.nodescripts.idle_watch_launcher`, files in
       ``state_dir``): once ``done_file`` (default ``/home/ubuntu/broker/job.done``; the SSH runner touches it
       when the job has ended) exists and no SSH session was seen for ``idle_minutes``, it runs
       ``shutdown -h now`` (a terminate, as in 1).
       ``idle_poll_s``: seconds between its checks.
    3. Appends ``ssh_public_key`` to ``$BROKER_SSH_HOME/.ssh/authorized_keys`` (default ``/home/ubuntu``).
    4. Runs ``onstart`` (extra shell) if given.
    """
    lines = ["#!/bin/bash", "# broker node bootstrap (user data)", "set -u"]
    if deadline is not None:
        if deadline.tzinfo is None:
            deadline = deadline.replace(tzinfo=timezone.utc)
        fire_epoch = int(math.ceil(deadline.timestamp() + float(grace_seconds)))
        lines += [
            "# dead-man switch: shutdown at the hard deadline + grace; shutdown behaviour 'terminate' ends billing",
            f"BROKER_FIRE_EPOCH={fire_epoch}",
            'broker_now=$(date +%s)',
            'broker_minutes=$(( (BROKER_FIRE_EPOCH - broker_now + 59) / 60 ))',
            'if [ "$broker_minutes" -lt 0 ]; then broker_minutes=0; fi',
            'shutdown -h "+${broker_minutes}" "broker: hard deadline reached, terminating" '
            '|| echo "broker: could not schedule shutdown" >&2',
        ]
    if idle_minutes:
        from broker.nodescripts import job_done_path
        from broker.nodescripts import idle_watch_launcher

        lines.append(idle_watch_launcher(
            idle_minutes, 'shutdown -h now "broker: idle stop (job ended, no SSH session), terminating"',
            done_file=done_file or job_done_path(SSH_USER), state_dir=state_dir, poll_s=idle_poll_s).rstrip("\n"))
    key = ssh_public_key.strip()
    if key:
        lines += [
            'BROKER_SSH_HOME="${BROKER_SSH_HOME:-/home/' + SSH_USER + '}"',
            'mkdir -p "$BROKER_SSH_HOME/.ssh" && chmod 700 "$BROKER_SSH_HOME/.ssh"',
            f'printf "%s\\n" {shlex.quote(key)} >> "$BROKER_SSH_HOME/.ssh/authorized_keys"',
            'chmod 600 "$BROKER_SSH_HOME/.ssh/authorized_keys"',
            f'if id {SSH_USER} >/dev/null 2>&1; then chown -R {SSH_USER}:{SSH_USER} "$BROKER_SSH_HOME/.ssh"; fi',
        ]
    if onstart:
        lines += ["# onstart", onstart]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------- credentials
def credentials_present(env: dict[str, str] | None = None, home: Path | None = None) -> tuple[bool, str]:
    """Whether the boto3 chain would find credentials, decided from env vars and ``~/.aws`` files only (no
    network, no metadata service).  Returns (present, where)."""
    env = dict(os.environ if env is None else env)
    home = home or Path.home()
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return True, "AWS_ACCESS_KEY_ID in the environment"
    for var in ("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "AWS_WEB_IDENTITY_TOKEN_FILE"):
        if env.get(var):
            return True, var
    profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE")
    cred_file = Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials").expanduser()
    conf_file = Path(env.get("AWS_CONFIG_FILE") or home / ".aws" / "config").expanduser()
    keys = ("aws_access_key_id", "credential_process", "sso_session", "sso_start_url", "role_arn",
            "web_identity_token_file", "credential_source")
    for path, prefix in ((cred_file, ""), (conf_file, "profile ")):
        if not path.is_file():
            continue
        cp = configparser.RawConfigParser()
        try:
            cp.read(path)
        except configparser.Error:
            continue
        wanted = [profile] if profile else ["default"]
        for name in wanted:
            for section in (f"{prefix}{name}", name):
                if cp.has_section(section) and any(cp.has_option(section, k) for k in keys):
                    return True, f"profile {name!r} in {path}"
    if profile:
        return False, f"AWS_PROFILE={profile} but no such profile with credentials in {cred_file} or {conf_file}"
    return False, "no AWS_ACCESS_KEY_ID, AWS_PROFILE or ~/.aws credentials"


# --------------------------------------------------------------------------------------------------- errors
def _error_code(e: BaseException) -> tuple[str, int | None, str]:
    resp = getattr(e, "response", None) or {}
    err = resp.get("Error", {}) or {}
    status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return str(err.get("Code") or type(e).__name__), status, str(err.get("Message") or e)


def map_error(e: BaseException, call: str, *, instance_type: str | None = None, vcpus: float | None = None,
              nodes: int = 1, zone: str | None = None, region: str | None = None) -> ProviderError:
    """Translate a botocore exception into a :mod:`broker.provider` error (message names call and next step)."""
    from broker.quota import AWS_QUOTA_CODES, aws_quota_code

    try:
        from botocore.exceptions import (ClientError, ConnectTimeoutError, EndpointConnectionError,
                                         NoCredentialsError, NoRegionError, PartialCredentialsError,
                                         ReadTimeoutError)
    except ImportError:  # pragma: no cover - boto3 is a dependency of the aws extra
        return ProviderError("aws", call, str(e))
    if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
        return AuthError("aws", call, "no usable AWS credentials",
                         hint="set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE (see .env.example)")
    if isinstance(e, NoRegionError):
        return ProviderError("aws", call, "no AWS region configured", hint="set AWS_DEFAULT_REGION")
    if isinstance(e, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError)):
        return TransientError("aws", call, f"cannot reach the AWS endpoint ({type(e).__name__})",
                              hint="check the network or AWS_ENDPOINT_URL; retry")
    if not isinstance(e, ClientError):
        return ProviderError("aws", call, f"{type(e).__name__}: {e}")
    code, status, msg = _error_code(e)
    where = "/".join(x for x in (region, zone) if x)
    what = f" ({instance_type} in {where})" if instance_type else ""
    if code in _CAPACITY_CODES:
        return CapacityError("aws", call, f"{code}: {msg}{what}",
                             hint="AWS has no capacity for this type there now: try the next zone or instance type",
                             code=code, status=status)
    if code == "Unsupported":
        return CapacityError("aws", call, f"NOT_OFFERED: {msg}{what}",
                             hint="this instance type is not offered in that zone: choose another zone",
                             code=code, status=status)
    if code in _QUOTA_CODES:
        q = aws_quota_code(instance_type or "", spot=code == "MaxSpotInstanceCountExceeded")
        if q is None:
            return QuotaError("aws", call, f"{code}: {msg}", code=code, status=status,
                              hint="raise the EC2 quota that covers this instance type in Service Quotas")
        need = int(math.ceil((vcpus or 0) * max(1, nodes)))
        per = f"{instance_type} needs {int(vcpus)} vCPUs per instance" if vcpus else f"{instance_type}"
        return QuotaError(
            "aws", call,
            f"{code}: quota {q.code} ({AWS_QUOTA_CODES[q.code].name}, counted in vCPUs) is too low"
            f"{' in ' + region if region else ''}: {per}, {need} vCPUs for {nodes} node(s)",
            hint=f"broker quota request --provider aws --limit {q.code} --value {need}"
                 + (f" --region {region}" if region else ""),
            code=code, status=status)
    if code in _AUTH_CODES:
        return AuthError("aws", call, f"{code}: {msg}",
                         hint="check the AWS credentials and that the IAM user/role may call this API",
                         code=code, status=status)
    if code in _THROTTLE_CODES or (status is not None and status >= 500):
        return TransientError("aws", call, f"{code}: {msg}", hint="throttled or AWS-side error: retry with backoff",
                              code=code, status=status)
    return ProviderError("aws", call, f"{code}: {msg}", code=code, status=status)


# --------------------------------------------------------------------------------------------------- adapter
ClientFactory = Callable[[str, str, Any], Any]  # (service, region, botocore Config | None) -> client


class AWSProvider(Provider):
    """Amazon EC2 GPU instances (``simulated`` on a multi-GPU type, ``multi-node`` in one security group).

    Arguments (all optional, for tests and embedding): ``session`` a ``boto3.session.Session``; ``endpoint_url``
    (default ``AWS_ENDPOINT_URL``); ``region`` (default ``AWS_DEFAULT_REGION``, else the session's, else
    us-east-1); ``client_factory(service, region, config)`` returning a client (e.g. one wrapped in a Stubber).
    The constructor does no I/O.
    """

    name = "aws"
    topologies = ("simulated", "multi-node")

    def __init__(self, session: Any = None, endpoint_url: str | None = None, region: str | None = None,
                 client_factory: ClientFactory | None = None):
        self._session = session
        self._endpoint_url = endpoint_url
        self._region = region
        self._factory = client_factory
        self._clients: dict[tuple[str, str, bool], Any] = {}
        self._offered: dict[tuple[str, str], set[str]] = {}  # (region, type) -> zones offering it
        self._zones: dict[str, set[str]] = {}  # region -> every zone seen in offerings
        self._hw: dict[str, dict[str, Any]] = {}  # instance type -> describe_instance_types facts

    # ------------------------------------------------------------------ plumbing
    @property
    def region(self) -> str:
        if self._region:
            return self._region
        from broker.config import settings

        return (settings().aws_region or os.environ.get("AWS_REGION")
                or getattr(self._session, "region_name", None) or "us-east-1")

    @property
    def endpoint_url(self) -> str | None:
        if self._endpoint_url:
            return self._endpoint_url
        from broker.config import settings

        return settings().aws_endpoint_url or None

    def configured(self) -> bool:
        return self._factory is not None or self._session is not None or credentials_present()[0]

    def _client(self, service: str, region: str | None = None, *, launch: bool = False) -> Any:
        """A cached boto3 client; ``launch`` = retries off (one attempt) for fast failover.

        Raises AuthError when no credentials are configured (so no client, no metadata probe)."""
        region = region or self.region
        key = (service, region, launch)
        if key in self._clients:
            return self._clients[key]
        try:
            from botocore.config import Config
        except ImportError:
            raise AuthError("aws", f"{service} client", "boto3 is not installed", hint=INSTALL_HINT) from None

        cfg = Config(retries={"mode": "standard", "total_max_attempts": 1}) if launch else \
            Config(retries={"mode": "standard", "max_attempts": 4})
        if self._factory is not None:
            client = self._factory(service, region, cfg)
        else:
            if not self.configured():
                raise AuthError("aws", f"{service} client", "no AWS credentials configured",
                                hint="set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE (.env.example)")
            import boto3

            session = self._session or boto3.session.Session()
            kwargs: dict[str, Any] = {"region_name": region, "config": cfg}
            if self.endpoint_url:
                kwargs["endpoint_url"] = self.endpoint_url
            client = session.client(service, **kwargs)
        self._clients[key] = client
        return client

    def _call(self, client: Any, op: str, _ctx: dict[str, Any] | None = None, **params: Any) -> Any:
        try:
            return getattr(client, op)(**params)
        except ProviderError:
            raise
        except Exception as e:  # noqa: BLE001 - translated at the edge
            raise map_error(e, op, **(_ctx or {})) from None

    # ------------------------------------------------------------------ read side
    def check(self) -> ProviderCheck:
        """Credentials present? Decided from env vars and ``~/.aws`` files only (no network)."""
        if self._factory is not None or self._session is not None:
            return ProviderCheck(provider="aws", configured=True, detail="injected session/client factory")
        ok, where = credentials_present()
        if ok and importlib.util.find_spec("boto3") is None:
            return ProviderCheck(provider="aws", configured=False, detail=f"{where}, but boto3 is not installed",
                                 hint=INSTALL_HINT)
        return ProviderCheck(provider="aws", configured=ok, detail=where,
                             hint=None if ok else "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE "
                                                  "(prices and plans work from the snapshot without them)")

    def price_note(self) -> str:
        from broker.catalog import snapshot_info

        return (f"prices: AWS us-east-1 on-demand snapshot {snapshot_info('aws')[0]} (third-party); live list prices "
                "via `broker catalog refresh` (AWS Pricing API, needs AWS credentials)")

    def _snapshot(self, req: Requirements) -> list[Offer]:
        """Offers of the price snapshot in effect (:func:`broker.catalog.snapshot_offers`), filtered by ``req``."""
        from broker.catalog import snapshot_offers

        return list(snapshot_offers("aws", req))

    def offers(self, req: Requirements) -> list[Offer]:
        """GPU instance types with on-demand $/hour; one offer per offering AZ when configured, else one per type
        with ``zone=None`` (region = the snapshot's).  Raises AuthError, TransientError, ProviderError."""
        base = self._snapshot(req)
        if not base or not self.configured():
            return base
        region = self.region
        zones = self.offered_zones([o.instance_type for o in base], region)
        self._refine_types(base, region)
        out: list[Offer] = []
        for o in base:
            for z in sorted(zones.get(o.instance_type, ())):
                attrs = dict(o.attrs)
                attrs.update(self._hw.get(o.instance_type, {}))
                if region != (o.region or region):
                    attrs["price_region"] = o.region
                out.append(o.model_copy(update={"region": region, "zone": z, "offer_id": o.instance_type,
                                                "attrs": attrs, "private_network": True}))
        return out

    def offered_zones(self, instance_types: list[str], region: str | None = None) -> dict[str, set[str]]:
        """Instance type -> AZs of ``region`` offering it (``describe_instance_type_offerings``)."""
        region = region or self.region
        ec2 = self._client("ec2", region)
        out: dict[str, set[str]] = {t: set() for t in instance_types}
        types = sorted(set(instance_types))
        token: str | None = None
        while True:
            params: dict[str, Any] = {"LocationType": "availability-zone",
                                      "Filters": [{"Name": "instance-type", "Values": types}]}
            if token:
                params["NextToken"] = token
            resp = self._call(ec2, "describe_instance_type_offerings", {"region": region}, **params)
            for item in resp.get("InstanceTypeOfferings", []):
                out.setdefault(item["InstanceType"], set()).add(item["Location"])
                self._zones.setdefault(region, set()).add(item["Location"])
            token = resp.get("NextToken")
            if not token:
                break
        for t, zs in out.items():
            self._offered[(region, t)] = set(zs)
        return out

    def _refine_types(self, offers: list[Offer], region: str) -> None:
        """GPU memory (MiB as the API reports it) from ``describe_instance_types``, kept in offer attrs; best
        effort (an error leaves the snapshot's figures)."""
        self._hw = {}
        types = sorted({o.instance_type for o in offers})
        try:
            resp = self._call(self._client("ec2", region), "describe_instance_types", {"region": region},
                              InstanceTypes=types)
        except ProviderError:
            return
        for it in resp.get("InstanceTypes", []):
            gi = it.get("GpuInfo") or {}
            gpus = gi.get("Gpus") or [{}]
            self._hw[it["InstanceType"]] = {
                "api_vcpus": (it.get("VCpuInfo") or {}).get("DefaultVCpus"),
                "api_gpu_mem_mib": (gpus[0].get("MemoryInfo") or {}).get("SizeInMiB"),
                "api_gpu": f"{gpus[0].get('Manufacturer', '')} {gpus[0].get('Name', '')}".strip(),
            }

    def capacity(self, offers: list[Offer]) -> list[Capacity]:
        """Per (type, AZ): ``NOT_OFFERED`` where the AZ does not offer the type, else ``UNKNOWN`` (EC2 exposes no
        capacity figure: offered is not capacity).  Empty when not configured."""
        if not offers or not self.configured():
            return []
        out: list[Capacity] = []
        by_region: dict[str, set[str]] = {}
        for o in offers:
            by_region.setdefault(o.region or self.region, set()).add(o.instance_type)
        for region, types in by_region.items():
            missing = [t for t in types if (region, t) not in self._offered]
            if missing:
                self.offered_zones(missing, region)
            all_zones = self._zones.get(region, set())
            for t in sorted(types):
                offered = self._offered.get((region, t), set())
                for z in sorted(all_zones | {o.zone for o in offers if o.instance_type == t and o.zone}):
                    out.append(Capacity(provider="aws", region=region, zone=z, instance_type=t,
                                        status="UNKNOWN" if z in offered else "NOT_OFFERED",
                                        source="describe_instance_type_offerings"))
        return out

    def live_prices(self, instance_types: list[str], region: str | None = None) -> dict[str, float]:
        """On-demand Linux list price ($/hour) per instance type from the AWS Pricing API (``pricing`` client in
        us-east-1, ``get_products`` with instanceType, location, operatingSystem=Linux, tenancy=Shared,
        preInstalledSw=NA, capacitystatus=Used).  Types without a price are left out.  Raises AuthError,
        TransientError, ProviderError."""
        import json

        region = region or self.region
        location = REGION_LOCATIONS.get(region)
        if location is None:
            raise BadInput(f"no Pricing API location name known for region {region!r}",
                           hint=f"known regions: {', '.join(REGION_LOCATIONS)}")
        pricing = self._client("pricing", PRICING_REGION)
        out: dict[str, float] = {}
        for t in instance_types:
            filters = [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in (
                ("instanceType", t), ("location", location), ("operatingSystem", "Linux"), ("tenancy", "Shared"),
                ("preInstalledSw", "NA"), ("capacitystatus", "Used"))]
            token: str | None = None
            prices: list[float] = []
            while True:
                params: dict[str, Any] = {"ServiceCode": "AmazonEC2", "Filters": filters, "FormatVersion": "aws_v1",
                                          "MaxResults": 100}
                if token:
                    params["NextToken"] = token
                resp = self._call(pricing, "get_products", {"region": region}, **params)
                for raw in resp.get("PriceList", []):
                    item = json.loads(raw) if isinstance(raw, str) else raw
                    prices += _on_demand_usd(item)
                token = resp.get("NextToken")
                if not token:
                    break
            positive = [p for p in prices if p > 0]
            if positive:
                out[t] = min(positive)
        return out

    def quotas(self, req: Requirements, offers: list[Offer]) -> list[Quota]:
        """The vCPU quotas covering ``offers`` (on-demand; spot codes when ``req``/offers ask for spot), read with
        ``get_service_quota`` (falling back to ``get_aws_default_service_quota`` on NoSuchResourceException).
        Empty when not configured.  Raises AuthError, TransientError, ProviderError."""
        from broker.quota import AWS_QUOTA_CODES, aws_quota_code

        if not offers or not self.configured():
            return []
        spot = bool(getattr(req, "spot", False)) or any(o.attrs.get("market") == "spot" for o in offers)
        groups: dict[tuple[str, str], list[str]] = {}
        for o in offers:
            q = aws_quota_code(o.instance_type, spot=spot)
            if q is None:
                continue
            lst = groups.setdefault((o.region or self.region, q.code), [])
            if o.instance_type not in lst:
                lst.append(o.instance_type)
        out: list[Quota] = []
        for (region, code), types in groups.items():
            value, name, source = self._quota_value(code, region)
            used, note = self._usage(code, region)
            desc = name or AWS_QUOTA_CODES[code].name
            if note:
                desc += f" ({note})"
            out.append(Quota(provider="aws", name=code, description=desc, region=region, scope=region,
                             limit=value, used=used, unit="vcpus", instance_types=types, source=source))
        return out

    def _quota_value(self, code: str, region: str) -> tuple[float, str, str]:
        sq = self._client("service-quotas", region)
        try:
            resp = sq.get_service_quota(ServiceCode="ec2", QuotaCode=code)
            q = resp["Quota"]
            return float(q.get("Value", 0.0)), q.get("QuotaName", ""), "service-quotas get_service_quota"
        except Exception as e:  # noqa: BLE001
            if _error_code(e)[0] != "NoSuchResourceException":
                raise map_error(e, "get_service_quota", region=region) from None
        try:
            q = sq.get_aws_default_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]
        except Exception as e:  # noqa: BLE001
            raise map_error(e, "get_aws_default_service_quota", region=region) from None
        return float(q.get("Value", 0.0)), q.get("QuotaName", ""), "service-quotas default (no applied value)"

    def _usage(self, code: str, region: str) -> tuple[float, str]:
        """vCPUs in use for a quota: CloudWatch ``AWS/Usage`` ``ResourceCount`` (max over 15 min).  On any error
        returns (0, note)."""
        from broker.quota import AWS_QUOTA_CODES

        q = AWS_QUOTA_CODES[code]
        cls = f"{q.family}/{'OnDemand' if q.market == 'on-demand' else 'Spot'}"
        now = utcnow()
        try:
            cw = self._client("cloudwatch", region)
            resp = cw.get_metric_statistics(
                Namespace="AWS/Usage", MetricName="ResourceCount",
                Dimensions=[{"Name": "Service", "Value": "EC2"}, {"Name": "Type", "Value": "Resource"},
                            {"Name": "Resource", "Value": "vCPU"}, {"Name": "Class", "Value": cls}],
                StartTime=now - timedelta(minutes=15), EndTime=now, Period=300, Statistics=["Maximum"])
        except Exception as e:  # noqa: BLE001 - usage is best effort
            return 0.0, f"usage unknown ({_error_code(e)[0]}), assumed 0"
        points = resp.get("Datapoints", [])
        if not points:
            return 0.0, ""  # no datapoints: nothing of that class ran in the last 15 minutes
        latest = max(points, key=lambda p: p.get("Timestamp") or now)
        return float(latest.get("Maximum", 0.0)), ""

    # ------------------------------------------------------------------ lifecycle
    def bootstrap(self, run_id: str, offers: list[Offer], topology: str, rec: Recorder) -> dict[str, Any]:
        """Security group (self-referencing all-protocol rule + tcp/22) and, for ``multi-node``, a cluster
        placement group; each create recorded with ``rec`` before and after.  Returns ``{"region", "vpc_id",
        "subnet_id", "security_group_id", "placement_group", "nodes"}``."""
        from broker.config import settings

        region = (offers[0].region if offers else None) or self.region
        zone = offers[0].zone if offers else None
        ec2 = self._client("ec2", region)
        subnet_id = getattr(settings(), "aws_subnet_id", None)
        if subnet_id:
            subs = self._call(ec2, "describe_subnets", {"region": region}, SubnetIds=[subnet_id])["Subnets"]
            vpc_id = subs[0]["VpcId"]
        else:
            vpcs = self._call(ec2, "describe_vpcs", {"region": region},
                              Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"]
            if not vpcs:
                raise ProviderError("aws", "describe_vpcs", f"no default VPC in {region}",
                                    hint="set AWS_SUBNET_ID to a subnet (with a public IP on launch) to use")
            vpc_id = vpcs[0]["VpcId"]
        tags = [{"Key": RUN_TAG, "Value": run_id}]
        name = f"broker-{run_id}"
        rid = rec.intent("security_group", name, region=region, attrs={"vpc_id": vpc_id})
        try:
            sg = self._call(ec2, "create_security_group", {"region": region}, GroupName=name, VpcId=vpc_id,
                            Description=f"broker run {run_id}: members talk freely, SSH in",
                            TagSpecifications=[{"ResourceType": "security-group",
                                                "Tags": tags + [{"Key": "Name", "Value": name}]}])["GroupId"]
        except ProviderError as e:
            rec.failed(rid, str(e))
            raise
        rec.created(rid, sg, vpc_id=vpc_id)
        self._call(ec2, "authorize_security_group_ingress", {"region": region}, GroupId=sg, IpPermissions=[
            {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": sg, "Description": "broker nodes of this run"}]},
            {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22,
             "IpRanges": [{"CidrIp": "0.0.0.0/0", "Description": "SSH (key only) from the broker CLI"}]},
        ])
        rec.event(f"aws: security group {sg} in {vpc_id} (all protocols between members, tcp/22 in)")
        pg: str | None = None
        if topology == "multi-node":  # one attempt: a blind retry of a create that succeeded gives Duplicate
            pg = self._placement_group(self._client("ec2", region, launch=True), run_id, region, rec)
        return {"region": region, "zone": zone, "vpc_id": vpc_id, "subnet_id": subnet_id,
                "security_group_id": sg, "placement_group": pg, "nodes": len(offers)}

    def _placement_group(self, ec2: Any, run_id: str, region: str, rec: Recorder) -> str | None:
        name = f"broker-{run_id}"
        rid = rec.intent("placement_group", name, region=region, attrs={"strategy": "cluster"})
        try:
            ec2.create_placement_group(GroupName=name, Strategy="cluster", TagSpecifications=[
                {"ResourceType": "placement-group", "Tags": [{"Key": RUN_TAG, "Value": run_id},
                                                             {"Key": "Name", "Value": name}]}])
        except Exception as e:  # noqa: BLE001
            if _error_code(e)[0] == "InvalidPlacementGroup.Duplicate":  # ours, from an earlier attempt of this run
                rec.created(rid, name)
                return name
            if self._unimplemented(e):
                rec.failed(rid, f"endpoint {self.endpoint_url} does not implement create_placement_group")
                rec.event("aws: placement groups not implemented by this endpoint; nodes launched without one")
                return None
            err = map_error(e, "create_placement_group", region=region)
            rec.failed(rid, str(err))
            raise err from None
        rec.created(rid, name)
        rec.event(f"aws: cluster placement group {name}")
        return name

    def _unimplemented(self, e: BaseException) -> bool:
        """An emulator (custom endpoint, e.g. moto) answering an action it does not implement."""
        if not self.endpoint_url:
            return False
        code, status, msg = _error_code(e)
        return (type(e).__name__ == "ResponseParserError" or code in ("500", "NotImplemented")
                or "not yet implemented" in msg.lower() or "has not been implemented" in msg.lower())

    def _image(self, ec2: Any, req: NodeRequest, region: str) -> tuple[str, str | None]:
        """(image id, root device name): ``req.image``, else ``AWS_AMI_ID``, else the newest DLAMI by name."""
        from broker.config import settings

        image = req.image or settings().aws_ami_id
        if image:
            try:
                imgs = ec2.describe_images(ImageIds=[image]).get("Images", [])
                return image, (imgs[0].get("RootDeviceName") if imgs else None)
            except Exception:  # noqa: BLE001 - the launch reports a bad image id itself
                return image, None
        imgs = self._call(ec2, "describe_images", {"region": region}, Owners=["amazon"],
                          Filters=[{"Name": "name", "Values": [DLAMI_NAME]},
                                   {"Name": "state", "Values": ["available"]},
                                   {"Name": "architecture", "Values": ["x86_64"]}]).get("Images", [])
        if not imgs:
            raise ProviderError("aws", "describe_images", f"no Deep Learning AMI matching {DLAMI_NAME!r} in {region}",
                                hint="set AWS_AMI_ID to an Ubuntu GPU image with PyTorch")
        best = max(imgs, key=lambda i: i.get("CreationDate", ""))
        return best["ImageId"], best.get("RootDeviceName")

    def find_by_token(self, client_token: str, region: str | None = None) -> str | None:
        """A live instance launched with ``client_token`` (tag ``broker-client-token``), if any."""
        ec2 = self._client("ec2", region)
        resp = self._call(ec2, "describe_instances", {"region": region},
                          Filters=[{"Name": f"tag:{TOKEN_TAG}", "Values": [client_token]},
                                   {"Name": "instance-state-name", "Values": _LIVE_STATES}])
        for r in resp.get("Reservations", []):
            for i in r.get("Instances", []):
                return i["InstanceId"]
        return None

    def create_instance(self, req: NodeRequest) -> str:
        """``run_instances`` for one node (one attempt, ``ClientToken``); returns the instance id.

        Raises CapacityError (InsufficientInstanceCapacity: next zone; Unsupported: not offered), QuotaError
        (VcpuLimitExceeded..., with the ``broker quota request`` command), AuthError, TransientError."""
        o = req.offer
        region = o.region or req.network.get("region") or self.region
        zone = o.zone or req.network.get("zone")
        existing = self.find_by_token(req.client_token, region)
        if existing:
            return existing
        ec2 = self._client("ec2", region)
        image, root_dev = self._image(ec2, req, region)
        tags = [{"Key": RUN_TAG, "Value": req.run_id}, {"Key": "Name", "Value": req.name},
                {"Key": TOKEN_TAG, "Value": req.client_token}]
        tags += [{"Key": k, "Value": v} for k, v in req.tags.items() if k not in (RUN_TAG, "Name", TOKEN_TAG)]
        params: dict[str, Any] = {
            "ImageId": image, "InstanceType": o.instance_type, "MinCount": 1, "MaxCount": 1,
            "InstanceInitiatedShutdownBehavior": "terminate", "ClientToken": req.client_token[:64],
            "UserData": user_data_script(req.deadline, req.grace_seconds, req.ssh_public_key, req.onstart,
                                         idle_minutes=req.idle_minutes),
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
                "VolumeSize": int(math.ceil(req.disk_gib)), "VolumeType": "gp3", "DeleteOnTermination": True}}]
        if o.attrs.get("market") == "spot":
            params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
                "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
        launch = self._client("ec2", region, launch=True)
        ctx = {"instance_type": o.instance_type, "vcpus": o.vcpus or None, "nodes": int(req.network.get("nodes") or 1),
               "zone": zone, "region": region}
        resp = self._call(launch, "run_instances", ctx, **params)
        return resp["Instances"][0]["InstanceId"]

    def describe_instance(self, provider_id: str, *, region: str | None = None) -> InstanceInfo:
        """State (pending/running/terminating/terminated/stopped) and addresses; ``terminated`` when unknown."""
        ec2 = self._client("ec2", region)
        try:
            resp = ec2.describe_instances(InstanceIds=[provider_id])
        except Exception as e:  # noqa: BLE001
            if _error_code(e)[0] in ("InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"):
                return InstanceInfo(provider_id=provider_id, state="terminated", raw_state="not-found",
                                    ssh_user=SSH_USER, message="instance not found (gone)")
            raise map_error(e, "describe_instances", region=region) from None
        inst = [i for r in resp.get("Reservations", []) for i in r.get("Instances", [])]
        if not inst:
            return InstanceInfo(provider_id=provider_id, state="terminated", raw_state="not-found", ssh_user=SSH_USER)
        i = inst[0]
        raw = (i.get("State") or {}).get("Name", "unknown")
        pub = i.get("PublicIpAddress")
        reason = (i.get("StateReason") or {}).get("Message")
        return InstanceInfo(provider_id=provider_id, state=_STATE_MAP.get(raw, "unknown"), raw_state=raw,
                            public_ip=pub, private_ip=i.get("PrivateIpAddress"), ssh_host=pub, ssh_port=22,
                            ssh_user=SSH_USER, message=reason)

    def terminate(self, kind: str, provider_id: str, *, region: str | None = None,
                  attrs: dict[str, Any] | None = None) -> bool:
        """Idempotent.  instance: True once describe shows ``terminated`` (or gone); security_group: True once
        deleted (TransientError while instances still hold it); placement_group: True once deleted."""
        ec2 = self._client("ec2", region)
        if kind == "instance":
            try:
                ec2.terminate_instances(InstanceIds=[provider_id])
            except Exception as e:  # noqa: BLE001
                if _error_code(e)[0] == "InvalidInstanceID.NotFound":
                    return True
                raise map_error(e, "terminate_instances", region=region) from None
            return self.describe_instance(provider_id, region=region).state == "terminated"
        if kind == "security_group":
            try:
                ec2.delete_security_group(GroupId=provider_id)
            except Exception as e:  # noqa: BLE001
                code = _error_code(e)[0]
                if code == "InvalidGroup.NotFound":
                    return True
                if code == "DependencyViolation":
                    raise TransientError("aws", "delete_security_group",
                                         f"{provider_id} is still used by instances that are shutting down",
                                         hint="retry after the instances are terminated", code=code) from None
                raise map_error(e, "delete_security_group", region=region) from None
            return True
        if kind == "placement_group":
            try:
                ec2.delete_placement_group(GroupName=provider_id)
            except Exception as e:  # noqa: BLE001
                code = _error_code(e)[0]
                if code in ("InvalidPlacementGroup.Unknown", "InvalidPlacementGroup.NotFound"):
                    return True
                if code == "InvalidPlacementGroup.InUse":
                    raise TransientError("aws", "delete_placement_group", f"{provider_id} still holds instances",
                                         hint="retry after the instances are terminated", code=code) from None
                raise map_error(e, "delete_placement_group", region=region) from None
            return True
        raise NotSupported("aws", "terminate", f"unknown resource kind {kind!r}")

    def list_tagged(self, run_id: str | None = None) -> list[TaggedResource]:
        """Instances (not terminated), security groups and placement groups carrying ``broker-run`` (= ``run_id``
        when given) in the configured region.  Empty when not configured."""
        if not self.configured():
            return []
        region = self.region
        ec2 = self._client("ec2", region)
        tag_filter = ({"Name": f"tag:{RUN_TAG}", "Values": [run_id]} if run_id
                      else {"Name": "tag-key", "Values": [RUN_TAG]})
        out: list[TaggedResource] = []
        token = None
        while True:
            params: dict[str, Any] = {"Filters": [tag_filter, {"Name": "instance-state-name", "Values": _LIVE_STATES}]}
            if token:
                params["NextToken"] = token
            resp = self._call(ec2, "describe_instances", {"region": region}, **params)
            for r in resp.get("Reservations", []):
                for i in r.get("Instances", []):
                    tags = {t["Key"]: t["Value"] for t in i.get("Tags", [])}
                    out.append(TaggedResource(provider="aws", kind="instance", provider_id=i["InstanceId"],
                                              run_id=tags.get(RUN_TAG), region=region,
                                              state=(i.get("State") or {}).get("Name"), created_at=i.get("LaunchTime"),
                                              usd_per_hour=_list_price(i.get("InstanceType")), name=tags.get("Name")))
            token = resp.get("NextToken")
            if not token:
                break
        sgs = self._call(ec2, "describe_security_groups", {"region": region}, Filters=[tag_filter])
        for g in sgs.get("SecurityGroups", []):
            tags = {t["Key"]: t["Value"] for t in g.get("Tags", [])}
            out.append(TaggedResource(provider="aws", kind="security_group", provider_id=g["GroupId"],
                                      run_id=tags.get(RUN_TAG), region=region, name=g.get("GroupName")))
        try:  # one attempt (emulators without placement groups answer 500s that botocore would retry)
            pgs = self._client("ec2", region, launch=True).describe_placement_groups(Filters=[tag_filter])
        except Exception as e:  # noqa: BLE001
            if not self._unimplemented(e):
                raise map_error(e, "describe_placement_groups", region=region) from None
            pgs = {}
        for g in pgs.get("PlacementGroups", []):
            tags = {t["Key"]: t["Value"] for t in g.get("Tags", [])}
            out.append(TaggedResource(provider="aws", kind="placement_group", provider_id=g["GroupName"],
                                      run_id=tags.get(RUN_TAG), region=region, state=g.get("State"),
                                      name=g["GroupName"]))
        return out

    # ------------------------------------------------------------------ quota requests
    def _quota_form(self, quota: Quota, value: float, reason: str) -> dict[str, Any]:
        from broker.quota import AWS_QUOTA_CODES

        region = quota.region or self.region
        code = quota.name
        return {
            "service": "Amazon Elastic Compute Cloud (Amazon EC2) [ServiceCode ec2]",
            "quota_code": code,
            "quota_name": AWS_QUOTA_CODES[code].name if code in AWS_QUOTA_CODES else quota.description,
            "region": region,
            "current_value": quota.limit if quota.source != "not read" else "unknown (not read)",
            "desired_value": float(value),
            "unit": "vCPUs (not instances, not GPUs)",
            "reason": reason,
            "console": f"https://{region}.console.aws.amazon.com/servicequotas/home/services/ec2/quotas/{code}",
        }

    def request_quota(self, quota: Quota, value: float, reason: str, *, draft: bool = False) -> QuotaRequest:
        """``request_service_quota_increase(ServiceCode="ec2", QuotaCode, DesiredValue)`` (value in vCPUs).

        The Service Quotas API has no reason field: ``reason`` is kept in the ledger and the draft form (paste it
        into the support case if AWS opens one).  An open request (ResourceAlreadyExistsException) is looked up
        with ``list_requested_service_quota_change_history_by_quota`` and returned, not duplicated.
        Raises AuthError (AccessDenied: names the IAM permission), ProviderError."""
        region = quota.region or self.region
        form = self._quota_form(quota, value, reason)
        base = dict(provider="aws", limit_name=quota.name, region=region, scope=region, value=float(value),
                    unit="vcpus", reason=reason, form=form)
        if draft:
            return QuotaRequest(**base, state="DRAFT", message="not filed (draft)")
        sq = self._client("service-quotas", region)
        try:
            resp = sq.request_service_quota_increase(ServiceCode="ec2", QuotaCode=quota.name,
                                                     DesiredValue=float(value))
        except Exception as e:  # noqa: BLE001
            code, status, msg = _error_code(e)
            if code == "ResourceAlreadyExistsException":
                open_req = self._open_request(sq, quota.name)
                if open_req is not None:
                    return _to_request(open_req, base, message=(
                        f"an increase request for {quota.name} is already open (desired "
                        f"{open_req.get('DesiredValue')}); not filing a duplicate"))
                return QuotaRequest(**base, state="PENDING", message=f"AWS says a request is already open: {msg}")
            if code in ("AccessDeniedException", "DependencyAccessDeniedException"):
                raise AuthError("aws", "request_service_quota_increase", f"{code}: {msg}", code=code, status=status,
                                hint="the IAM identity needs servicequotas:RequestServiceQuotaIncrease (and, for "
                                     "the AWS-opened support case, support:CreateCase); or use --draft and file "
                                     "it in the console") from None
            if code == "QuotaExceededException":
                raise ProviderError("aws", "request_service_quota_increase", f"{code}: {msg}", code=code,
                                    hint="too many open quota requests: wait for the open ones "
                                         "(`broker quota status`)") from None
            if code in ("IllegalArgumentException", "InvalidResourceStateException", "NoSuchResourceException"):
                raise ProviderError("aws", "request_service_quota_increase", f"{code}: {msg}", code=code,
                                    hint=f"check --limit {quota.name} (EC2 quota code) and --value (vCPUs, above "
                                         "the current value)") from None
            raise map_error(e, "request_service_quota_increase", region=region) from None
        return _to_request(resp["RequestedQuota"], base)

    def _open_request(self, sq: Any, code: str) -> dict[str, Any] | None:
        try:
            resp = sq.list_requested_service_quota_change_history_by_quota(ServiceCode="ec2", QuotaCode=code)
        except Exception as e:  # noqa: BLE001
            raise map_error(e, "list_requested_service_quota_change_history_by_quota") from None
        reqs = [r for r in resp.get("RequestedQuotas", []) if r.get("Status") in ("PENDING", "CASE_OPENED")]
        return max(reqs, key=lambda r: str(r.get("Created", ""))) if reqs else None

    def quota_request_status(self, request: QuotaRequest) -> QuotaRequest:
        """``get_requested_service_quota_change(RequestId)``: PENDING / CASE_OPENED / APPROVED / DENIED /
        CASE_CLOSED / NOT_APPROVED / INVALID_REQUEST."""
        if not request.request_id:
            return request
        sq = self._client("service-quotas", request.region)
        try:
            resp = sq.get_requested_service_quota_change(RequestId=request.request_id)
        except Exception as e:  # noqa: BLE001
            raise map_error(e, "get_requested_service_quota_change", region=request.region) from None
        base = request.model_dump(exclude={"request_id", "state", "message", "created_at"})
        return _to_request(resp["RequestedQuota"], base)


# --------------------------------------------------------------------------------------------------- helpers
_STATE_WORDS = {
    "PENDING": "filed, waiting for AWS", "CASE_OPENED": "AWS opened a support case (reply there if asked)",
    "APPROVED": "approved: the new limit applies", "DENIED": "denied: open a support case with a longer "
    "justification or ask for less", "NOT_APPROVED": "not approved: see the support case",
    "CASE_CLOSED": "support case closed", "INVALID_REQUEST": "invalid request (value or quota code)",
}


def _to_request(rq: dict[str, Any], base: dict[str, Any], message: str | None = None) -> QuotaRequest:
    state = str(rq.get("Status") or "PENDING")
    msg = message or _STATE_WORDS.get(state, state)
    if rq.get("CaseId"):
        msg += f" (support case {rq['CaseId']})"
    fields = dict(base)
    if rq.get("DesiredValue") is not None:
        fields["value"] = float(rq["DesiredValue"])
    created = rq.get("Created")
    return QuotaRequest(**fields, request_id=rq.get("Id"), state=state, message=msg,
                        created_at=created if isinstance(created, datetime) else None)


def _on_demand_usd(item: dict[str, Any]) -> list[float]:
    """USD per unit of every OnDemand price dimension in one Pricing API product (PriceList entry)."""
    out = []
    for term in ((item.get("terms") or {}).get("OnDemand") or {}).values():
        for dim in (term.get("priceDimensions") or {}).values():
            usd = (dim.get("pricePerUnit") or {}).get("USD")
            if usd is not None and str(dim.get("unit", "Hrs")).lower().startswith("hr"):
                try:
                    out.append(float(usd))
                except ValueError:
                    continue
    return out


def _list_price(instance_type: str | None) -> float | None:
    """On-demand $/hour of ``instance_type`` in the price snapshot in effect; None when it is not there."""
    from broker.catalog import snapshot_price

    return snapshot_price("aws", instance_type)
