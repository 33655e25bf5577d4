"""``oci``: Oracle Cloud Infrastructure GPU shapes through the official ``oci`` SDK (2.189.0).

What it does (facts: ``shared/reference/cloud-apis.md`` section B):

* **offers** -- GPU shapes with list prices (OCI has no per-account price API, so prices always come from the
  price snapshot in effect: ``broker.catalog.snapshot_offers("oci", req)``),
  expanded per availability domain (``IdentityClient.list_availability_domains``) when configured.
* **quotas** -- service limits of service ``compute`` (``gpu-a10-count`` ...), AD-scoped, counted in GPUs, read with
  ``LimitsClient.get_resource_availability`` per AD (``limit = used + available``).
* **capacity** -- ``ComputeClient.create_compute_capacity_report`` per AD.
* **lifecycle** -- a VCN, internet gateway, default-route rule, security list (all protocols from the VCN CIDR + SSH)
  and regional subnet per run (or ``OCI_SUBNET_ID``), ``launch_instance`` with cloud-init that opens the host
  firewall to the VCN CIDR only, ``terminate_instance(preserve_boot_volume=False)``, network deletes.
* **quota requests** -- ``LimitsIncreaseClient`` (questionnaire answered, open requests not duplicated).
* **dead-man switch** -- :func:`deadman_cloud_init`: the node terminates itself at deadline + grace with an
  instance-principal signer, only when the user set up :data:`INSTANCE_PRINCIPAL_SETUP`.

The SDK is imported lazily inside methods only.  Configuration: ``oci.config.from_file(OCI_CONFIG_FILE,
OCI_PROFILE)`` (or a dict passed to the constructor); ``OCI_SERVICE_ENDPOINT`` overrides the endpoint of every
client; ``OCI_COMPARTMENT_ID`` (default: the tenancy), ``OCI_REGION`` (default: the profile's region),
``OCI_IMAGE_ID``, ``OCI_SUBNET_ID``, ``OCI_INSTANCE_PRINCIPAL``.  Key material is never printed: error messages name
the file and profile, never the key or its contents.
"""

from __future__ import annotations

import base64
import math
import re
import shlex
import time
from datetime import datetime
from typing import Any, Callable, Iterable

from broker.model import Capacity, Offer, Quota, Requirements
from broker.provider import (RUN_TAG, AuthError, CapacityError, InstanceInfo, NodeRequest, Provider,
                             ProviderCheck, ProviderError, QuotaError, QuotaRequest, Recorder, TaggedResource,
                             TransientError)

PROVIDER = "oci"

# ---------------------------------------------------------------------------------------------- shapes and limits
#: Limit names whose existence was seen only in third-party code (cloud-apis.md B2): flagged in Quota/Offer attrs.
UNCONFIRMED_LIMITS = {"gpu-h100-count"}


def limit_for_shape(shape: str) -> str | None:
    """The ``compute`` service limit (AD-scoped, counted in GPUs) that a GPU shape consumes; None when unknown.

    One table for the adapter and the quota helper: :func:`broker.quota.oci_limit_name` (Oracle compute
    service-limit docs, cloud-apis.md B2; ``gpu-h100-count`` is unconfirmed).
    """
    from broker.quota import oci_limit_name

    return oci_limit_name(shape)


def shape_gpus(shape: str) -> int:
    """GPUs in a shape (from the price snapshot in effect, else the trailing ``.N`` of the name, else 1)."""
    from broker.catalog import snapshot_offer

    o = snapshot_offer(PROVIDER, shape)
    if o is not None:
        return o.gpu_count
    m = re.search(r"\.(\d+)$", shape)
    return int(m.group(1)) if m else 1


def snapshot_offers(req: Requirements) -> list[Offer]:
    """Offers of the price snapshot in effect for OCI (:func:`broker.catalog.snapshot_offers`; no region/AD).

    Every offer gets ``private_network=True`` and ``attrs["limit_name"]``."""
    from broker import catalog

    out = []
    for o in catalog.snapshot_offers(PROVIDER, req):
        lim = limit_for_shape(o.instance_type)
        attrs = {**o.attrs, "limit_name": lim, "limit_unit": "gpus", "limit_scope": "AD"}
        if lim in UNCONFIRMED_LIMITS:
            attrs["limit_unconfirmed"] = True
        out.append(o.model_copy(update={"private_network": True, "attrs": attrs}))
    return [o for o in out if _matches(o, req)]


def _list_price(shape: str | None) -> float | None:
    """$/hour of ``shape`` in the price snapshot in effect; None when it is not there."""
    from broker.catalog import snapshot_price

    return snapshot_price(PROVIDER, shape)


def _matches(o: Offer, req: Requirements) -> bool:
    if o.gpu_count < req.gpus_per_node or o.gpu_mem_gib < req.gpu_mem_floor_gib:
        return False
    if req.gpu_names:
        # "A100" matches A100-40GB and A100-80GB; "A10" matches only A10 (not a substring test)
        g = o.gpu_name.lower().removeprefix("nvidia ").strip()
        names = {n.lower().removeprefix("nvidia ").strip() for n in req.gpu_names}
        if not names & {g, g.split("-")[0]}:
            return False
    return True


# ---------------------------------------------------------------------------------------------- node scripts
#: What the user must create (once) before ``OCI_INSTANCE_PRINCIPAL=1`` arms the node-side dead-man switch.
#: Syntax: Oracle IAM docs "Writing Matching Rules to Define Dynamic Groups" and "Writing Policies for Dynamic
#: Groups" (``Allow dynamic-group <name> to <verb> <resource-type> in compartment <name> [where <condition>]``).
INSTANCE_PRINCIPAL_SETUP = """\
OCI node-side dead-man switch (optional): let broker's nodes terminate themselves.

1. Use a compartment reserved for broker runs (OCI_COMPARTMENT_ID): every instance in it can act on the others.
2. Identity > Dynamic groups > Create: name `broker-nodes`, matching rule
       ALL {instance.compartment.id = '<OCI_COMPARTMENT_ID>'}
3. Identity > Policies > Create (in the tenancy or a parent of that compartment):
       Allow dynamic-group broker-nodes to manage instance-family in compartment <compartment-name>
       Allow dynamic-group broker-nodes to use virtual-network-family in compartment <compartment-name>
       Allow dynamic-group broker-nodes to manage volume-family in compartment <compartment-name>
   (the same shape as Oracle's "let instances launch instances" example; manage volume-family lets the terminate
    delete the boot volume, use virtual-network-family lets it detach the VNIC).  To narrow it, add conditions
    such as `where request.permission = 'INSTANCE_DELETE'` to the first line once you have tried them.
4. Set OCI_INSTANCE_PRINCIPAL=1 (env or .env).  `broker status` then lists the OCI layers as cli, watchdog, node.

Without it, the OCI layers are cli + watchdog only: shutting down from inside the OS does NOT stop GPU billing
(only VM.GPU.A10.x pause while stopped); only an API terminate does.  Not yet verified on a live tenancy.
"""


def node_layers(instance_principal: bool) -> list[str]:
    """Teardown layers armed for an OCI node: ``["cli", "watchdog"]``, plus ``"node"`` when the instance-principal
    dead-man switch is armed (see :data:`INSTANCE_PRINCIPAL_SETUP`)."""
    return ["cli", "watchdog", "node"] if instance_principal else ["cli", "watchdog"]


def firewall_script(vcn_cidr: str, *, rules_v4: str = "/etc/iptables/rules.v4") -> str:
    """Shell that opens the host firewall of an Oracle Linux / Ubuntu image to ``vcn_cidr`` only.

    Oracle's platform images ship firewalld (Oracle Linux) or iptables rules ending in REJECT (Ubuntu) that block
    every port but SSH even when the security list allows it.  firewalld: the CIDR joins the ``trusted`` zone
    (permanent + reload); iptables (fallback and Ubuntu): an ACCEPT rule for the CIDR inserted first, saved to
    ``/etc/iptables/rules.v4`` when that file exists.  Nothing is opened to other sources.
    """
    c, rules = shlex.quote(vcn_cidr), shlex.quote(rules_v4)
    return f"""\
# broker: open the host firewall to the VCN CIDR only (intra-cluster NCCL / gloo / rendezvous)
BROKER_VCN_CIDR={c}
if command -v firewall-cmd >/dev/null 2>&1 && firewall-cmd --state >/dev/null 2>&1; then
  firewall-cmd --permanent --zone=trusted --add-source="$BROKER_VCN_CIDR"
  firewall-cmd --reload
fi
if command -v iptables >/dev/null 2>&1; then
  iptables -C INPUT -s "$BROKER_VCN_CIDR" -j ACCEPT 2>/dev/null || iptables -I INPUT 1 -s "$BROKER_VCN_CIDR" -j ACCEPT
  if [ -f {rules} ]; then iptables-save > {rules}; fi
fi
"""


def deadman_watcher(fire_at_epoch: int, *, region: str | None = None, endpoint: str | None = None) -> str:
    """The watcher script (bash) run on the node: sleeps until ``fire_at_epoch`` (Unix seconds, deadline + grace),
    reads its own instance OCID from the instance metadata service (``$BROKER_IMDS``, default
    ``http://169.254.169.254``, ``/opc/v2/instance/id`` with ``Authorization: Bearer Oracle``) and terminates itself
    with an instance-principal signer (``oci compute instance terminate --auth instance_principal
    --preserve-boot-volume false --force``, or the Python SDK when only that is installed), retrying every 60 s.
    """
    return f"""#!/bin/bash
# broker dead-man switch (OCI): terminate this instance at the run's deadline + grace, even with no broker alive.
FIRE_AT={int(fire_at_epoch)}
while [ "$(date +%s)" -lt "$FIRE_AT" ]; do sleep "${{BROKER_DEADMAN_POLL_S:-20}}"; done
{self_terminate_function(region=region, endpoint=endpoint)}broker_self_terminate "broker dead-man switch: deadline passed"
"""


def self_terminate_function(*, region: str | None = None, endpoint: str | None = None) -> str:
    """The bash function ``broker_self_terminate WHY`` shared by the dead-man switch and the idle stop: reads the
    instance OCID from the metadata service (``$BROKER_IMDS``, default ``http://169.254.169.254``), then
    terminates it with an instance-principal signer (OCI CLI, else the Python SDK), retrying every
    ``$BROKER_DEADMAN_RETRY_S`` (60) s; exits the script once the terminate call succeeded."""
    reg = f"--region {shlex.quote(region)}" if region else ""
    ep = f"--endpoint {shlex.quote(endpoint)}" if endpoint else ""
    return f"""broker_self_terminate() {{
IMDS="${{BROKER_IMDS:-http://169.254.169.254}}"
ID=""
while [ -z "$ID" ]; do
  ID=$(curl -sf -H "Authorization: Bearer Oracle" "$IMDS/opc/v2/instance/id") || ID=""
  [ -n "$ID" ] || sleep 5
done
echo "$1, terminating $ID"
while true; do
  if command -v oci >/dev/null 2>&1; then
    oci compute instance terminate --instance-id "$ID" --preserve-boot-volume false --force \\
      --auth instance_principal {reg} {ep} && exit 0
  else
    python3 - "$ID" <<'PY' && exit 0
import sys
import oci
signer = oci.auth.signers.InstancePrincipalsSecurityTokenSigner()
oci.core.ComputeClient(config={{}}, signer=signer).terminate_instance(sys.argv[1], preserve_boot_volume=False)
PY
  fi
  sleep "${{BROKER_DEADMAN_RETRY_S:-60}}"
done
}}
"""


#: Installs the OCI CLI on the node when neither it nor the SDK is present (for the instance-principal terminate).
_OCI_CLI_INSTALL = """\
if ! command -v oci >/dev/null 2>&1 && ! python3 -c 'import oci' 2>/dev/null; then
  python3 -m pip install --quiet oci-cli || pip3 install --quiet oci-cli || true
fi
"""


def idle_cloud_init(idle_minutes: float, *, done_file: str, region: str | None = None,
                    endpoint: str | None = None, state_dir: str = "/var/lib/broker", poll_s: float = 30.0) -> str:
    """Cloud-init shell snippet for the idle stop with an instance principal: once ``done_file``
    (``<workroot>/job.done``, touched by the SSH runner when the job has ended) exists and no SSH session was seen
    for ``idle_minutes``, the node terminates itself (:func:`self_terminate_function`, the dead-man switch's call;
    see :func:`broker.nodescripts.idle_watch_launcher` for the files in ``state_dir``)."""
    from broker.nodescripts import idle_watch_launcher

    return _OCI_CLI_INSTALL + idle_watch_launcher(
        idle_minutes, 'broker_self_terminate "broker idle stop: job ended, no SSH session"', done_file=done_file,
        state_dir=state_dir, poll_s=poll_s, prelude=self_terminate_function(region=region, endpoint=endpoint))


def deadman_cloud_init(deadline: datetime, grace_seconds: float, *, region: str | None = None,
                       endpoint: str | None = None, install_path: str = "/usr/local/sbin/broker-deadman") -> str:
    """Cloud-init shell snippet that arms :func:`deadman_watcher` at boot: installs the OCI CLI when neither it nor
    the SDK is present, writes ``/usr/local/sbin/broker-deadman`` and runs it as a transient systemd unit
    (``systemd-run``; ``nohup`` fallback).  Fires at ``deadline + grace_seconds``."""
    fire = int(deadline.timestamp() + grace_seconds)
    body = deadman_watcher(fire, region=region, endpoint=endpoint)
    path = shlex.quote(install_path)
    return f"""\
# broker: arm the node-side dead-man switch (instance principal)
{_OCI_CLI_INSTALL}cat > {path} <<'BROKER_DEADMAN_EOF'
{body}BROKER_DEADMAN_EOF
chmod 0755 {path}
if command -v systemd-run >/dev/null 2>&1; then
  systemd-run --unit=broker-deadman --property=Restart=on-failure {path}
else
  nohup {path} >/var/log/broker-deadman.log 2>&1 &
fi
"""


def cloud_init(vcn_cidr: str, *, deadline: datetime | None = None, grace_seconds: float = 300.0,
               instance_principal: bool = False, onstart: str | None = None, region: str | None = None,
               endpoint: str | None = None, idle_minutes: float | None = None,
               done_file: str = "/home/opc/broker/job.done") -> str:
    """The node's user-data (a bash script cloud-init runs once at first boot): host firewall opened to
    ``vcn_cidr`` only, then the dead-man switch when ``instance_principal`` and a ``deadline`` are given, the idle
    stop (:func:`idle_cloud_init`, watching ``done_file``) when ``instance_principal`` and ``idle_minutes`` are
    given, then ``onstart``.  Without an instance principal the node cannot end its own billing: the idle stop is
    then the watchdog's alone."""
    parts = ["#!/bin/bash", firewall_script(vcn_cidr)]  # no `set -eu`: a failing step must not skip the rest
    if instance_principal and deadline is not None:
        parts.append(deadman_cloud_init(deadline, grace_seconds, region=region, endpoint=endpoint))
    if instance_principal and idle_minutes:
        parts.append(idle_cloud_init(idle_minutes, done_file=done_file, region=region, endpoint=endpoint))
    if onstart:
        parts.append("# broker: onstart\n" + onstart.rstrip() + "\n")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------- errors
_EXCEEDED = re.compile(r"service limits? (?:were|was) exceeded:\s*(.+?)(?:\.\s|\.$|$)", re.I | re.S)
_STATE = {"PROVISIONING": "pending", "STARTING": "pending", "MOVING": "pending", "CREATING_IMAGE": "running",
          "RUNNING": "running", "STOPPING": "stopped", "STOPPED": "stopped", "TERMINATING": "terminating",
          "TERMINATED": "terminated"}
_CONFIG_HINT = ("run `oci setup config` (writes ~/.oci/config with your user, tenancy, fingerprint, key_file and "
                "region), or point OCI_CONFIG_FILE / OCI_PROFILE at an existing profile")


def exceeded_limits(message: str) -> list[str]:
    """Limit names from a 400 ``LimitExceeded`` message ("The following service limits were exceeded: a, b.")."""
    m = _EXCEEDED.search(message or "")
    if not m:
        return []
    return [x.strip().strip(".") for x in re.split(r"[,;]", m.group(1)) if x.strip().strip(".")]


def quota_request_command(limit: str, value: int, scope: str | None) -> str:
    """A ready ``broker quota request`` command for an OCI limit (``scope`` = availability domain)."""
    cmd = f"broker quota request --provider oci --limit {limit} --value {value}"
    return cmd + (f" --scope {shlex.quote(scope)}" if scope else "")


def _sdk_errors() -> tuple[type[BaseException], ...]:
    """SDK exceptions translated at the edge: service errors and every transport error (vendored requests)."""
    import oci

    return (oci.exceptions.ServiceError, oci.exceptions.BaseRequestException)


def _status(e: Exception) -> tuple[int | None, str, str]:
    return getattr(e, "status", None), str(getattr(e, "code", "") or ""), str(getattr(e, "message", "") or e)


# ---------------------------------------------------------------------------------------------- adapter
class OCIProvider(Provider):
    """Oracle Cloud Infrastructure.  Topologies: ``simulated`` (one multi-GPU shape) and ``multi-node`` (N shapes in
    one VCN subnet).

    Args (all optional; defaults come from :func:`broker.config.settings`):
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
    topologies = ("simulated", "multi-node")

    def __init__(self, config: dict[str, Any] | None = None, *, service_endpoint: str | None = None,
                 compartment_id: str | None = None, availability_domains: list[str] | None = None,
                 region: str | None = None, image_id: str | None = None, subnet_id: str | None = None,
                 retry_strategy: Any = None, circuit_breaker_strategy: Any = None,
                 instance_principal: bool | None = None, conflict_wait_s: float = 120.0,
                 sleep: Callable[[float], None] = time.sleep):
        from broker.config import settings

        s = settings()
        self._config_in = dict(config) if config is not None else None
        self._config: dict[str, Any] | None = None
        self._endpoint = service_endpoint or s.oci_service_endpoint
        self._compartment = compartment_id or s.oci_compartment_id
        self._ads = list(availability_domains) if availability_domains else None
        self._region = region or s.oci_region
        self._image_id = image_id or s.oci_image_id
        self._subnet_id = subnet_id or s.oci_subnet_id
        self._retry = retry_strategy
        self._breaker = circuit_breaker_strategy
        self.instance_principal = s.oci_instance_principal if instance_principal is None else instance_principal
        self._conflict_wait_s = conflict_wait_s
        self._sleep = sleep
        self._clients: dict[str, Any] = {}
        self._profile = s.oci_profile
        self._config_file = s.oci_config_file

    # ------------------------------------------------------------------------------------ config & clients
    def _load_config(self) -> dict[str, Any]:
        """The validated config dict; raises AuthError naming the file/profile and the fix (never key material)."""
        if self._config is not None:
            return self._config
        if self._config_in is None:  # fast path, no SDK import: `broker plan` without OCI stays well under 1 s
            from pathlib import Path

            candidates = [Path(self._config_file).expanduser()]
            if self._config_file in ("~/.oci/config", str(Path("~/.oci/config").expanduser())):
                candidates.append(Path("~/.oraclebmc/config").expanduser())  # the SDK's legacy fallback
            if not any(c.is_file() for c in candidates):
                raise AuthError(PROVIDER, "config.from_file", f"no OCI config file at {self._config_file}",
                                hint=_CONFIG_HINT)
        import oci

        where = "the config dict" if self._config_in is not None else \
            f"{self._config_file} profile [{self._profile}]"
        try:
            cfg = self._config_in if self._config_in is not None else \
                oci.config.from_file(self._config_file, self._profile)
            oci.config.validate_config(cfg)
        except oci.exceptions.ConfigFileNotFound:
            raise AuthError(PROVIDER, "config.from_file", f"no OCI config file at {self._config_file}",
                            hint=_CONFIG_HINT) from None
        except oci.exceptions.ProfileNotFound:
            raise AuthError(PROVIDER, "config.from_file",
                            f"profile [{self._profile}] not found in {self._config_file}", hint=_CONFIG_HINT) from None
        except oci.exceptions.InvalidConfig as e:
            keys = sorted(e.args[0]) if e.args and isinstance(e.args[0], dict) else []
            detail = f"invalid or missing keys: {', '.join(keys)}" if keys else "invalid configuration"
            raise AuthError(PROVIDER, "config.validate_config", f"{where}: {detail}", hint=_CONFIG_HINT) from None
        except (oci.exceptions.InvalidKeyFilePath, OSError, ValueError) as e:
            raise AuthError(PROVIDER, "config.from_file", f"{where}: {type(e).__name__}", hint=_CONFIG_HINT) from None
        self._config = dict(cfg)
        return self._config

    def _client(self, kind: str) -> Any:
        if kind not in self._clients:
            import oci

            cls = {"identity": oci.identity.IdentityClient, "limits": oci.limits.LimitsClient,
                   "compute": oci.core.ComputeClient, "vnet": oci.core.VirtualNetworkClient,
                   "increase": oci.limits_increase.LimitsIncreaseClient}[kind]
            kw: dict[str, Any] = {}
            if self._endpoint:
                kw["service_endpoint"] = self._endpoint.rstrip("/")
            # Reads and creates retry 429/5xx/timeouts a bounded while (the SDK adds an opc-retry-token to creates
            # so a retry cannot double-create); launch_instance overrides this per call with no retry at all.
            kw["retry_strategy"] = self._retry if self._retry is not None else oci.retry.RetryStrategyBuilder(
                max_attempts_check=True, max_attempts=4, total_elapsed_time_check=True,
                total_elapsed_time_seconds=60, retry_max_wait_between_calls_seconds=10,
                retry_base_sleep_time_seconds=1).get_retry_strategy()
            if self._breaker is not None:
                kw["circuit_breaker_strategy"] = self._breaker
            cfg = dict(self._load_config())
            if self._region:
                cfg["region"] = self._region
            try:
                self._clients[kind] = cls(cfg, **kw)
            except (ValueError, OSError, oci.exceptions.ClientError) as e:  # bad/unreadable key, passphrase ...
                what = "the private key is invalid or its passphrase is wrong" if isinstance(
                    e, oci.exceptions.InvalidPrivateKey) else f"cannot build the client ({type(e).__name__})"
                raise AuthError(PROVIDER, f"{cls.__name__}()", what,
                                hint="check key_file / pass_phrase in the profile; " + _CONFIG_HINT) from None
        return self._clients[kind]

    @property
    def region(self) -> str | None:
        if self._region:
            return self._region
        try:
            return self._load_config().get("region")
        except AuthError:
            return None

    @property
    def tenancy(self) -> str:
        return self._load_config()["tenancy"]

    @property
    def compartment(self) -> str:
        return self._compartment or self.tenancy

    def _configured(self) -> bool:
        try:
            self._load_config()
            return True
        except (AuthError, ImportError):
            return False

    # ------------------------------------------------------------------------------------ error mapping
    def _err(self, e: Exception, call: str, *, scope: str | None = None, shape: str | None = None,
             gpus: int | None = None) -> ProviderError:
        """Translate an SDK exception into a broker error (once, here)."""
        import oci

        if isinstance(e, oci.exceptions.ServiceError):
            status, code, msg = _status(e)
            where = f" in {scope}" if scope else ""
            if status == 500 and "out of host capacity" in msg.lower():
                return CapacityError(PROVIDER, call, f"out of host capacity for {shape or 'the shape'}{where}",
                                     hint="try the next availability domain, then another region",
                                     code=code, status=status)
            if status == 400 and code == "LimitExceeded":
                names = exceeded_limits(msg) or ([limit_for_shape(shape)] if shape and limit_for_shape(shape) else [])
                lim = names[0] if names else None
                if lim and lim.startswith("gpu") and shape:  # a compute GPU limit: a ready command
                    value = self._needed_value(lim, scope, gpus or shape_gpus(shape))
                    hint = f"request more: {quota_request_command(lim, value, scope)}"
                else:
                    hint = (f"raise {lim or 'the limit'} (Console: Governance & Administration > Limits, Quotas and "
                            "Usage) or delete unused resources that count against it")
                return QuotaError(PROVIDER, call, f"service limit {', '.join(names) or '?'} exceeded{where}: {msg}",
                                  hint=hint, code=code, status=status)
            if status in (401, 403) or (status == 404 and code == "NotAuthorizedOrNotFound"):
                return AuthError(PROVIDER, call, f"{status} {code}: {msg}",
                                 hint="check the OCI profile (`oci setup config`, OCI_CONFIG_FILE/OCI_PROFILE) and "
                                      "that your group's IAM policies allow this call in the compartment",
                                 code=code, status=status)
            if status == 429 or (status is not None and status >= 500) or status == 409:
                return TransientError(PROVIDER, call, f"{status} {code}: {msg}", hint="retry in a moment",
                                      code=code, status=status)
            return ProviderError(PROVIDER, call, f"{status} {code}: {msg}", code=code, status=status)
        if isinstance(e, oci.exceptions.BaseRequestException):
            return TransientError(PROVIDER, call, f"network error: {type(e).__name__}",
                                  hint="check connectivity to the OCI endpoint (or OCI_SERVICE_ENDPOINT) and retry")
        return ProviderError(PROVIDER, call, f"{type(e).__name__}: {e}")

    def _call(self, call: str, fn: Callable[..., Any], *args: Any, _scope: str | None = None,
              _shape: str | None = None, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except _sdk_errors() as e:
            raise self._err(e, call, scope=_scope, shape=_shape) from None

    def _needed_value(self, limit: str, scope: str | None, gpus: int) -> int:
        """New limit value that allows ``gpus`` more: used + gpus (best effort; ``gpus`` when the read fails)."""
        if not scope:
            return gpus
        try:
            ra = self._client("limits").get_resource_availability("compute", limit, self.tenancy,
                                                                  availability_domain=scope).data
            return int((ra.used or 0) + gpus)
        except Exception:  # noqa: BLE001 - a hint only; the original error is what matters
            return gpus

    def _all(self, call: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Every page of a list call (``oci.pagination.list_call_get_all_results``)."""
        import oci

        try:
            return list(oci.pagination.list_call_get_all_results(fn, *args, **kwargs).data)
        except _sdk_errors() as e:
            raise self._err(e, call) from None

    # ------------------------------------------------------------------------------------ read side
    def check(self) -> ProviderCheck:
        """Configured = the config file/profile (or dict) is present and passes ``oci.config.validate_config``.
        No network call (``usable`` stays None)."""
        try:
            cfg = self._load_config()
        except ImportError:
            return ProviderCheck(provider=PROVIDER, configured=False, detail="the oci SDK is not installed",
                                 hint="pip install 'broker[oci]'")
        except AuthError as e:
            return ProviderCheck(provider=PROVIDER, configured=False, detail=e.message, hint=e.hint)
        src = "config dict" if self._config_in is not None else f"{self._config_file} [{self._profile}]"
        region = self._region or cfg.get("region")
        try:
            self._client("identity")  # loads the private key (local, no network): catches a bad key or passphrase
        except AuthError as e:
            return ProviderCheck(provider=PROVIDER, configured=True, usable=False, detail=f"{src}: {e.message}",
                                 hint=e.hint)
        return ProviderCheck(provider=PROVIDER, configured=True, usable=None,
                             detail=f"{src}, region {region}" + (f", endpoint {self._endpoint}" if self._endpoint
                                                                 else ""))

    def armed_layers(self) -> list[str]:
        """Teardown layers armed for nodes this adapter launches (:func:`node_layers` of ``instance_principal``)."""
        return node_layers(self.instance_principal)

    def price_note(self) -> str | None:
        from broker.catalog import snapshot_info

        return f"prices: OCI list-price snapshot {snapshot_info(PROVIDER)[0]} (OCI has no per-account price API)"

    def availability_domains(self) -> list[str]:
        """AD names of the region (``IdentityClient.list_availability_domains(tenancy)``), or the constructor's."""
        if self._ads is None:
            idc = self._client("identity")
            ads = self._call("list_availability_domains", idc.list_availability_domains, self.tenancy).data
            self._ads = [a.name for a in ads]
        return list(self._ads)

    def offers(self, req: Requirements) -> list[Offer]:
        """GPU shapes priced from the snapshot; per AD (zone) and with the profile's region when configured.

        Raises AuthError / TransientError when configured but the AD listing fails."""
        base = snapshot_offers(req)
        if not self._configured():
            return base
        region = self.region
        out = []
        for ad in self.availability_domains():
            for o in base:
                out.append(o.model_copy(update={"region": region, "zone": ad,
                                                "offer_id": o.instance_type}))
        return out

    def quotas(self, req: Requirements, offers: list[Offer]) -> list[Quota]:
        """``compute`` GPU limits per AD for the shapes in ``offers`` (``limit = used + available``, unit GPUs).

        Unconfigured -> []. Limits a tenancy does not know (404) are skipped."""
        if not self._configured():
            return []
        by_limit: dict[str, set[str]] = {}
        zones: set[str] = set()
        for o in offers:
            if o.provider != PROVIDER:
                continue
            lim = limit_for_shape(o.instance_type)
            if lim:
                by_limit.setdefault(lim, set()).add(o.instance_type)
            if o.zone:
                zones.add(o.zone)
        ads = sorted(zones) or self.availability_domains()
        lc = self._client("limits")
        out = []
        not_found: list[ProviderError] = []
        for lim, shapes in sorted(by_limit.items()):
            for ad in ads:
                try:
                    ra = self._call("get_resource_availability", lc.get_resource_availability, "compute", lim,
                                    self.tenancy, availability_domain=ad, _scope=ad).data
                except ProviderError as e:
                    if e.status == 404:  # limit unknown to this tenancy/AD (or not authorized: see below)
                        not_found.append(e)
                        continue
                    raise
                used = float(ra.used or 0)
                avail = float(ra.available or 0)
                desc = f"compute / {lim} (GPUs per availability domain)"
                if lim in UNCONFIRMED_LIMITS:
                    desc += "; limit name unconfirmed"
                out.append(Quota(provider=PROVIDER, name=lim, description=desc, region=self.region, scope=ad,
                                 limit=used + avail, used=used, unit="gpus", instance_types=sorted(shapes),
                                 source="LimitsClient.get_resource_availability"))
        if not_found and not out:  # every read refused: most likely a missing IAM policy, not unknown limits
            raise AuthError(PROVIDER, "get_resource_availability", not_found[-1].message.split(": ", 2)[-1],
                            hint="your group needs an IAM policy such as `Allow group <g> to inspect "
                                 "resource-availability in tenancy`, or the limit names do not exist in this realm",
                            code=not_found[-1].code, status=404)
        return out

    def limit_values(self, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Service-limit values of ``compute`` (``list_limit_values``, all pages), for ``broker quota check``.

        Returns dicts ``{name, scope_type, availability_domain, value}``; only GPU limits (``gpu*``) unless
        ``names`` is given."""
        lc = self._client("limits")
        rows = self._all("list_limit_values", lc.list_limit_values, self.tenancy, "compute", sort_by="name")
        wanted = set(names) if names else None
        out = []
        for r in rows:
            if (wanted is not None and r.name not in wanted) or (wanted is None and not r.name.startswith("gpu")):
                continue
            out.append({"name": r.name, "scope_type": r.scope_type, "availability_domain": r.availability_domain,
                        "value": r.value})
        return out

    def capacity(self, offers: list[Offer]) -> list[Capacity]:
        """One ``create_compute_capacity_report`` per AD for the shapes offered there.  Unconfigured -> []."""
        if not self._configured():
            return []
        import oci

        by_ad: dict[str, list[str]] = {}
        for o in offers:
            if o.provider != PROVIDER:
                continue
            for ad in ([o.zone] if o.zone else self.availability_domains()):
                if o.instance_type not in by_ad.setdefault(ad, []):
                    by_ad[ad].append(o.instance_type)
        cc = self._client("compute")
        m = oci.core.models
        out = []
        for ad, shapes in sorted(by_ad.items()):
            details = m.CreateComputeCapacityReportDetails(
                compartment_id=self.tenancy, availability_domain=ad,
                shape_availabilities=[m.CreateCapacityReportShapeAvailabilityDetails(instance_shape=s)
                                      for s in shapes])
            rep = self._call("create_compute_capacity_report", cc.create_compute_capacity_report, details,
                             _scope=ad).data
            for sa in rep.shape_availabilities or []:
                st = sa.availability_status
                status = st if st in ("AVAILABLE", "OUT_OF_HOST_CAPACITY") else \
                    "NOT_OFFERED" if st == "HARDWARE_NOT_SUPPORTED" else "UNKNOWN"
                out.append(Capacity(provider=PROVIDER, region=self.region, zone=ad, instance_type=sa.instance_shape,
                                    status=status, available_count=sa.available_count,
                                    source="ComputeClient.create_compute_capacity_report"))
        return out

    # ------------------------------------------------------------------------------------ lifecycle
    def _wait_available(self, call: str, get: Callable[[str], Any], rid: str, data: Any,
                        timeout_s: float = 120.0) -> Any:
        """Poll ``get(rid)`` until lifecycle_state is AVAILABLE (returns at once when it already is)."""
        deadline = time.monotonic() + timeout_s
        while getattr(data, "lifecycle_state", "AVAILABLE") not in ("AVAILABLE",):
            if data.lifecycle_state in ("TERMINATING", "TERMINATED", "FAILED") or time.monotonic() > deadline:
                raise ProviderError(PROVIDER, call, f"{rid} is {data.lifecycle_state}, not AVAILABLE")
            self._sleep(2.0)
            data = self._call(call, get, rid).data
        return data

    def bootstrap(self, run_id: str, offers: list[Offer], topology: str, rec: Recorder) -> dict[str, Any]:
        """Network for a run: VCN 10.0.0.0/16, internet gateway, default route 0.0.0.0/0 via it, a security list
        (ingress: all protocols from the VCN CIDR, stateful; TCP 22 from anywhere; egress: all) and a regional
        subnet 10.0.1.0/24.  Every create is preceded by ``rec.intent`` and followed by ``rec.created``; every
        object carries ``freeform_tags {RUN_TAG: run_id}``.  With ``OCI_SUBNET_ID`` set, reuses that subnet and
        creates nothing.

        Returns ``{"subnet_id", "vcn_id", "vcn_cidr", ...}`` for :attr:`NodeRequest.network`.
        Raises AuthError, QuotaError (VCN limits), TransientError, ProviderError.
        """
        import oci

        m = oci.core.models
        vn = self._client("vnet")
        if self._subnet_id:
            sub = self._call("get_subnet", vn.get_subnet, self._subnet_id).data
            vcn = self._call("get_vcn", vn.get_vcn, sub.vcn_id).data
            cidr = (vcn.cidr_blocks or [vcn.cidr_block])[0]
            rec.event(f"oci: reusing subnet {sub.id} (OCI_SUBNET_ID) in VCN {vcn.id} {cidr}: nothing created")
            return {"subnet_id": sub.id, "vcn_id": vcn.id, "vcn_cidr": cidr, "reused": True}

        cidr, subnet_cidr = "10.0.0.0/16", "10.0.1.0/24"
        tags = {RUN_TAG: run_id}
        comp, region = self.compartment, self.region
        label = "b" + re.sub(r"[^a-z0-9]", "", run_id.lower())[:14]

        def create(kind: str, name: str, call: str, fn: Callable[[], Any], **attrs: Any) -> Any:
            rid = rec.intent(kind, name, region=region, attrs={"vcn_cidr": cidr})
            try:
                data = fn().data
            except _sdk_errors() as e:
                err = self._err(e, call)
                rec.failed(rid, err.message)
                raise err from None
            rec.created(rid, data.id, **attrs)
            return data

        vcn = create("vcn", f"broker-{run_id}-vcn", "create_vcn", lambda: vn.create_vcn(m.CreateVcnDetails(
            compartment_id=comp, cidr_blocks=[cidr], display_name=f"broker-{run_id}-vcn", dns_label=label,
            freeform_tags=tags)))
        vcn = self._wait_available("get_vcn", vn.get_vcn, vcn.id, vcn)
        igw = create("internet_gateway", f"broker-{run_id}-igw", "create_internet_gateway",
                     lambda: vn.create_internet_gateway(m.CreateInternetGatewayDetails(
                         compartment_id=comp, vcn_id=vcn.id, is_enabled=True, display_name=f"broker-{run_id}-igw",
                         freeform_tags=tags)),
                     vcn_id=vcn.id, route_table_id=vcn.default_route_table_id)  # terminate() clears the route
        rt_id = vcn.default_route_table_id
        rec.event(f"oci: route 0.0.0.0/0 -> {igw.id} on the VCN's default route table {rt_id}")
        self._call("update_route_table", vn.update_route_table, rt_id, m.UpdateRouteTableDetails(route_rules=[
            m.RouteRule(destination="0.0.0.0/0", destination_type="CIDR_BLOCK", network_entity_id=igw.id)]))
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
                         compartment_id=comp, vcn_id=vcn.id, cidr_block=subnet_cidr,
                         display_name=f"broker-{run_id}-subnet", dns_label="nodes", security_list_ids=[sl.id],
                         route_table_id=rt_id, prohibit_public_ip_on_vnic=False, freeform_tags=tags)))
        self._wait_available("get_subnet", vn.get_subnet, sub.id, sub)
        return {"subnet_id": sub.id, "vcn_id": vcn.id, "vcn_cidr": cidr, "security_list_id": sl.id,
                "internet_gateway_id": igw.id, "route_table_id": rt_id}

    def _image(self, shape: str) -> tuple[str, str]:
        """(image OCID, ssh user): ``OCI_IMAGE_ID`` or the newest platform image for ``shape`` whose name says GPU
        (Oracle Linux GPU images ship the NVIDIA driver and CUDA)."""
        cc = self._client("compute")
        if self._image_id:
            try:
                img = cc.get_image(self._image_id).data
                os_name = img.operating_system or ""
            except Exception:  # noqa: BLE001 - the launch itself reports a bad image id
                os_name = ""
            return self._image_id, "ubuntu" if "ubuntu" in os_name.lower() else "opc"
        imgs = self._all("list_images", cc.list_images, self.compartment, shape=shape,
                         operating_system="Oracle Linux", sort_by="TIMECREATED", sort_order="DESC",
                         lifecycle_state="AVAILABLE")
        gpu = [i for i in imgs if "gpu" in (i.display_name or "").lower()]
        pick = (gpu or imgs or [None])[0]
        if pick is None:
            raise ProviderError(PROVIDER, "list_images", f"no Oracle Linux image found for shape {shape}",
                                hint="set OCI_IMAGE_ID to an image OCID that supports this shape")
        return pick.id, "ubuntu" if "ubuntu" in (pick.operating_system or "").lower() else "opc"

    def create_instance(self, req: NodeRequest) -> str:
        """``launch_instance`` of ``req.offer`` in AD ``req.offer.zone`` into ``req.network["subnet_id"]`` with a
        public IP, the SSH key, cloud-init (host firewall opened to the VCN CIDR only; dead-man switch when
        ``instance_principal``) and ``freeform_tags {RUN_TAG: run_id}``.  ``opc_retry_token`` = ``client_token``.
        Not retried (the SDK does not retry launches).

        Returns the instance OCID.  Raises CapacityError ("Out of host capacity."), QuotaError (LimitExceeded, with
        a ready ``broker quota request`` command), AuthError, TransientError, ProviderError.
        """
        import oci

        m = oci.core.models
        shape = req.offer.instance_type
        ad = req.offer.zone or self.availability_domains()[0]
        subnet = req.network.get("subnet_id") or self._subnet_id
        if not subnet:
            raise ProviderError(PROVIDER, "launch_instance", "no subnet: call bootstrap first or set OCI_SUBNET_ID")
        cidr = req.network.get("vcn_cidr") or "10.0.0.0/16"
        image_id, user = (req.image, "opc") if req.image else self._image(shape)
        from broker.nodescripts import job_done_path

        ud = cloud_init(cidr, deadline=req.deadline, grace_seconds=req.grace_seconds,
                        instance_principal=self.instance_principal, onstart=req.onstart, region=self.region,
                        idle_minutes=req.idle_minutes, done_file=job_done_path(user, self.node_workroot))
        tags = {**req.tags, RUN_TAG: req.run_id, "broker-node": str(req.node_index), "broker-ssh-user": user}
        details = m.LaunchInstanceDetails(
            compartment_id=self.compartment, availability_domain=ad, shape=shape, display_name=req.name,
            source_details=m.InstanceSourceViaImageDetails(image_id=image_id,
                                                           boot_volume_size_in_gbs=max(50, int(req.disk_gib))),
            create_vnic_details=m.CreateVnicDetails(subnet_id=subnet, assign_public_ip=True),
            metadata={"ssh_authorized_keys": req.ssh_public_key,
                      "user_data": base64.b64encode(ud.encode()).decode()},
            freeform_tags=tags)
        cc = self._client("compute")
        try:
            inst = cc.launch_instance(details, opc_retry_token=req.client_token[:64],
                                      retry_strategy=oci.retry.NoneRetryStrategy()).data
        except _sdk_errors() as e:
            raise self._err(e, "launch_instance", scope=ad, shape=shape, gpus=shape_gpus(shape)) from None
        return inst.id

    def describe_instance(self, provider_id: str, *, region: str | None = None) -> InstanceInfo:
        """State (pending/running/stopped/terminating/terminated) and, when running, the primary VNIC's private and
        public IP.  A 404 means gone: ``terminated``."""
        cc = self._client("compute")
        try:
            inst = self._call("get_instance", cc.get_instance, provider_id).data
        except ProviderError as e:
            if e.status == 404:
                return InstanceInfo(provider_id=provider_id, state="terminated", raw_state="NotFound",
                                    message="the instance no longer exists")
            raise
        raw = inst.lifecycle_state
        state = _STATE.get(raw, "unknown")
        user = (inst.freeform_tags or {}).get("broker-ssh-user", "opc")
        info = InstanceInfo(provider_id=provider_id, state=state, raw_state=raw, ssh_user=user,
                            usd_per_hour=_list_price(inst.shape))
        if state == "running":
            vn = self._client("vnet")
            atts = self._all("list_vnic_attachments", cc.list_vnic_attachments, inst.compartment_id,
                             instance_id=provider_id)
            vnics = [self._call("get_vnic", vn.get_vnic, a.vnic_id).data for a in atts
                     if a.lifecycle_state == "ATTACHED" and a.vnic_id]
            vnics.sort(key=lambda v: not v.is_primary)
            if vnics:
                info.private_ip, info.public_ip = vnics[0].private_ip, vnics[0].public_ip
                info.ssh_host = vnics[0].public_ip or vnics[0].private_ip
        return info

    def _delete(self, call: str, fn: Callable[[str], Any], rid: str) -> bool:
        """A network delete: 404 = gone; 409 (dependents still terminating) retried with backoff up to
        ``conflict_wait_s``, then TransientError."""
        waited, pause = 0.0, 2.0
        while True:
            try:
                self._call(call, fn, rid)
                return True
            except ProviderError as e:
                if e.status == 404 and e.code != "NotAuthenticated":
                    return True
                if e.status != 409 or waited >= self._conflict_wait_s:
                    raise
            self._sleep(pause)
            waited += pause
            pause = min(pause * 2, 15.0)

    def terminate(self, kind: str, provider_id: str, *, region: str | None = None,
                  attrs: dict[str, Any] | None = None) -> bool:
        """Idempotent terminate / delete.

        * ``instance``: ``terminate_instance(id, preserve_boot_volume=False)``; True when already gone (404 or
          TERMINATED), else False (termination is asynchronous: poll :meth:`describe_instance`).
        * ``subnet`` / ``security_list`` / ``vcn``: ``delete_*``; 404 = gone -> True.
        * ``internet_gateway``: route rules targeting it are first removed from its VCN's default route table.
        """
        if kind == "instance":
            cc = self._client("compute")
            try:
                self._call("terminate_instance", cc.terminate_instance, provider_id, preserve_boot_volume=False)
            except ProviderError as e:
                if e.status == 404 and e.code != "NotAuthenticated":
                    return True
                if e.status != 409:
                    raise
                # 409 IncorrectState: already terminating or terminated
                return self.describe_instance(provider_id).state == "terminated"
            return False  # asynchronous: the caller polls describe_instance until TERMINATED
        vn = self._client("vnet")
        if kind == "subnet":
            return self._delete("delete_subnet", vn.delete_subnet, provider_id)
        if kind == "security_list":
            return self._delete("delete_security_list", vn.delete_security_list, provider_id)
        if kind == "vcn":
            return self._delete("delete_vcn", vn.delete_vcn, provider_id)
        if kind == "internet_gateway":
            try:
                igw = self._call("get_internet_gateway", vn.get_internet_gateway, provider_id).data
            except ProviderError as e:
                if e.status == 404 and e.code != "NotAuthenticated":
                    return True
                raise
            rt_id = (attrs or {}).get("route_table_id")
            if not rt_id:
                try:
                    rt_id = self._call("get_vcn", vn.get_vcn, igw.vcn_id).data.default_route_table_id
                except ProviderError as e:
                    if e.status != 404:
                        raise
            if rt_id:
                self._clear_routes(rt_id, provider_id)
            return self._delete("delete_internet_gateway", vn.delete_internet_gateway, provider_id)
        if kind == "route_table":
            return True  # the default route table goes with its VCN; our rules are cleared with the IGW
        raise ProviderError(PROVIDER, "terminate", f"unknown resource kind {kind!r}")

    def _clear_routes(self, rt_id: str, target_id: str) -> None:
        import oci

        vn = self._client("vnet")
        try:
            rt = self._call("get_route_table", vn.get_route_table, rt_id).data
        except ProviderError as e:
            if e.status == 404:
                return
            raise
        rules = rt.route_rules or []
        keep = [r for r in rules if r.network_entity_id != target_id]
        if len(keep) != len(rules):
            self._call("update_route_table", vn.update_route_table, rt_id,
                       oci.core.models.UpdateRouteTableDetails(route_rules=keep))

    def list_tagged(self, run_id: str | None = None) -> list[TaggedResource]:
        """Instances (not TERMINATED) and network objects (VCNs, subnets, internet gateways, security lists) in the
        compartment whose freeform tag ``broker-run`` is ``run_id`` (any value when None)."""
        cc, vn = self._client("compute"), self._client("vnet")
        comp, region = self.compartment, self.region
        out: list[TaggedResource] = []
        sources = [("instance", "list_instances", cc.list_instances), ("vcn", "list_vcns", vn.list_vcns),
                   ("subnet", "list_subnets", vn.list_subnets),
                   ("internet_gateway", "list_internet_gateways", vn.list_internet_gateways),
                   ("security_list", "list_security_lists", vn.list_security_lists)]
        for kind, call, fn in sources:
            for r in self._all(call, fn, comp):
                tag = (r.freeform_tags or {}).get(RUN_TAG)
                if tag is None or (run_id is not None and tag != run_id):
                    continue
                if r.lifecycle_state in ("TERMINATED",):
                    continue
                shape = getattr(r, "shape", None)
                out.append(TaggedResource(provider=PROVIDER, kind=kind, provider_id=r.id, run_id=tag, region=region,
                                          state=r.lifecycle_state, created_at=r.time_created, name=r.display_name,
                                          usd_per_hour=_list_price(shape)))
        return out

    # ------------------------------------------------------------------------------------ quota requests
    _OPEN = ("ACCEPTED", "IN_PROGRESS")
    _POLICY_HINT = ("your OCI user's group needs an IAM policy that allows filing limit increase requests in the "
                    "tenancy (ask the tenancy administrator); or file it in the Console (Governance & "
                    "Administration > Limits, Quotas and Usage > Request a service limit update) with the form "
                    "that `broker quota request --provider oci --draft` prints")

    def _quota_auth(self, e: ProviderError, call: str) -> ProviderError:
        if isinstance(e, AuthError) or e.status in (401, 403, 404):
            return AuthError(PROVIDER, call, f"not allowed to use the Limits Increase API ({e.status} {e.code})",
                             hint=self._POLICY_HINT, code=e.code, status=e.status)
        return e

    def request_quota(self, quota: Quota, value: float, reason: str, *, draft: bool = False) -> QuotaRequest:
        """File an increase of ``quota`` (an OCI ``compute`` limit, AD scope in ``quota.scope``) to ``value`` GPUs.

        ``draft``: only fill in the console form (state ``DRAFT``).  Otherwise an already-open item request for
        the same limit, region and scope (ACCEPTED / IN_PROGRESS) is returned instead of filing a duplicate; the
        required questions of ``list_limits_increase_questions`` are answered (TEXT: the reason; NUMBER: the value;
        RADIO/CHECKBOX: the first option offered); then ``create_limits_increase_request``.

        Raises AuthError (missing IAM permission, with the fix), ProviderError.
        """
        new_value = int(math.ceil(value))
        region = quota.region or self.region
        scope = quota.scope
        form = {"service": "compute", "limit": quota.name, "region": region, "scope (availability domain)": scope,
                "value (new limit, GPUs)": new_value, "reason": reason,
                "console": "Governance & Administration > Limits, Quotas and Usage > Request a service limit update"}
        base = QuotaRequest(provider=PROVIDER, limit_name=quota.name, region=region, scope=scope, value=new_value,
                            unit="gpus", reason=reason, form=form)
        if draft:
            return base.model_copy(update={"state": "DRAFT", "message": "not filed (draft)"})
        import oci

        lm = oci.limits_increase.models
        ic = self._client("increase")
        tenancy = self.tenancy
        try:
            items = self._all("list_limits_increase_item_requests", ic.list_limits_increase_item_requests, tenancy,
                              service="compute")
            for it in items:
                if (it.limit_name == quota.name and it.lifecycle_state in self._OPEN
                        and (not region or not it.region or it.region == region)
                        and (not scope or not it.scope or it.scope == scope)):
                    return base.model_copy(update={
                        "request_id": it.limits_increase_request_id, "state": it.lifecycle_state,
                        "value": float(it.value if it.value is not None else new_value), "created_at": it.time_created,
                        "message": f"an open request already exists ({it.lifecycle_state}); not filed again"})
            questions = self._all("list_limits_increase_questions", ic.list_limits_increase_questions, tenancy,
                                  service_name="compute", limit_name=quota.name)
            answers = []
            for q in questions:
                if not q.is_required:
                    continue
                if q.question_type == "NUMBER":
                    ans = str(new_value)
                elif q.question_type in ("RADIO", "CHECKBOX") and q.options:
                    ans = next(iter(q.options))
                else:
                    ans = reason
                answers.append(lm.LimitsIncreaseItemQuestionRequest(id=q.id, question_response=ans))
            details = lm.CreateLimitsIncreaseRequestDetails(
                display_name=f"broker: {quota.name} to {new_value} in {scope or region}", compartment_id=tenancy,
                justification=reason, limits_increase_item_requests=[lm.CreateLimitsIncreaseItemRequestDetails(
                    service_name="compute", limit_name=quota.name, region=region, value=new_value, scope=scope,
                    questionnaire_response=answers or None)])
            created = self._call("create_limits_increase_request", ic.create_limits_increase_request, details).data
        except ProviderError as e:
            raise self._quota_auth(e, e.call) from None
        return base.model_copy(update={"request_id": created.id, "state": created.lifecycle_state,
                                       "created_at": created.time_created,
                                       "message": f"filed; {len(answers)} required question(s) answered"})

    def quota_request_status(self, request: QuotaRequest) -> QuotaRequest:
        """The request refreshed with ``get_limits_increase_request`` (state = its lifecycle_state)."""
        if not request.request_id:
            return request
        ic = self._client("increase")
        try:
            r = self._call("get_limits_increase_request", ic.get_limits_increase_request, request.request_id).data
        except ProviderError as e:
            raise self._quota_auth(e, "get_limits_increase_request") from None
        items = ", ".join(f"{i.limit_name} {i.lifecycle_state}" for i in (r.limits_increase_item_requests or []))
        return request.model_copy(update={"state": r.lifecycle_state,
                                           "message": f"{r.lifecycle_state}" + (f" ({items})" if items else "")})
