"""A small stateful emulator of the OCI Compute / VirtualNetwork / Identity calls the ``oci`` adapter makes, served
over HTTP on 127.0.0.1 so the REAL ``oci`` SDK talks to it through ``service_endpoint`` (``OCI_SERVICE_ENDPOINT``).

What it keeps: VCNs (each with its default route table), internet gateways, security lists, subnets, instances
(with a primary VNIC and its attachment), availability domains and one GPU image.  What it enforces, as OCI does:

* instances go PROVISIONING -> RUNNING ``boot_s`` seconds after the launch, TERMINATING -> TERMINATED
  ``terminate_s`` after ``terminate_instance`` (and stay listed as TERMINATED);
* ``instance_action`` (``POST /instances/{id}?action=STOP|START``): RUNNING -> STOPPING -> STOPPED and STOPPED ->
  STARTING -> RUNNING ``boot_s`` seconds later; a started instance gets a new ephemeral public IP
  (``restart_addresses(node_index)`` when given, else the next 203.0.113.x); an action in the wrong state is 409
  ``IncorrectState``;
* a subnet delete is asynchronous: the subnet is TERMINATING for ``subnet_delete_s`` seconds, then gone;
* 409 Conflict: deleting a subnet that still holds a live instance, a security list a subnet still uses, an
  internet gateway a route rule still targets, a VCN that still holds a subnet / gateway / security list;
* injected failures: ``fail[(METHOD, collection)]`` is a list of HTTP statuses answered (and consumed) one per
  matching request before the real handling, e.g. ``{("DELETE", "subnets"): [503]}``;
* preemption: :meth:`preempt` reclaims a preemptible instance (TERMINATING -> TERMINATED, no reason on the
  instance, an Events-service event in ``events``); ``reclaim_on_terminate`` = N reclaims the next N preemptible
  instances that broker terminates just before its terminate arrives, which then meets OCI's 409
  ``IncorrectState`` (the instance is already TERMINATING): a preemption during teardown.

Hooks for end-to-end tests whose instances are real hosts (network namespaces with sshd):
``addresses(node_index) -> (public_ip, private_ip)`` gives the primary VNIC's addresses (node index = the
``broker-node`` freeform tag); ``on_running(instance)`` runs when an instance turns RUNNING (the test does what
cloud-init would: authorized_keys, a late sshd); ``login_user`` replaces the ``broker-ssh-user`` tag (the account the
netns hosts were made with: ``netns_hosts(n, login_user="opc")`` for an image's own user with passwordless sudo); ``on_terminating(instance)`` runs when an instance
starts terminating, by a terminate or a reclaim (the test stops the host: the VM is going away).  Request signatures are not checked.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from werkzeug import Request, Response
from werkzeug.serving import WSGIRequestHandler, make_server

API = "20160918"
TERMINAL = ("TERMINATED",)
#: shape prefixes with preemptible capacity among GPU and small shapes (OCI preemptible doc, 2025-02-11)
PREEMPTIBLE_SHAPES = ("VM.GPU2.", "VM.GPU3.", "VM.Standard", "VM.DenseIO", "VM.Optimized3.")


class _Quiet(WSGIRequestHandler):
    def log_request(self, *args: Any, **kwargs: Any) -> None:  # no access log on the test's stderr
        pass


def _public(obj: Any) -> Any:
    """``obj`` as OCI answers it: an Instance has no ``subnetId`` (the emulator keeps it beside the instance for
    its own checks; the API names the subnet on the VNIC and its attachment only)."""
    if isinstance(obj, list):
        return [_public(x) for x in obj]
    if isinstance(obj, dict) and str(obj.get("id", "")).startswith("ocid1.instance."):
        return {k: v for k, v in obj.items() if k != "subnetId"}
    return obj


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class OCIEmulator:
    def __init__(self, *, compartment: str, ads: tuple[str, ...] = ("AD-1",), region: str = "us-ashburn-1",
                 boot_s: float = 0.5, terminate_s: float = 1.0, subnet_delete_s: float = 1.5,
                 addresses: Callable[[int], tuple[str | None, str]] | None = None,
                 on_running: Callable[[dict[str, Any]], None] | None = None, login_user: str | None = None,
                 restart_addresses: Callable[[int], str | None] | None = None,
                 on_terminating: Callable[[dict[str, Any]], None] | None = None):
        self.compartment, self.ads, self.region = compartment, ads, region
        self.boot_s, self.terminate_s, self.subnet_delete_s = boot_s, terminate_s, subnet_delete_s
        self.addresses, self.on_running, self.login_user = addresses, on_running, login_user
        self.restart_addresses = restart_addresses
        self.on_terminating = on_terminating
        #: how many more preemptible instances OCI reclaims just before broker's terminate of them arrives
        self.reclaim_on_terminate = 0
        self.actions: list[tuple[str, str]] = []  # (instance id, action) of every instance_action
        self.lock = threading.RLock()
        self.ids = itertools.count(1)
        self.objs: dict[str, dict[str, dict[str, Any]]] = {c: {} for c in (
            "vcns", "routeTables", "internetGateways", "securityLists", "subnets", "instances", "vnics",
            "vnicAttachments")}
        self.timers: dict[str, float] = {}  # object id -> when its pending state change happens
        self.fail: dict[tuple[str, str], list[int]] = {}
        self.journal: list[tuple[str, str, int]] = []  # (method, path, status) of every request
        self.exchanges: list[tuple[str, str, Any, int, Any]] = []  # (method, path, body, status, answer)
        self.updates: list[tuple[str, dict[str, Any]]] = []  # (security list id, PUT body) of every update
        self.events: list[dict[str, Any]] = []  # Events-service events emitted (preemption actions)
        self._srv = make_server("127.0.0.1", 0, self.app, threaded=True, request_handler=_Quiet)
        self.url = f"http://127.0.0.1:{self._srv.server_port}"
        self._thread = threading.Thread(target=self._srv.serve_forever, daemon=True)

    # ------------------------------------------------------------------ life
    def __enter__(self) -> "OCIEmulator":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._srv.shutdown()
        self._srv.server_close()

    # ------------------------------------------------------------------ state helpers
    def new_id(self, kind: str) -> str:
        return f"ocid1.{kind}.oc1..e{next(self.ids):04d}"

    def live(self, coll: str) -> list[dict[str, Any]]:
        """Objects of ``coll`` not TERMINATED (instances) / not gone (network objects)."""
        with self.lock:
            self._tick()
            return [o for o in self.objs[coll].values() if o.get("lifecycleState") not in TERMINAL]

    def add_instance(self, *, tags: dict[str, str], state: str = "RUNNING", age_s: float = 0.0,
                     shape: str = "VM.GPU.A10.1", name: str = "someone-else") -> str:
        """An instance that broker did not launch (another installation's, say)."""
        iid = self.new_id("instance")
        created = (datetime.now(timezone.utc) - timedelta(seconds=age_s)).isoformat().replace("+00:00", "Z")
        with self.lock:
            self.objs["instances"][iid] = {
                "id": iid, "compartmentId": self.compartment, "availabilityDomain": self.ads[0], "shape": shape,
                "displayName": name, "lifecycleState": state, "freeformTags": dict(tags), "timeCreated": created,
                "region": self.region}
        return iid

    def preempt(self, iid: str) -> None:
        """OCI reclaims preemptible instance ``iid`` (test hook): the Events service's
        ``com.oraclecloud.computeapi.instancepreemptionaction`` event is recorded in ``events``, then the instance
        goes TERMINATING -> TERMINATED (``terminate_s``) like a user terminate; GetInstance carries no reason.
        Raises ValueError for an instance without ``preemptibleInstanceConfig`` or one already terminating."""
        with self.lock:
            inst = self.objs["instances"][iid]
            if inst.get("preemptibleInstanceConfig") is None:
                raise ValueError(f"{iid} is an on-demand instance: OCI never reclaims it")
            if inst["lifecycleState"] in ("TERMINATING", "TERMINATED"):
                raise ValueError(f"{iid} is already {inst['lifecycleState']}")
            action = ((inst.get("preemptibleInstanceConfig") or {}).get("preemptionAction") or {}).get("type")
            self.events.append({"eventType": "com.oraclecloud.computeapi.instancepreemptionaction",
                                "data": {"resourceId": iid, "compartmentId": inst["compartmentId"],
                                         "additionalDetails": {"preemptionAction": action}}})
            self._terminating(inst)

    def preempted(self) -> list[str]:
        """Ids of the instances OCI reclaimed (:meth:`preempt`), in order."""
        with self.lock:
            return [e["data"]["resourceId"] for e in self.events
                    if e["eventType"] == "com.oraclecloud.computeapi.instancepreemptionaction"]

    def preemptible(self) -> list[str]:
        """Ids of the live (not terminating / terminated) preemptible instances, in launch order."""
        with self.lock:
            self._tick()
            return [i["id"] for i in self.objs["instances"].values() if i.get("preemptibleInstanceConfig")
                    is not None and i["lifecycleState"] not in ("TERMINATING", "TERMINATED")]

    def private_ip(self, iid: str) -> str | None:
        """The private IP of instance ``iid``'s primary VNIC (which host it is, for tests whose instances are
        hosts)."""
        with self.lock:
            for a in self.objs["vnicAttachments"].values():
                if a["instanceId"] == iid:
                    return self.objs["vnics"][a["vnicId"]].get("privateIp")
        return None

    def _terminating(self, inst: dict[str, Any]) -> None:
        inst["lifecycleState"] = "TERMINATING"
        self.timers[inst["id"]] = time.monotonic() + self.terminate_s
        if self.on_terminating:
            self.on_terminating(inst)

    def _tick(self) -> None:
        now = time.monotonic()
        fired = []
        for oid, at in list(self.timers.items()):
            if at > now:
                continue
            del self.timers[oid]
            if oid in self.objs["instances"]:
                inst = self.objs["instances"][oid]
                if inst["lifecycleState"] == "STOPPING":
                    inst["lifecycleState"] = "STOPPED"
                    continue
                if inst["lifecycleState"] == "STARTING":
                    inst["lifecycleState"] = "RUNNING"
                    continue
                if inst["lifecycleState"] == "PROVISIONING":
                    inst["lifecycleState"] = "RUNNING"
                    for a in self.objs["vnicAttachments"].values():
                        if a["instanceId"] == oid:
                            a["lifecycleState"] = "ATTACHED"
                    fired.append(inst)
                elif inst["lifecycleState"] == "TERMINATING":
                    inst["lifecycleState"] = "TERMINATED"
                    for a in self.objs["vnicAttachments"].values():
                        if a["instanceId"] == oid:
                            a["lifecycleState"] = "DETACHED"
            elif oid in self.objs["subnets"]:
                del self.objs["subnets"][oid]
        for inst in fired:
            if self.on_running:
                self.on_running(inst)

    # ------------------------------------------------------------------ HTTP
    @Request.application
    def app(self, request: Request) -> Response:
        parts = [p for p in request.path.split("/") if p]
        status = 500
        resp = None
        try:
            resp = self._handle(request, parts)
            status = resp.status_code
            return resp
        except Exception as e:  # noqa: BLE001 - an emulator bug shows as a 500 the test can read
            return self._err(500, "EmulatorBug", f"{type(e).__name__}: {e}")
        finally:
            self.journal.append((request.method, request.path, status))
            # what parity tests hold to the SDK's models: the request body and the answer, as JSON
            sent = request.get_data(as_text=True)
            got = resp.get_data(as_text=True) if resp is not None and resp.content_type == "application/json" \
                else ""
            self.exchanges.append((request.method, request.path, json.loads(sent) if sent else None, status,
                                   json.loads(got) if got else None))

    @staticmethod
    def _json(obj: Any, status: int = 200) -> Response:
        return Response(json.dumps(_public(obj)), status=status, content_type="application/json",
                        headers={"opc-request-id": "emu"})

    def _err(self, status: int, code: str, message: str) -> Response:
        return self._json({"code": code, "message": message}, status)

    def _handle(self, request: Request, parts: list[str]) -> Response:
        if len(parts) < 2 or parts[0] != API:
            return self._err(404, "NotFound", f"no such path {request.path}")
        coll, rid = parts[1], (parts[2] if len(parts) > 2 else None)
        method = request.method
        with self.lock:
            queued = self.fail.get((method, coll))
            if queued:
                st = queued.pop(0)
                code = {409: "Conflict", 429: "TooManyRequests", 500: "InternalError", 502: "BadGateway",
                        503: "ServiceUnavailable"}.get(st, "Error")
                return self._err(st, code, f"injected {st} on {method} {coll}")
            self._tick()
            body = json.loads(request.data) if request.data else {}
            q = request.args
            if coll == "availabilityDomains" and method == "GET":
                return self._json([{"name": ad, "compartmentId": q.get("compartmentId"), "id": f"ad-{i}"}
                                   for i, ad in enumerate(self.ads)])
            if coll == "images":
                img = {"id": "ocid1.image.oc1..gpuimage", "displayName": "Oracle-Linux-8.10-Gpu-2026.11.01-0",
                       "operatingSystem": "Oracle Linux", "operatingSystemVersion": "8", "lifecycleState":
                       "AVAILABLE", "compartmentId": None, "timeCreated": _now()}
                return self._json(img if rid else [img])
            if coll not in self.objs:
                return self._err(404, "NotFound", f"unknown collection {coll}")
            store = self.objs[coll]
            if rid is None and method == "GET":
                return self._json(self._list(coll, q))
            if rid is None and method == "POST":
                return self._create(coll, body)
            obj = store.get(rid or "")
            if obj is None:
                return self._err(404, "NotAuthorizedOrNotFound", f"{coll}/{rid} not found")
            if method == "GET":
                return self._json(obj)
            if method == "POST" and coll == "instances" and q.get("action"):
                return self._action(obj, q.get("action"))
            if method == "PUT" and coll == "routeTables":
                if "routeRules" in body:
                    obj["routeRules"] = body["routeRules"]
                if "freeformTags" in body:
                    obj["freeformTags"] = body["freeformTags"]
                return self._json(obj)
            if method == "PUT" and coll == "securityLists":  # UpdateSecurityListDetails replaces the lists given
                self.updates.append((rid, body))
                for k in ("ingressSecurityRules", "egressSecurityRules", "freeformTags", "displayName"):
                    if k in body:
                        obj[k] = body[k]
                return self._json(obj)
            if method == "DELETE":
                return self._delete(coll, obj)
            return self._err(405, "NotAllowed", f"{method} {coll}")

    def _list(self, coll: str, q: Any) -> list[dict[str, Any]]:
        out = [o for o in self.objs[coll].values()
               if not q.get("compartmentId") or o.get("compartmentId") == q.get("compartmentId")]
        if q.get("instanceId"):
            out = [o for o in out if o.get("instanceId") == q.get("instanceId")]
        if q.get("vcnId"):
            out = [o for o in out if o.get("vcnId") == q.get("vcnId")]
        return out

    def _create(self, coll: str, b: dict[str, Any]) -> Response:
        base = {"compartmentId": b.get("compartmentId"), "displayName": b.get("displayName"),
                "freeformTags": b.get("freeformTags") or {}, "timeCreated": _now(), "lifecycleState": "AVAILABLE"}
        store = self.objs[coll]
        if coll == "vcns":
            vid, rt = self.new_id("vcn"), self.new_id("routetable")
            self.objs["routeTables"][rt] = {"id": rt, "vcnId": vid, "compartmentId": b.get("compartmentId"),
                                            "routeRules": [], "lifecycleState": "AVAILABLE",
                                            "displayName": "Default Route Table", "freeformTags": {},
                                            "timeCreated": _now()}
            store[vid] = {**base, "id": vid, "cidrBlocks": b.get("cidrBlocks"), "cidrBlock": b["cidrBlocks"][0],
                          "defaultRouteTableId": rt, "dnsLabel": b.get("dnsLabel")}
            return self._json(store[vid])
        if coll in ("internetGateways", "securityLists", "subnets"):
            if b.get("vcnId") not in self.objs["vcns"]:
                return self._err(404, "NotAuthorizedOrNotFound", f"vcn {b.get('vcnId')} not found")
            kind = {"internetGateways": "internetgateway", "securityLists": "securitylist",
                    "subnets": "subnet"}[coll]
            oid = self.new_id(kind)
            extra = {k: b.get(k) for k in ("isEnabled", "ingressSecurityRules", "egressSecurityRules", "cidrBlock",
                                           "securityListIds", "routeTableId", "dnsLabel",
                                           "prohibitPublicIpOnVnic") if k in b}
            store[oid] = {**base, "id": oid, "vcnId": b["vcnId"], **extra}
            return self._json(store[oid])
        if coll == "instances":
            return self._launch(b)
        return self._err(405, "NotAllowed", f"POST {coll}")

    def _launch(self, b: dict[str, Any]) -> Response:
        vnic = b.get("createVnicDetails") or {}
        sub = self.objs["subnets"].get(vnic.get("subnetId") or "")
        if sub is None or sub["lifecycleState"] != "AVAILABLE":
            return self._err(404, "NotAuthorizedOrNotFound", f"subnet {vnic.get('subnetId')} not found")
        tags = dict(b.get("freeformTags") or {})
        if self.login_user:
            tags["broker-ssh-user"] = self.login_user
        iid, vid, aid = self.new_id("instance"), self.new_id("vnic"), self.new_id("vnicattachment")
        node = int(tags.get("broker-node", "0"))
        public, private = self.addresses(node) if self.addresses else (None, "10.0.1.2")
        pre = b.get("preemptibleInstanceConfig")
        if pre is not None:
            shape = str(b.get("shape") or "")
            if not shape.startswith(PREEMPTIBLE_SHAPES):  # the 400 seen for an unsupported shape
                return self._err(400, "InvalidParameter",
                                 f"Invalid Preemptible instance shape: {shape} (is not supported)")
            if (pre.get("preemptionAction") or {}).get("type") != "TERMINATE":
                return self._err(400, "InvalidParameter", "preemptionAction.type must be TERMINATE")
        inst = {"id": iid, "compartmentId": b.get("compartmentId"), "availabilityDomain": b.get("availabilityDomain"),
                "shape": b.get("shape"), "displayName": b.get("displayName"), "lifecycleState": "PROVISIONING",
                "freeformTags": tags, "timeCreated": _now(), "region": self.region,
                "metadata": b.get("metadata") or {}, "subnetId": sub["id"],
                **({"preemptibleInstanceConfig": pre} if pre is not None else {})}
        self.objs["instances"][iid] = inst
        self.objs["vnics"][vid] = {"id": vid, "compartmentId": b.get("compartmentId"), "isPrimary": True,
                                   "privateIp": private, "publicIp": public if vnic.get("assignPublicIp") else None,
                                   "subnetId": sub["id"], "lifecycleState": "AVAILABLE", "timeCreated": _now()}
        self.objs["vnicAttachments"][aid] = {"id": aid, "compartmentId": b.get("compartmentId"), "instanceId": iid,
                                             "vnicId": vid, "subnetId": sub["id"], "lifecycleState": "ATTACHING",
                                             "availabilityDomain": b.get("availabilityDomain"),
                                             "timeCreated": _now()}
        self.timers[iid] = time.monotonic() + self.boot_s
        return self._json(inst)

    def _action(self, inst: dict[str, Any], action: str) -> Response:
        self.actions.append((inst["id"], action))
        state = inst["lifecycleState"]
        if action == "STOP" and state in ("RUNNING", "STOPPING", "STOPPED"):
            if state == "RUNNING":
                inst["lifecycleState"] = "STOPPING"
                self.timers[inst["id"]] = time.monotonic() + self.boot_s
            return self._json(inst)
        if action == "START" and state in ("STOPPED", "STARTING", "RUNNING"):
            if state == "STOPPED":
                inst["lifecycleState"] = "STARTING"
                self.timers[inst["id"]] = time.monotonic() + self.boot_s
                node = int(inst["freeformTags"].get("broker-node", "0"))
                for a in self.objs["vnicAttachments"].values():
                    if a["instanceId"] == inst["id"]:
                        v = self.objs["vnics"][a["vnicId"]]
                        if v.get("publicIp"):
                            v["publicIp"] = (self.restart_addresses(node) if self.restart_addresses
                                             else f"203.0.113.{next(self.ids) % 250 + 1}")
            return self._json(inst)
        return self._err(409, "IncorrectState", f"instance is {state}; cannot {action}")

    def _conflict(self, what: str) -> Response:
        return self._err(409, "Conflict", what)

    def _delete(self, coll: str, obj: dict[str, Any]) -> Response:
        oid = obj["id"]
        if coll == "instances":
            if self.reclaim_on_terminate > 0 and obj.get("preemptibleInstanceConfig") is not None \
                    and obj["lifecycleState"] not in ("TERMINATING", "TERMINATED"):
                self.reclaim_on_terminate -= 1
                self.preempt(oid)  # OCI took it back a moment before broker's terminate arrived
            if obj["lifecycleState"] in ("TERMINATING", "TERMINATED"):
                return self._err(409, "IncorrectState", f"instance {oid} is {obj['lifecycleState']}")
            self._terminating(obj)
            return Response(status=204)
        if coll == "subnets":
            users = [i["id"] for i in self.objs["instances"].values()
                     if i.get("subnetId") == oid and i["lifecycleState"] != "TERMINATED"]
            if users:
                return self._conflict(f"subnet {oid} still holds instances {users}")
            if obj["lifecycleState"] != "TERMINATING":
                obj["lifecycleState"] = "TERMINATING"
                self.timers[oid] = time.monotonic() + self.subnet_delete_s
            return Response(status=204)
        if coll == "securityLists":
            users = [s["id"] for s in self.objs["subnets"].values() if oid in (s.get("securityListIds") or [])]
            if users:
                return self._conflict(f"security list {oid} is used by subnets {users}")
        elif coll == "internetGateways":
            rts = [r["id"] for r in self.objs["routeTables"].values()
                   if any(x.get("networkEntityId") == oid for x in r.get("routeRules") or [])]
            if rts:
                return self._conflict(f"internet gateway {oid} is the target of route rules in {rts}")
        elif coll == "vcns":
            deps = [o["id"] for c in ("subnets", "internetGateways", "securityLists")
                    for o in self.objs[c].values() if o.get("vcnId") == oid]
            if deps:
                return self._conflict(f"vcn {oid} still holds {deps}")
            self.objs["routeTables"].pop(obj["defaultRouteTableId"], None)
        elif coll not in ("routeTables",):
            return self._err(405, "NotAllowed", f"DELETE {coll}")
        del self.objs[coll][oid]
        return Response(status=204)
