"""A stateful local emulator of the Google Cloud REST APIs the gcp adapter uses, for the official clients
(``google-cloud-compute`` REST transport, ``google-cloud-quotas``, ``google-cloud-billing``) pointed at it with
``client_options={"api_endpoint": emu.url}`` and ``AnonymousCredentials``.

Shapes follow docs/reference/gcp-fixtures.md: compute JSON in camelCase, enum fields as strings, Operations that
are RUNNING on insert and DONE on the next poll, failed operations with ``error.errors[].code`` AND
``httpErrorStatusCode`` / ``httpErrorMessage`` (without both the client reports success), synchronous errors as
``{"error": {"code", "message", "errors": [{"reason", "domain", "message"}]}}``, Cloud Quotas errors as
``{"error": {"code", "message", "status"}}``.

Spot VMs: inserts are checked as Compute Engine checks ``scheduling`` (``provisioningModel`` STANDARD / SPOT, a
SPOT VM with ``automaticRestart`` false and ``onHostMaintenance`` TERMINATE, ``instanceTerminationAction`` DELETE /
STOP on SPOT only); :meth:`GCPEmulator.preempt` takes a Spot VM back as Google does (the VM deleted or TERMINATED per
its termination action, a DONE zone operation ``compute.instances.preempted`` on it), and
``GET .../zones/{z}/operations`` lists zone operations with ``filter`` (``field = "value"``).

Faults: ``stockout`` (zones whose instance inserts end with ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS),
``quota_exceeded`` (metric -> region or "global": instance inserts answer 403 quotaExceeded), ``fail``
((method, collection) -> statuses answered first, e.g. ``{("DELETE", "instances"): [503, 429]}``).
``journal`` lists (method, path, status) of every request.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, urlparse

PFX = "/compute/v1/projects/"
HOST = "https://www.googleapis.com/compute/v1/projects/"


class GCPEmulator:
    def __init__(self, *, project: str = "broker-test", regions: dict[str, list[str]] | None = None,
                 region_quotas: dict[str, dict[str, float]] | None = None,
                 project_quotas: dict[str, float] | None = None,
                 addresses: Callable[[int], tuple[str, str]] | None = None,
                 on_running: Callable[[dict[str, Any]], None] | None = None, delete_polls: int = 1):
        self.project = project
        self.regions = regions or {"us-central1": ["us-central1-a", "us-central1-b", "us-central1-c",
                                                   "us-central1-f"]}
        self.region_quotas = region_quotas if region_quotas is not None else {
            "us-central1": {"NVIDIA_T4_GPUS": 4, "PREEMPTIBLE_NVIDIA_T4_GPUS": 0, "NVIDIA_L4_GPUS": 2, "CPUS": 24,
                            "A2_CPUS": 0, "NVIDIA_A100_GPUS": 0, "NVIDIA_V100_GPUS": 0, "NVIDIA_P100_GPUS": 1}}
        self.project_quotas = project_quotas if project_quotas is not None else {"GPUS_ALL_REGIONS": 4,
                                                                                  "CPUS_ALL_REGIONS": 32}
        self.usage: dict[tuple[str, str], float] = {}
        self.addresses = addresses or (lambda i: (f"203.0.113.{10 + i}", f"10.200.0.{2 + i}"))
        self.on_running = on_running
        self.delete_polls = delete_polls
        self.objs: dict[str, dict[str, dict[str, Any]]] = {c: {} for c in (
            "instances", "disks", "networks", "subnetworks", "firewalls", "operations", "quotaPreferences")}
        self.stockout: set[str] = set()
        #: zone -> accelerator types it offers (acceleratorTypes.aggregatedList; an insert elsewhere is refused as
        #: Compute Engine refuses it); default: us-central1 as the public catalogs list it
        self.accelerators: dict[str, list[str]] = {
            "us-central1-a": ["nvidia-tesla-t4", "nvidia-tesla-v100", "nvidia-tesla-p4", "nvidia-l4",
                              "nvidia-tesla-a100"],
            "us-central1-b": ["nvidia-tesla-t4", "nvidia-tesla-v100", "nvidia-l4", "nvidia-tesla-a100"],
            "us-central1-c": ["nvidia-tesla-t4", "nvidia-tesla-v100", "nvidia-tesla-p100", "nvidia-tesla-p4",
                              "nvidia-l4", "nvidia-tesla-a100"],
            "us-central1-f": ["nvidia-tesla-t4", "nvidia-tesla-v100", "nvidia-tesla-p100", "nvidia-tesla-a100"]}
        #: operation types ("insert", "delete") whose operations stay PENDING while listed here
        self.hold_ops: set[str] = set()
        self.quota_exceeded: dict[str, str] = {}
        self.fail: dict[tuple[str, str], list[int]] = {}
        self.journal: list[tuple[str, str, int]] = []
        #: (method, path, request body, status, answer) of every request: what parity tests hold to the clients
        self.exchanges: list[tuple[str, str, Any, int, Any]] = []
        #: Cloud Quotas requests as sent: (method, preference id or None, query, body)
        self.quota_requests: list[tuple[str, str | None, dict[str, str], Any]] = []
        self.request_ids: dict[str, str] = {}
        self.skus: list[dict[str, Any]] = _default_skus()
        self.lock = threading.RLock()
        self._n = 0
        self.server: ThreadingHTTPServer | None = None

    # ------------------------------------------------------------------------------------ server
    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "GCPEmulator":
        emu = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def _do(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}") if n else {}
                u = urlparse(self.path)
                q = {k: v[0] for k, v in parse_qs(u.query).items()}
                with emu.lock:
                    status, out = emu.handle(method, u.path, q, body)
                    emu.journal.append((method, u.path, status))
                    emu.exchanges.append((method, u.path, body, status, out))
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._do("GET")

            def do_POST(self) -> None:
                self._do("POST")

            def do_DELETE(self) -> None:
                self._do("DELETE")

            def do_PATCH(self) -> None:
                self._do("PATCH")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *a: Any) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    # ------------------------------------------------------------------------------------ helpers
    def live(self, coll: str) -> list[dict[str, Any]]:
        return list(self.objs[coll].values())

    def _id(self) -> str:
        self._n += 1
        return str(1000000 + self._n)

    @staticmethod
    def err(code: int, message: str, reason: str, domain: str = "global") -> tuple[int, dict[str, Any]]:
        return code, {"error": {"code": code, "message": message,
                                "errors": [{"message": message, "domain": domain, "reason": reason}]}}

    @staticmethod
    def rpc_err(code: int, message: str, status: str) -> tuple[int, dict[str, Any]]:
        return code, {"error": {"code": code, "message": message, "status": status}}

    def not_found(self, what: str) -> tuple[int, dict[str, Any]]:
        return self.err(404, f"The resource '{what}' was not found", "notFound")

    def _op(self, op_type: str, target: str, *, zone: str | None = None, region: str | None = None,
            error: dict[str, Any] | None = None, then: Callable[[], None] | None = None) -> dict[str, Any]:
        name = f"operation-{int(time.time() * 1000)}-{self._id()}"
        op = {"kind": "compute#operation", "name": name, "id": self._id(), "operationType": op_type,
              "targetLink": target, "status": "RUNNING", "progress": 0, "user": "emulator",
              "insertTime": _now(), "startTime": _now()}
        if zone:
            op["zone"] = f"{HOST}{self.project}/zones/{zone}"
        if region:
            op["region"] = f"{HOST}{self.project}/regions/{region}"
        self.objs["operations"][name] = {"op": op, "error": error, "then": then}
        return dict(op)

    def _poll(self, name: str) -> tuple[int, dict[str, Any]]:
        rec = self.objs["operations"].get(name)
        if rec is None:
            return self.not_found(f"operations/{name}")
        op = rec["op"]
        if op["operationType"] in self.hold_ops:  # a stuck operation: PENDING until the test lets it go
            op.update(status="PENDING", progress=0)
            return 200, op
        if op["status"] != "DONE":
            op.update(status="DONE", progress=100, endTime=_now())
            if rec["error"]:
                op["error"] = {"errors": rec["error"]["errors"]}
                op["httpErrorStatusCode"] = rec["error"]["status"]
                op["httpErrorMessage"] = rec["error"]["message"]
            elif rec["then"]:
                rec["then"]()
        return 200, op

    # ------------------------------------------------------------------------------------ dispatch
    def handle(self, method: str, path: str, q: dict[str, str], body: dict[str, Any]) -> tuple[int, Any]:
        if path.startswith("/v1/services"):
            return self.billing(path, q)
        if path.startswith("/v1/projects/"):
            return self.quotas_api(method, path, q, body)
        if not path.startswith(PFX):
            return self.not_found(path)
        rest = path[len(PFX):]
        project, _, rest = rest.partition("/")
        if project != self.project:
            return self.err(403, f"Project {project} not found or permission denied", "forbidden")
        parts = rest.split("/") if rest else []
        coll = parts[-2] if len(parts) >= 2 else (parts[0] if parts else "")
        if len(parts) >= 1 and parts[-1] in ("instances", "firewalls", "networks", "subnetworks", "disks",
                                             "operations"):
            coll = parts[-1]
        fails = self.fail.get((method, coll))
        if fails:
            st = fails.pop(0)
            if st == 429:
                return self.rpc_err(429, "Quota exceeded for quota metric 'Queries'", "RESOURCE_EXHAUSTED")
            return self.err(st, "Internal error. Please try again.", "backendError")
        return self.compute(method, parts, q, body)

    def compute(self, method: str, parts: list[str], q: dict[str, str], body: dict[str, Any]) -> tuple[int, Any]:
        p = self.project
        if not parts:  # projects.get
            quotas = [{"metric": m, "limit": float(v), "usage": self.usage.get(("global", m), 0.0)}
                      for m, v in self.project_quotas.items()]
            return 200, {"kind": "compute#project", "name": p, "id": "1234", "quotas": quotas}
        if parts[0] == "aggregated":
            return self.aggregated(parts[1])
        if parts[0] == "regions" and len(parts) == 2:
            r = parts[1]
            if r not in self.regions:
                return self.not_found(f"projects/{p}/regions/{r}")
            quotas = [{"metric": m, "limit": float(v), "usage": self.usage.get((r, m), 0.0)}
                      for m, v in self.region_quotas.get(r, {}).items()]
            return 200, {"kind": "compute#region", "name": r, "status": "UP", "quotas": quotas,
                         "zones": [f"{HOST}{p}/zones/{z}" for z in self.regions[r]]}
        if parts[-2:-1] == ["operations"] or (len(parts) >= 3 and parts[-3] == "operations" and parts[-1] == "wait"):
            name = parts[-1] if parts[-1] != "wait" else parts[-2]
            return self._poll(name)
        if parts[0] == "zones":
            zone, what = parts[1], parts[2]
            if what == "operations" and len(parts) == 3 and method == "GET":
                return self.list_zone_ops(zone, q.get("filter", ""))
            if what == "instances":
                return self.instances(method, zone, parts[3] if len(parts) > 3 else None, q, body)
            if what == "disks":
                return self.disks(method, zone, parts[3] if len(parts) > 3 else None)
        if parts[0] == "global" and parts[1] in ("networks", "firewalls"):
            return self.global_obj(method, parts[1], parts[2] if len(parts) > 2 else None, body)
        if parts[0] == "regions" and parts[2] == "subnetworks":
            return self.subnetworks(method, parts[1], parts[3] if len(parts) > 3 else None, body)
        if parts[0] == "global" and parts[1] == "images":
            return 200, {"kind": "compute#image", "name": "common-cu124-v20261101", "family": parts[-1],
                         "status": "READY"}
        return self.not_found("/".join(parts))

    # ------------------------------------------------------------------------------------ instances
    def _gpu_metric(self, inst: dict[str, Any], region: str | None = None) -> tuple[str | None, int]:
        """The GPU quota metric ``inst`` counts against and how many GPUs: a Spot VM draws on
        ``PREEMPTIBLE_<metric>`` where the region grants it (limit above 0), else on the standard metric."""
        metric, count = self._std_gpu_metric(inst)
        if metric and region and (inst.get("scheduling") or {}).get("provisioningModel") == "SPOT" \
                and float(self.region_quotas.get(region, {}).get("PREEMPTIBLE_" + metric, 0)) > 0:
            metric = "PREEMPTIBLE_" + metric
        return metric, count

    @staticmethod
    def _cpu_metric(inst: dict[str, Any]) -> str:
        """The regional CPU metric a VM counts: ``CPUS`` for N1, the family's own for G2 / A2 (``G2_CPUS`` is
        the adapter's UNCONFIRMED name, modelled as it); a Spot VM's ``PREEMPTIBLE_CPUS`` is not modelled."""
        fam = inst["machineType"].rsplit("/", 1)[-1].split("-", 1)[0]
        return {"g2": "G2_CPUS", "a2": "A2_CPUS"}.get(fam, "CPUS")

    def _std_gpu_metric(self, inst: dict[str, Any]) -> tuple[str | None, int]:
        accs = inst.get("guestAccelerators") or []
        mt = inst["machineType"].rsplit("/", 1)[-1]
        table = {"nvidia-tesla-t4": "NVIDIA_T4_GPUS", "nvidia-l4": "NVIDIA_L4_GPUS",
                 "nvidia-tesla-a100": "NVIDIA_A100_GPUS", "nvidia-tesla-v100": "NVIDIA_V100_GPUS",
                 "nvidia-tesla-p100": "NVIDIA_P100_GPUS", "nvidia-tesla-p4": "NVIDIA_P4_GPUS"}
        if accs:
            return table.get(accs[0]["acceleratorType"].rsplit("/", 1)[-1]), int(accs[0].get("acceleratorCount", 1))
        if mt.startswith("g2-standard-"):  # Google's G2 table: -24 has 2 L4s, -48 4, -96 8, the others 1
            return "NVIDIA_L4_GPUS", {"24": 2, "48": 4, "96": 8}.get(mt.rsplit("-", 1)[-1], 1)
        if mt.startswith("a2-"):
            m = re.search(r"-(\d+)g$", mt)
            return "NVIDIA_A100_GPUS", int(m.group(1)) if m else 1
        return None, 0

    def instances(self, method: str, zone: str, name: str | None, q: dict[str, str],
                  body: dict[str, Any]) -> tuple[int, Any]:
        p = self.project
        region = zone.rsplit("-", 1)[0]
        objs = self.objs["instances"]
        key = f"{zone}/{name}" if name else None
        if method == "POST" and name is None:
            rid = q.get("requestId")
            if rid and rid in self.request_ids:  # idempotent retry: the first answer's operation again
                return 200, dict(self.objs["operations"][self.request_ids[rid]]["op"])
            err = self._validate(body, zone) or self._offered(body, zone)
            if err:
                return err
            metric, count = self._gpu_metric(body, region)
            for m, where in self.quota_exceeded.items():
                if m in (metric, self._cpu_metric(body), "GPUS_ALL_REGIONS"):
                    msg = (f"Quota '{m}' exceeded.  Limit: 0.0 globally." if where == "global" else
                           f"Quota '{m}' exceeded.  Limit: 0.0 in region {where}.")
                    return self.err(403, msg, "quotaExceeded", "usageLimits")
            iname = body["name"]
            if f"{zone}/{iname}" in objs:
                return self.err(409, f"The resource 'projects/{p}/zones/{zone}/instances/{iname}' already exists",
                                "alreadyExists")
            target = f"{HOST}{p}/zones/{zone}/instances/{iname}"
            if zone in self.stockout:
                msg = (f"The zone 'projects/{p}/zones/{zone}' does not have enough resources available to fulfill "
                       "the request.  '(resource type:compute)'.")
                op = self._op("insert", target, zone=zone, error={"status": 503, "message": "SERVICE UNAVAILABLE",
                              "errors": [{"code": "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS", "message": msg}]})
            else:
                node = len([1 for _ in objs])
                try:
                    node = int({i["key"]: i["value"] for i in body.get("metadata", {}).get("items", [])}
                               .get("broker-node", node))
                except ValueError:
                    pass
                public, private = self.addresses(node)
                inst = dict(body)
                inst.update(kind="compute#instance", id=self._id(), status="PROVISIONING", zone=f"{HOST}{p}/zones/{zone}",
                            selfLink=target, creationTimestamp=_now(), machineType=f"{HOST}{p}/zones/{zone}/machineTypes/"
                            f"{body['machineType'].rsplit('/', 1)[-1]}")
                nics = [dict(n) for n in body.get("networkInterfaces", [])]
                for n in nics:
                    n["networkIP"] = private
                    n["accessConfigs"] = [dict(a, natIP=public) for a in n.get("accessConfigs", [])]
                inst["networkInterfaces"] = nics
                disks = []
                for d in body.get("disks", []):
                    dname = d.get("deviceName") or iname
                    self.objs["disks"][f"{zone}/{dname}"] = {
                        "kind": "compute#disk", "name": dname, "zone": f"{HOST}{p}/zones/{zone}", "status": "READY",
                        "sizeGb": str(d.get("initializeParams", {}).get("diskSizeGb", 10)),
                        "labels": d.get("initializeParams", {}).get("labels", {}), "users": [target],
                        "autoDelete": d.get("autoDelete", False)}
                    disks.append({"boot": d.get("boot", False), "autoDelete": d.get("autoDelete", False),
                                  "deviceName": dname, "source": f"{HOST}{p}/zones/{zone}/disks/{dname}"})
                inst["disks"] = disks

                def made(inst: dict[str, Any] = inst, metric: str | None = metric, count: int = count) -> None:
                    objs[f"{zone}/{iname}"] = inst
                    if metric:
                        self.usage[(region, metric)] = self.usage.get((region, metric), 0.0) + count

                op = self._op("insert", target, zone=zone, then=made)
                self.objs["operations"][op["name"]]["op"]["targetId"] = inst["id"]
                op["targetId"] = inst["id"]
            if rid:
                self.request_ids[rid] = op["name"]
            return 200, op
        if method == "GET" and name is None:
            return 200, {"kind": "compute#instanceList", "items": [i for k, i in objs.items() if k.startswith(zone + "/")]}
        inst = objs.get(key or "")
        if inst is None:
            return self.not_found(f"projects/{p}/zones/{zone}/instances/{name}")
        if method == "GET":
            if inst["status"] == "PROVISIONING":
                inst["status"] = "STAGING"
            elif inst["status"] == "STAGING":
                inst["status"] = "RUNNING"
                if self.on_running:
                    self.on_running(inst)
            elif inst["status"] == "STOPPING":
                inst["_polls"] = inst.get("_polls", 0) + 1
                if inst["_polls"] >= self.delete_polls:
                    self._remove_instance(zone, name or "")
                    return self.not_found(f"projects/{p}/zones/{zone}/instances/{name}")
            return 200, {k: v for k, v in inst.items() if not k.startswith("_")}
        if method == "DELETE":
            inst["status"] = "STOPPING"
            op = self._op("delete", inst["selfLink"], zone=zone)
            self.objs["operations"][op["name"]]["op"]["targetId"] = inst["id"]
            return 200, dict(op, targetId=inst["id"])
        return self.err(400, "unsupported", "invalid")

    def list_zone_ops(self, zone: str, flt: str) -> tuple[int, Any]:
        """``zoneOperations.list``: the zone's operations, narrowed by a ``field = "value"`` filter."""
        ops = [dict(r["op"]) for r in self.objs["operations"].values()
               if r["op"].get("zone", "").endswith(f"/zones/{zone}")]
        if flt:
            m = re.fullmatch(r'\s*(\w+)\s*=\s*"([^"]*)"\s*', flt)
            if not m:
                return self.err(400, f"Invalid list filter expression '{flt}'.", "invalid")
            ops = [o for o in ops if str(o.get(m.group(1), "")) == m.group(2)]
        return 200, {"kind": "compute#operationList", "items": ops}

    def preempt(self, zone: str, name: str) -> dict[str, Any]:
        """Google takes Spot VM ``name`` back: a DONE ``compute.instances.preempted`` operation on it, then the VM
        deleted (instanceTerminationAction DELETE) or TERMINATED (STOP, its disk kept).  Returns the operation.
        Raises AssertionError for a VM that is not a Spot VM (Google never preempts a standard one)."""
        with self.lock:
            inst = self.objs["instances"][f"{zone}/{name}"]
            sched = inst.get("scheduling") or {}
            assert sched.get("provisioningModel") == "SPOT", f"{name} is not a Spot VM"
            op = self._op("compute.instances.preempted", inst["selfLink"], zone=zone)
            rec = self.objs["operations"][op["name"]]
            rec["op"].update(status="DONE", progress=100, endTime=_now(), targetId=inst["id"],
                             statusMessage="Instance was preempted.")
            if sched.get("instanceTerminationAction", "STOP") == "DELETE":
                self._remove_instance(zone, name)
            else:
                inst["status"] = "TERMINATED"
            return dict(rec["op"])

    def _remove_instance(self, zone: str, name: str) -> None:
        inst = self.objs["instances"].pop(f"{zone}/{name}", None)
        if inst is None:
            return
        region = zone.rsplit("-", 1)[0]
        metric, count = self._gpu_metric(inst, region)
        if metric:
            self.usage[(region, metric)] = max(0.0, self.usage.get((region, metric), 0.0) - count)
        for d in inst.get("disks", []):
            k = f"{zone}/{d['deviceName']}"
            disk = self.objs["disks"].get(k)
            if disk is None:
                continue
            if d.get("autoDelete"):
                self.objs["disks"].pop(k)
            else:
                disk["users"] = []

    def _validate(self, body: dict[str, Any], zone: str) -> tuple[int, Any] | None:
        lab_k, lab_v = re.compile(r"^[a-z][a-z0-9_-]{0,62}$"), re.compile(r"^[a-z0-9_-]{0,63}$")
        labels = body.get("labels") or {}
        if len(labels) > 64 or any(not lab_k.match(k) or not lab_v.match(str(v)) for k, v in labels.items()):
            return self.err(400, f"Invalid value for field 'resource.labels': {labels}", "invalid")
        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", body.get("name", "")):
            return self.err(400, f"Invalid value for field 'resource.name': '{body.get('name')}'", "invalid")
        if body.get("guestAccelerators") and (body.get("scheduling") or {}).get("onHostMaintenance") != "TERMINATE":
            return self.err(400, "Instances with guest accelerators do not support live migration.", "invalid")
        err = self._validate_scheduling(body.get("scheduling") or {})
        if err:
            return err
        if not (body.get("machineType") or "").startswith(f"zones/{zone}/machineTypes/"):
            return self.err(400, f"Invalid value for field 'resource.machineType': '{body.get('machineType')}'",
                            "invalid")
        for n in body.get("networkInterfaces", []):
            net = n.get("network", "").rsplit("/", 1)[-1]
            if net != "default" and net not in self.objs["networks"]:
                return self.not_found(f"projects/{self.project}/global/networks/{net}")
            sub = n.get("subnetwork")
            if sub and f"{sub.split('/regions/')[1].split('/')[0]}/{sub.rsplit('/', 1)[-1]}" not in \
                    self.objs["subnetworks"]:
                return self.not_found(sub)
        return None

    def _offered(self, body: dict[str, Any], zone: str) -> tuple[int, Any] | None:
        """Compute Engine's refusal of a GPU the zone does not offer: an attached accelerator type is a resource
        that "was not found" there; a G2 / A2 machine type "does not exist in zone" (texts as seen in public
        reports; the HTTP status of the first is UNCONFIRMED: 404 here)."""
        have = self.accelerators.get(zone, [])
        for a in body.get("guestAccelerators") or []:
            acc = a.get("acceleratorType", "").rsplit("/", 1)[-1]
            if acc not in have:
                return self.not_found(f"projects/{self.project}/zones/{zone}/acceleratorTypes/{acc}")
        mt = (body.get("machineType") or "").rsplit("/", 1)[-1]
        built = {"g2": "nvidia-l4", "a2": "nvidia-tesla-a100"}.get(mt.split("-", 1)[0])
        if built and built not in have and not ("ultragpu" in mt and "nvidia-a100-80gb" in have):
            return self.err(400, f"Invalid value for field 'resource.machineType': '{body.get('machineType')}'. "
                                 f"Machine type with name '{mt}' does not exist in zone '{zone}'.", "invalid")
        return None

    def _validate_scheduling(self, sched: dict[str, Any]) -> tuple[int, Any] | None:
        """``scheduling`` as Compute Engine takes it (docs/reference/gcp-fixtures.md "Spot VMs"): enum names as
        strings; a Spot VM cannot restart or migrate by itself; a termination action belongs to a Spot VM."""
        model = sched.get("provisioningModel", "STANDARD")
        if model not in ("STANDARD", "SPOT", "FLEX_START", "RESERVATION_BOUND"):
            return self.err(400, f"Invalid value for field 'resource.scheduling.provisioningModel': '{model}'",
                            "invalid")
        action = sched.get("instanceTerminationAction")
        if action is not None and action not in ("DELETE", "STOP"):
            return self.err(400, f"Invalid value for field 'resource.scheduling.instanceTerminationAction': "
                                 f"'{action}'", "invalid")
        if model == "SPOT":
            if sched.get("automaticRestart") is True:
                return self.err(400, "Invalid value for field 'resource.scheduling.automaticRestart': 'true'. Spot "
                                     "VMs cannot be restarted automatically.", "invalid")
            if sched.get("onHostMaintenance") != "TERMINATE":
                return self.err(400, "Invalid value for field 'resource.scheduling.onHostMaintenance': "
                                     f"'{sched.get('onHostMaintenance', 'MIGRATE')}'. Spot VMs must terminate on host "
                                     "maintenance.", "invalid")
        elif action is not None:
            return self.err(400, "Invalid value for field 'resource.scheduling.instanceTerminationAction': only Spot "
                                 "VMs take a termination action.", "invalid")
        return None

    def disks(self, method: str, zone: str, name: str | None) -> tuple[int, Any]:
        k = f"{zone}/{name}"
        d = self.objs["disks"].get(k)
        if d is None:
            return self.not_found(f"projects/{self.project}/zones/{zone}/disks/{name}")
        if method == "GET":
            return 200, d
        if d.get("users"):
            return self.err(400, f"The disk resource '{k}' is already being used by '{d['users'][0]}'",
                            "resourceInUseByAnotherResource")
        self.objs["disks"].pop(k)
        return 200, self._op("delete", f"{HOST}{self.project}/zones/{zone}/disks/{name}", zone=zone)

    def aggregated(self, what: str) -> tuple[int, Any]:
        items: dict[str, dict[str, list[Any]]] = {}
        if what in ("instances", "disks"):
            for k, v in self.objs[what].items():
                zone = k.split("/")[0]
                items.setdefault(f"zones/{zone}", {what: []})[what].append(
                    {a: b for a, b in v.items() if not a.startswith("_")})
        elif what == "acceleratorTypes":
            for zone, accs in self.accelerators.items():
                items[f"zones/{zone}"] = {"acceleratorTypes": [
                    {"kind": "compute#acceleratorType", "name": a, "description": a,
                     "zone": f"{HOST}{self.project}/zones/{zone}", "maximumCardsPerInstance": 8,
                     "selfLink": f"{HOST}{self.project}/zones/{zone}/acceleratorTypes/{a}"} for a in accs]}
        elif what == "subnetworks":
            for k, v in self.objs["subnetworks"].items():
                items.setdefault(f"regions/{k.split('/')[0]}", {"subnetworks": []})["subnetworks"].append(v)
        return 200, {"kind": f"compute#{what}AggregatedList", "items": items}

    # ------------------------------------------------------------------------------------ network
    def _users(self, kind: str, name: str) -> list[str]:
        p = self.project
        if kind == "networks":
            out = [f"projects/{p}/global/firewalls/{f['name']}" for f in self.objs["firewalls"].values()
                   if f["network"].rsplit("/", 1)[-1] == name]
            out += [f"projects/{p}/regions/{k.split('/')[0]}/subnetworks/{s['name']}"
                    for k, s in self.objs["subnetworks"].items() if s["network"].rsplit("/", 1)[-1] == name]
            return out
        return []

    def global_obj(self, method: str, coll: str, name: str | None, body: dict[str, Any]) -> tuple[int, Any]:
        p = self.project
        objs = self.objs[coll]
        if method == "POST":
            n = body["name"]
            if n in objs:
                return self.err(409, f"The resource 'projects/{p}/global/{coll}/{n}' already exists", "alreadyExists")
            if coll == "firewalls":
                net = body.get("network", "").rsplit("/", 1)[-1]
                if net != "default" and net not in self.objs["networks"]:
                    return self.not_found(f"projects/{p}/global/networks/{net}")
            obj = dict(body, id=self._id(), selfLink=f"{HOST}{p}/global/{coll}/{n}", creationTimestamp=_now())
            return 200, self._op("insert", obj["selfLink"], then=lambda: objs.__setitem__(n, obj))
        if method == "GET" and name is None:
            return 200, {"items": list(objs.values())}
        obj = objs.get(name or "")
        if obj is None:
            return self.not_found(f"projects/{p}/global/{coll}/{name}")
        if method == "GET":
            return 200, obj
        users = self._users(coll, name or "")
        if users:
            return self.err(400, f"The network resource 'projects/{p}/global/networks/{name}' is already being used "
                                 f"by '{users[0]}'", "resourceInUseByAnotherResource")
        objs.pop(name or "")
        return 200, self._op("delete", obj["selfLink"])

    def subnetworks(self, method: str, region: str, name: str | None, body: dict[str, Any]) -> tuple[int, Any]:
        p = self.project
        objs = self.objs["subnetworks"]
        if method == "POST":
            n = body["name"]
            net = body.get("network", "").rsplit("/", 1)[-1]
            if net not in self.objs["networks"]:
                return self.not_found(f"projects/{p}/global/networks/{net}")
            obj = dict(body, id=self._id(), region=f"{HOST}{p}/regions/{region}",
                       selfLink=f"{HOST}{p}/regions/{region}/subnetworks/{n}")
            return 200, self._op("insert", obj["selfLink"], region=region,
                                 then=lambda: objs.__setitem__(f"{region}/{n}", obj))
        obj = objs.get(f"{region}/{name}")
        if obj is None:
            return self.not_found(f"projects/{p}/regions/{region}/subnetworks/{name}")
        if method == "GET":
            return 200, obj
        users = [i["selfLink"] for i in self.objs["instances"].values()
                 if any((n.get("subnetwork") or "").endswith(f"/subnetworks/{name}") for n in i["networkInterfaces"])]
        if users:
            return self.err(400, f"The subnetwork resource 'projects/{p}/regions/{region}/subnetworks/{name}' is "
                                 f"already being used by '{users[0]}'", "resourceInUseByAnotherResource")
        objs.pop(f"{region}/{name}")
        return 200, self._op("delete", obj["selfLink"], region=region)

    # ------------------------------------------------------------------------------------ Cloud Quotas
    def quotas_api(self, method: str, path: str, q: dict[str, str], body: dict[str, Any]) -> tuple[int, Any]:
        m = re.fullmatch(r"/v1/projects/([^/]+)/locations/global/quotaPreferences(?:/([^/]+))?", path)
        if not m:
            return self.rpc_err(404, f"path {path} not found", "NOT_FOUND")
        project, pid = m.group(1), m.group(2)
        prefs = self.objs["quotaPreferences"]
        parent = f"projects/{project}/locations/global"
        self.quota_requests.append((method, pid, dict(q), body))
        if method == "POST":
            pid = q.get("quotaPreferenceId") or f"pref-{self._id()}"
            name = f"{parent}/quotaPreferences/{pid}"
            if name in prefs:
                return self.rpc_err(409, f"QuotaPreference {name} already exists", "ALREADY_EXISTS")
            same = self._same_quota(body)
            if same is not None:  # one preference per quota and dimensions: a second is refused
                return self.rpc_err(409, f"A QuotaPreference for quota {body.get('quotaId')} with dimensions "
                                         f"{body.get('dimensions') or {}} already exists: {same}", "ALREADY_EXISTS")
            return self._new_pref(name, body)
        if method == "PATCH" and pid is not None:
            name = f"{parent}/quotaPreferences/{pid}"
            pref = prefs.get(name)
            if pref is None:
                if q.get("allowMissing") != "true":
                    return self.rpc_err(404, f"QuotaPreference {name} not found", "NOT_FOUND")
                return self._new_pref(name, body)
            mask = [m for m in q.get("updateMask", "").split(",") if m]
            if not mask:
                return self.rpc_err(400, "update_mask is required", "INVALID_ARGUMENT")
            if "quotaConfig.preferredValue" in mask and not body.get("contactEmail"):
                return self.rpc_err(400, "contact_email is required for a quota increase", "INVALID_ARGUMENT")
            for path in mask:
                if path == "quotaConfig.preferredValue":
                    pref["quotaConfig"]["preferredValue"] = (body.get("quotaConfig") or {}).get("preferredValue")
                elif path == "justification":
                    pref["justification"] = body.get("justification", "")
                elif path != "contactEmail":
                    return self.rpc_err(400, f"field {path} cannot be updated", "INVALID_ARGUMENT")
            pref["quotaConfig"].update(stateDetail="pending review", traceId=f"trace-{self._id()}")
            pref.update(reconciling=True, updateTime=_now(), etag=self._id())
            return 200, pref
        if method == "GET" and pid is None:
            items = list(prefs.values())
            if "reconciling=true" in q.get("filter", ""):
                items = [x for x in items if x.get("reconciling")]
            return 200, {"quotaPreferences": items}
        pref = prefs.get(f"{parent}/quotaPreferences/{pid}")
        if pref is None:
            return self.rpc_err(404, f"QuotaPreference {pid} not found", "NOT_FOUND")
        return 200, pref

    def _same_quota(self, body: dict[str, Any]) -> str | None:
        for name, p in self.objs["quotaPreferences"].items():
            if p.get("quotaId") == body.get("quotaId") and (p.get("dimensions") or {}) == (body.get("dimensions")
                                                                                             or {}):
                return name
        return None

    def _new_pref(self, name: str, body: dict[str, Any]) -> tuple[int, Any]:
        if not body.get("contactEmail"):
            return self.rpc_err(400, "contact_email is required for a quota increase", "INVALID_ARGUMENT")
        cfg = dict(body.get("quotaConfig") or {})
        cfg.update(grantedValue="0", stateDetail="pending review", traceId=f"trace-{self._id()}")
        pref = {k: v for k, v in body.items() if k != "contactEmail"}
        pref.update(name=name, quotaConfig=cfg, reconciling=True, createTime=_now(), updateTime=_now(),
                    etag=self._id())
        self.objs["quotaPreferences"][name] = pref
        return 200, pref

    def decide(self, name: str, granted: int) -> None:
        """Google's answer to a preference: reconciling ends with ``granted`` (raises the region's quota)."""
        pref = self.objs["quotaPreferences"][name]
        pref["reconciling"] = False
        pref["quotaConfig"]["grantedValue"] = str(granted)
        pref["quotaConfig"]["stateDetail"] = "approved" if granted >= int(pref["quotaConfig"]["preferredValue"]) \
            else "denied"

    # ------------------------------------------------------------------------------------ billing
    def billing(self, path: str, q: dict[str, str]) -> tuple[int, Any]:
        if path == "/v1/services":
            return 200, {"services": [{"name": "services/6F81-5844-456A", "serviceId": "6F81-5844-456A",
                                       "displayName": "Compute Engine"}]}
        if path != "/v1/services/6F81-5844-456A/skus":
            return self.rpc_err(404, "not found", "NOT_FOUND")
        page = int(q.get("pageToken") or 0)
        per = 2
        items = self.skus[page * per:(page + 1) * per]
        nxt = str(page + 1) if (page + 1) * per < len(self.skus) else ""
        return 200, {"skus": items, "nextPageToken": nxt}


def sku(desc: str, usage: str, usd: float, *, group: str = "GPU", region: str = "us-central1") -> dict[str, Any]:
    units, nanos = int(usd), int(round((usd - int(usd)) * 1e9))
    return {"name": f"services/6F81-5844-456A/skus/{abs(hash((desc, usage))) % 10**8}", "description": desc,
            "category": {"serviceDisplayName": "Compute Engine", "resourceFamily": "Compute", "resourceGroup": group,
                         "usageType": usage},
            "serviceRegions": [region],
            "pricingInfo": [{"summary": "", "pricingExpression": {
                "usageUnit": "h", "tieredRates": [{"startUsageAmount": 0, "unitPrice": {
                    "currencyCode": "USD", "units": str(units), "nanos": nanos}}]}}]}


def _default_skus() -> list[dict[str, Any]]:
    return [sku("Nvidia Tesla T4 GPU running in Americas", "OnDemand", 0.30),
            sku("Nvidia Tesla T4 GPU attached to Spot Preemptible VMs running in Americas", "Preemptible", 0.12),
            sku("N1 Predefined Instance Core running in Americas", "OnDemand", 0.031611, group="CPU"),
            sku("Nvidia Tesla V100 GPU running in Americas", "OnDemand", 2.40),
            sku("Nvidia Tesla T4 GPU running in EMEA", "OnDemand", 0.41, region="europe-west4")]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000-00:00", time.gmtime())


def authorize_on(hosts: Any, user: str = "root") -> Callable[[dict[str, Any]], None]:
    """An ``on_running`` for :class:`GCPEmulator` whose VMs are netns ``hosts``: the ``ssh-keys`` metadata entry
    (``<user>:<key>``, ``user`` the account the hosts were made with) goes into the hosts' shared
    ``authorized_keys``, as the guest agent does on a real VM (it makes that user, with passwordless sudo)."""

    def on_running(inst: dict[str, Any]) -> None:
        md = {i["key"]: i["value"] for i in inst["metadata"]["items"]}
        got, _, key = md["ssh-keys"].partition(":")
        assert got == user, f"ssh-keys names {got!r}, the VMs' login user is {user!r}"
        with open(hosts.root / "ssh" / "authorized_keys", "a") as f:
            f.write(key.strip() + "\n")

    return on_running
