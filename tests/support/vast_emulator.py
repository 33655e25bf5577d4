"""A small stateful Vast.ai REST emulator for end-to-end tests: a pytest-httpserver on 127.0.0.1 whose rented
"instances" are hosts of a netns cluster (:mod:`broker.providers.netns`) with a real sshd.

Endpoints, field names, units and error bodies follow docs/reference/cloud-apis.md section A:

* ``POST /api/v0/bundles/`` -- search: the query dict as body (``{field: {op: value}}``, ``order``, ``limit``,
  ``type``, ``allocated_storage``), answered ``{"offers": [...]}`` (``gpu_ram`` MB, ``disk_space`` GB,
  ``dph_total`` $/h, ``inet_*`` Mbit/s);
  ``type`` ``"bid"`` lists the interruptible offers (rows whose host takes bids, ``offer_row(bids=True)``),
  ``"on-demand"`` every offer;
* ``PUT /api/v0/asks/{id}/`` -- rent, answered ``{"success": true, "new_contract": <instance id>}``; an ask that is
  rented already is ``{"success": false, "error": "no_such_ask", "msg": ...}`` with ``taken_status`` (400, or 404 /
  410 as the real API also answers); a ``price`` (bid, $/h) must be 0.001-128; a bid below ``min_bid`` with
  ``cancel_unavail`` true is ``410`` (nothing created), without it the instance is created stopped and the answer
  is ``{"success": false, "new_contract": id}``;
* ``GET /api/v0/instances/{id}/?owner=me`` -- ``{"instances": {<row>}}``, ``{"instances": null}`` once gone;
* ``GET /api/v1/instances/`` -- ``{"instances": [...], "next_token": ..., "total_instances": n}`` (pages of
  ``limit``, ``after_token``); ``GET /api/v0/instances/`` the same without the token;
* ``POST /api/v0/instances/{id}/ssh/`` -- ``{"ssh_key": ...}``: the key is written into the instance's host's
  ``authorized_keys`` (the only way a key reaches a host here: ``onstart`` is never run);
* ``PUT /api/v0/instances/{id}/`` -- ``{"state": "stopped"|"running"}``: stopped rows read ``actual_status``
  ``exited`` with ``intended_status`` ``stopped`` (as the real API shows a stopped container); started again they
  boot like a new rent (``boot_s``) and, behind a late sshd port, get a new SSH port (hosts change address on start);
* ``DELETE /api/v0/instances/{id}/`` -- ``{"success": true}``; ``404 {"success": false, "error":
  "no_such_instance"}`` when unknown; the first ``delete_failures[id]`` calls answer ``500``.

``throttle``: how many searches (``"search"``) / rents (``"rent"``) are answered ``429`` ``{"detail": "API requests
too frequent endpoint threshold=..."}`` first, without ``Retry-After`` (Vast sends none).

Every call needs ``Authorization: Bearer <key>`` (else ``401 {"success": false, "error": "invalid_api_key"}``).
Instance rows: ``actual_status`` null -> ``loading`` -> ``running`` (after ``boot_s``); SSH on
``public_ipaddr`` + ``ports["22/tcp"][0]["HostPort"]`` and ``ssh_host``/``ssh_port``, which point at the host's sshd
directly, or (``sshd_delay_s``) at a port on 127.0.0.1 that refuses connections until ``sshd_delay_s`` after the
instance first reported ``running`` and then forwards to the host's sshd.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

API_KEY = "test-vast-key-0123456789"


def offer_row(ask_id: int, *, machine_id: int, num_gpus: int = 2, gpu_name: str = "RTX 3090",
              dph_total: float = 0.40, disk_space: float = 200.0, min_bid: float | None = None,
              bids: bool = True) -> dict[str, Any]:
    """One ``/bundles/`` row with the documented fields and units (A8); ``min_bid`` ($/h, the current minimum bid
    for an interruptible rental) defaults to 45 % of ``dph_total``; ``bids`` False: the host takes no bids (the
    row is absent from ``type: "bid"`` searches; the emulator's own key ``_bids``, never sent)."""
    return {"id": ask_id, "ask_contract_id": ask_id, "bundle_id": ask_id, "machine_id": machine_id,
            "host_id": 7000 + machine_id, "gpu_name": gpu_name, "num_gpus": num_gpus, "gpu_ram": 24576,
            "gpu_total_ram": 24576 * num_gpus, "dph_total": dph_total, "dph_base": round(dph_total * 0.9, 4),
            "storage_cost": 0.1, "cpu_cores": 16, "cpu_cores_effective": 8.0, "cpu_ram": 32768,
            "disk_space": disk_space, "inet_up": 500.0, "inet_down": 800.0, "inet_up_cost": 0.01,
            "inet_down_cost": 0.01, "reliability": 0.995, "reliability2": 0.995, "geolocation": "Quebec, CA",
            "cuda_max_good": 12.4, "driver_version": "550.54.14", "direct_port_count": 20,
            "verification": "verified", "compute_cap": 860, "duration": 30 * 86400.0, "rentable": True,
            "rented": False, "external": False, "verified": True, "public_ipaddr": "127.0.0.1",
            "min_bid": round(dph_total * 0.45, 4) if min_bid is None else min_bid, "is_bid": False, "_bids": bids}


@dataclass
class Instance:
    id: int
    ask_id: int
    host: int | None  # index of the netns host, None: no reachable host (another account's machine, say)
    label: str
    body: dict[str, Any]
    offer: dict[str, Any]
    created: float = field(default_factory=time.time)
    running_since: float | None = None
    forward: Any = None  # the late sshd port (a LateForwarder)
    bid: float | None = None  # the create body's ``price``: an interruptible (bid) instance
    #: forced states (test hooks: outbid, exited): actual_status, cur_state, next_state, intended_status
    forced: dict[str, str] | None = None
    stopped: bool = False


class VastEmulator:
    """The emulator; ``url`` goes into ``VAST_API_URL``.  ``hosts``: a :class:`NetnsCluster` (rented instances take
    its hosts in order).  ``boot_s``: seconds from rent to ``running``; ``sshd_delay_s``: seconds from the first
    ``running`` answer until the instance's SSH port accepts; ``delete_failures``: how many DELETE calls answer 500
    before one succeeds (every instance).  ``calls`` records ``(method, path, json body)`` of every request,
``requests`` the same with the query string.
    Faults seen on the real API: ``lying_deletes``: how many DELETE calls per instance answer ``{"success": true}``
    while the instance stays listed; ``never_ready``: instances stay ``loading`` (``actual_status`` null, then
    ``loading``) for ever; ``dph_factor``: the instance rows report ``dph_total`` this many times the offer's;
    ``dph_as``: the instance rows report ``dph_total`` as this function of that rate makes it (a string, text, NaN;
    ``...`` leaves the field out);
    ``hostless``: instances are rented without a netns host (nothing to log in to; ``hosts`` may be None);
    ``bind``: the address it listens on (the netns cluster's ``gateway``, for node-side calls such as the dead-man
    switch's DELETE)."""

    def __init__(self, hosts, *, offers: list[dict[str, Any]] | None = None, boot_s: float = 0.5,
                 sshd_delay_s: float = 0.0, delete_failures: int = 0, install_posted_keys: bool = True,
                 lose_first_keys: int = 0, lying_deletes: int = 0, never_ready: bool = False,
                 dph_factor: float = 1.0, hostless: bool = False, bind: str = "127.0.0.1", dph_as: Any = None,
                 taken_status: int = 400, throttle: dict[str, int] | None = None):
        from pytest_httpserver import HTTPServer

        self.hosts = hosts
        self.offers = offers if offers is not None else [offer_row(5101, machine_id=11)]
        self.boot_s, self.sshd_delay_s = boot_s, sshd_delay_s
        self.delete_failures = delete_failures
        self.install_posted_keys = install_posted_keys
        # the first N key API calls answer success but the key never reaches the host (seen: a key call racing
        # the container's start); the client must post it again when logins are refused
        self.lose_first_keys = lose_first_keys
        self.lying_deletes, self.never_ready = lying_deletes, never_ready
        self.dph_factor, self.hostless = dph_factor, hostless
        self.dph_as = dph_as
        #: a message: every stop / start (PUT instances/{id}/) is refused with it (``400 {"success": false}``)
        self.refuse_state: str | None = None
        self.taken_status = taken_status
        self.throttle = dict(throttle or {})
        self.instances: dict[int, Instance] = {}
        self.destroyed: list[int] = []
        self.calls: list[tuple[str, str, Any]] = []
        #: every request as sent: method, path, query (name -> values), JSON body (parity tests compare clients)
        self.requests: list[dict[str, Any]] = []
        self.keys_posted: list[tuple[int, str]] = []
        self._deletes: dict[int, int] = {}
        self._next_id = 31000
        self._lock = threading.RLock()
        self._free_hosts = list(range(hosts.n)) if hosts is not None else []
        self.server = HTTPServer(host=bind, port=0)
        s = self.server
        s.expect_request("/api/v0/bundles/", method="POST").respond_with_handler(self._search)
        s.expect_request(re.compile(r"^/api/v0/asks/\d+/$"), method="PUT").respond_with_handler(self._rent)
        s.expect_request(re.compile(r"^/api/v0/instances/\d+/ssh/$"), method="POST").respond_with_handler(self._key)
        s.expect_request(re.compile(r"^/api/v0/instances/\d+/$"), method="GET").respond_with_handler(self._show)
        s.expect_request(re.compile(r"^/api/v0/instances/\d+/$"), method="PUT").respond_with_handler(self._put)
        s.expect_request(re.compile(r"^/api/v0/instances/\d+/$"), method="DELETE").respond_with_handler(self._delete)
        s.expect_request(re.compile(r"^/api/v[01]/instances/$"), method="GET").respond_with_handler(self._list)
        s.start()

    # ------------------------------------------------------------------ test side
    @property
    def url(self) -> str:
        return self.server.url_for("").rstrip("/")

    def close(self) -> None:
        with self._lock:
            for inst in self.instances.values():
                if inst.forward is not None:
                    inst.forward.stop.set()
        self.server.clear()
        if self.server.is_running():
            self.server.stop()

    def add_instance(self, label: str, *, host: int | None = None, age_s: float = 3600.0,
                     offer: dict[str, Any] | None = None) -> int:
        """An instance that already runs in the account (e.g. another installation's), rented ``age_s`` ago."""
        with self._lock:
            offer = offer or offer_row(5999, machine_id=99)
            iid = self._new_id()
            if host is not None:
                self._free_hosts.remove(host)
            inst = Instance(iid, int(offer["id"]), host, label, {"label": label}, offer,
                            created=time.time() - age_s, running_since=time.time() - age_s + 60)
            self.instances[iid] = inst
            return iid

    def deletes_of(self, iid: int) -> int:
        return sum(1 for m, p, _ in self.calls if m == "DELETE" and p == f"/api/v0/instances/{iid}/")

    # ------------------------------------------------------------------ helpers
    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    @staticmethod
    def _json(data: Any, status: int = 200):
        from werkzeug import Response

        return Response(json.dumps(data), status=status, content_type="application/json")

    def _enter(self, request) -> Any:
        """Record the call; an answer when the key is wrong, else None."""
        try:
            body = json.loads(request.get_data() or b"null")
        except ValueError:
            body = request.get_data(as_text=True)
        with self._lock:
            self.calls.append((request.method, request.path, body))
            self.requests.append({"method": request.method, "path": request.path,
                                  "query": {k: request.args.getlist(k) for k in request.args}, "body": body})
        if request.headers.get("Authorization") != f"Bearer {API_KEY}":
            return self._json({"success": False, "error": "invalid_api_key", "msg": "Invalid user key"}, 401)
        return None

    @staticmethod
    def _match(row: dict[str, Any], query: dict[str, Any]) -> bool:
        for name, ops in query.items():
            if not isinstance(ops, dict) or name not in row:
                continue  # order / limit / type / allocated_storage, or a field the rows do not carry
            v = row[name]
            for op, want in ops.items():
                ok = {"eq": lambda: v == want, "neq": lambda: v != want, "gt": lambda: v > want,
                      "gte": lambda: v >= want, "lt": lambda: v < want, "lte": lambda: v <= want,
                      "in": lambda: v in want, "notin": lambda: v not in want}.get(op, lambda: True)()
                if not ok:
                    return False
        return True

    def _row(self, inst: Instance) -> dict[str, Any]:
        now = time.time()
        status: str | None = None
        if self.never_ready:
            status = "loading" if now - inst.created >= self.boot_s / 2 else None
        elif now - inst.created >= self.boot_s:
            status = "running"
            if inst.running_since is None:
                inst.running_since = now
        elif now - inst.created >= self.boot_s / 2:
            status = "loading"
        if inst.stopped:
            status = "exited"
        host, port = "127.0.0.1", 0
        if status == "running" and inst.host is not None:
            host, port = self.hosts.ip(inst.host), 22
            if self.sshd_delay_s:
                if inst.forward is None:
                    from tests.support.netfwd import LateForwarder

                    inst.forward = LateForwarder((self.hosts.ip(inst.host), 22), self.sshd_delay_s)
                host, port = "127.0.0.1", inst.forward.port
        o = inst.offer
        run_state = "stopped" if inst.stopped else "running"
        states = {"actual_status": status, "intended_status": run_state, "cur_state": run_state,
                  "next_state": run_state}
        if inst.forced:
            states.update(inst.forced)
            status = states["actual_status"]
            if status != "running":
                host, port = "127.0.0.1", 0
        dph = inst.bid + (o["dph_total"] - o["dph_base"]) if inst.bid is not None else o["dph_total"]
        row = {"id": inst.id, "machine_id": o["machine_id"], "host_id": o["host_id"], **states,
                "status_msg": "success, running pytorch/pytorch" if status == "running" else "Loading image",
                "ssh_host": host, "ssh_port": port, "ssh_idx": "1", "public_ipaddr": host,
                "ports": {"22/tcp": [{"HostIp": "0.0.0.0", "HostPort": str(port)}]} if port else {},
                "local_ipaddrs": "10.0.0.5 ", "dph_total": round(dph * self.dph_factor, 6), "dph_base": o["dph_base"],
                "storage_cost": o["storage_cost"], "num_gpus": o["num_gpus"], "gpu_name": o["gpu_name"],
                "gpu_ram": o["gpu_ram"], "cpu_ram": o["cpu_ram"],
                "disk_space": float(inst.body.get("disk") or o["disk_space"]), "label": inst.label,
                "start_date": inst.created, "end_date": None, "image_runtype": inst.body.get("runtype", "ssh"),
                "geolocation": o["geolocation"], "uptime_mins": round((now - inst.created) / 60, 2),
                "is_bid": inst.bid is not None, "min_bid": o.get("min_bid"),
                "extra_env": [[k, v] for k, v in (inst.body.get("env") or {}).items()]}
        if self.dph_as is not None:
            row["dph_total"] = self.dph_as(row["dph_total"])
            if row["dph_total"] is ...:
                del row["dph_total"]
        return row

    @staticmethod
    def _iid(request) -> int:
        return int(re.search(r"/instances/(\d+)/", request.path).group(1))

    # ------------------------------------------------------------------ endpoints
    def _throttled(self, what: str):
        """A 429 as Vast answers a call over its rate limit (no Retry-After), while ``throttle[what]`` lasts."""
        with self._lock:
            if self.throttle.get(what, 0) > 0:
                self.throttle[what] -= 1
                return self._json({"detail": "API requests too frequent endpoint threshold=6.0"}, 429)
        return None

    def _search(self, request):
        if (bad := self._enter(request)) is not None:
            return bad
        if (bad := self._throttled("search")) is not None:
            return bad
        q = request.get_json(silent=True)
        if not isinstance(q, dict):
            return self._json({"success": False, "error": "invalid_args", "msg": "query must be a JSON object"},
                              400)
        if q.get("type", "on-demand") not in ("on-demand", "bid", "reserved"):
            return self._json({"success": False, "error": "invalid_args", "msg": f"bad type {q.get('type')!r}"}, 400)
        with self._lock:
            rows = [{k: v for k, v in o.items() if not k.startswith("_")} for o in self.offers
                    if self._match(o, q) and (q.get("type") != "bid" or o.get("_bids", True))]
        for field_, how in reversed(q.get("order") or []):
            rows.sort(key=lambda r: r.get(field_, 0), reverse=how == "desc")
        return self._json({"offers": rows[:int(q.get("limit") or 64)]})

    def _rent(self, request):
        if (bad := self._enter(request)) is not None:
            return bad
        if (bad := self._throttled("rent")) is not None:
            return bad
        ask = int(request.path.rstrip("/").rsplit("/", 1)[1])
        body = request.get_json(silent=True) or {}
        with self._lock:
            offer = next((o for o in self.offers if o["id"] == ask), None)
            if offer is None or offer["rented"]:
                return self._json({"success": False, "error": "no_such_ask",
                                   "msg": f"Instance type by id {ask} is not available."}, self.taken_status)
            if not self._free_hosts and not self.hostless:
                return self._json({"success": False, "error": "no_such_ask", "msg": "no host left (emulator)"}, 400)
            price = body.get("price")
            if price is not None and not (isinstance(price, (int, float)) and 0.001 <= price <= 128):
                return self._json({"success": False, "error": "invalid_args",
                                   "msg": "price must be a number from 0.001 to 128"}, 400)
            low = price is not None and price < float(offer.get("min_bid") or 0)
            if low and body.get("cancel_unavail"):
                # with cancel_unavail a bid that cannot be scheduled at once is refused and nothing is created
                return self._json({"success": False, "error": "unavailable",
                                   "msg": f"bid {price} is below the minimum bid {offer['min_bid']}: the machine is "
                                          "unavailable now"}, 410)
            offer["rented"] = True
            iid = self._new_id()
            host = self._free_hosts.pop(0) if self._free_hosts else None
            inst = Instance(iid, ask, host, str(body.get("label") or ""), body, offer, bid=price)
            self.instances[iid] = inst
            if low:  # seen (dstack): the instance is created stopped and the answer says failure with its id
                inst.forced = dict.fromkeys(("actual_status", "cur_state", "next_state", "intended_status"),
                                            "stopped")
                return self._json({"success": False, "error": "insufficient_bid", "new_contract": iid,
                                   "msg": "bid below the current minimum"})
        return self._json({"success": True, "new_contract": iid})

    def outbid(self, iid: int, *, intended: str = "running") -> None:
        """Another renter outbids instance ``iid`` (test hook): the container is stopped (actual_status, cur_state,
        next_state ``stopped``); ``intended`` is what intended_status reads (unconfirmed on the real API)."""
        with self._lock:
            self.instances[iid].forced = {"actual_status": "stopped", "cur_state": "stopped",
                                          "next_state": "stopped", "intended_status": intended}

    def exit_container(self, iid: int) -> None:
        """Instance ``iid``'s container exits unexpectedly (test hook): actual_status ``exited``."""
        with self._lock:
            self.instances[iid].forced = {"actual_status": "exited"}

    def _show(self, request):
        if (bad := self._enter(request)) is not None:
            return bad
        with self._lock:
            inst = self.instances.get(self._iid(request))
            return self._json({"instances": self._row(inst) if inst else None})

    def _list(self, request):
        if (bad := self._enter(request)) is not None:
            return bad
        with self._lock:
            rows = [self._row(i) for i in sorted(self.instances.values(), key=lambda i: i.id)]
        if request.path.startswith("/api/v0/"):
            return self._json({"instances": rows})
        limit = int(json.loads(request.args.get("limit", "25")))
        after = request.args.get("after_token")
        if after:
            rows = [r for r in rows if r["id"] > int(json.loads(after))]
        page = rows[:limit]
        token = str(page[-1]["id"]) if len(rows) > limit else None
        return self._json({"instances": page, "next_token": token, "total_instances": len(self.instances)})

    def _key(self, request):
        if (bad := self._enter(request)) is not None:
            return bad
        iid = self._iid(request)
        key = ((request.get_json(silent=True) or {}).get("ssh_key") or "").strip()
        with self._lock:
            inst = self.instances.get(iid)
            if inst is None:
                return self._json({"success": False, "error": "no_such_instance",
                                   "msg": f"Instance {iid} not found."}, 404)
            if not key.startswith("ssh-"):
                return self._json({"success": False, "error": "invalid_args", "msg": "invalid ssh key"}, 400)
            self.keys_posted.append((iid, key))
            lost = len(self.keys_posted) <= self.lose_first_keys
            if self.install_posted_keys and not lost and inst.host is not None:
                with open(Path(self.hosts.root) / "ssh" / "authorized_keys", "a") as f:
                    f.write(key + "\n")
        return self._json({"success": True, "msg": "ssh key added to instance"})

    def _put(self, request):
        if (bad := self._enter(request)) is not None:
            return bad
        iid = self._iid(request)
        want = (request.get_json(silent=True) or {}).get("state")
        if self.refuse_state:
            return self._json({"success": False, "error": "invalid_args", "msg": self.refuse_state}, 400)
        with self._lock:
            inst = self.instances.get(iid)
            if inst is None:
                return self._json({"success": False, "error": "no_such_instance",
                                   "msg": f"Instance {iid} not found."}, 404)
            if want == "stopped":
                inst.stopped = True
            elif want == "running" and inst.stopped:
                inst.stopped = False
                inst.created, inst.running_since = time.time(), None  # boots again
                if inst.forward is not None:  # a new port for SSH, as hosts re-map on start
                    inst.forward.stop.set()
                    inst.forward = None
            elif want != "running":
                return self._json({"success": False, "error": "invalid_args", "msg": f"bad state {want!r}"}, 400)
        return self._json({"success": True})

    def _delete(self, request):
        if (bad := self._enter(request)) is not None:
            return bad
        iid = self._iid(request)
        with self._lock:
            if iid not in self.instances:
                return self._json({"success": False, "error": "no_such_instance",
                                   "msg": f"Instance {iid} not found."}, 404)
            n = self._deletes[iid] = self._deletes.get(iid, 0) + 1
            if n <= self.delete_failures:
                return self._json({"success": False, "error": "server_error",
                                   "msg": "Internal server error, please try again"}, 500)
            if n <= self.delete_failures + self.lying_deletes:
                return self._json({"success": True})  # accepted, yet the instance stays (and bills)
            inst = self.instances.pop(iid)
            self.destroyed.append(iid)
            if inst.forward is not None:
                inst.forward.stop.set()
            for o in self.offers:
                if o["id"] == inst.ask_id:
                    o["rented"] = False
        return self._json({"success": True})
