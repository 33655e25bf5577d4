"""Vast.ai lifecycle: labels, re-quote, rent, SSH key, describe, destroy and the tagged-instance list (contract verbs
``create_instance`` / ``describe_instance`` / ``terminate`` / ``list_tagged`` plus ``prepare_access``).

Endpoints (docs/reference/cloud-apis.md A2): ``PUT /api/v0/asks/{id}/`` rents (``{"success": true, "new_contract": <id>}``);
``GET /api/v0/instances/{id}/?owner=me`` shows one (``{"instances": {...} | null}``); ``DELETE
/api/v0/instances/{id}/`` destroys; ``GET /api/v1/instances/`` lists (``{"instances": [...], "next_token": ...}``,
v0 list as fallback); ``POST /api/v0/instances/{id}/ssh/`` with ``{"ssh_key": ...}`` attaches a key.

Money rules kept here:

* every instance is labelled ``broker-run:<run_id>:n<i>/<installation_id>/<client_token>`` (client token = the
  ledger row id), so a list tells whose run, which installation and which intent row an instance belongs to;
* the rent is never resent after it may have reached Vast.ai (5xx, timeout, 2xx without an id): the instance is
  looked up by its label; when that cannot settle it, :class:`~broker.core.provider.AmbiguousCreate` is raised and this
  intent is never rented again by this adapter (a later call only looks it up);
* an answer whose shape is not the documented one is a ProviderError, never "nothing there";
* a destroy is retried on 5xx / 429 / 409 for a bounded time; 404 is gone; every terminate confirms by describe.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, NamedTuple

from broker.core.model import Offer
from broker.core.prose import usd
from broker.core.provider import RUN_TAG, AmbiguousCreate, BadInput, CapacityError, NotSupported, OfferGone, ProviderError, TransientError

from broker.providers.vast.boot import authorized_key_script, fit_onstart, onstart_script
from broker.providers.vast.client import (CREATE_PENALTY_S, DELETE_RETRY_STATUSES, PROVIDER, body_message, expect,
                                          says_gone)
from broker.providers.vast.offers import disk_short

if TYPE_CHECKING:  # pragma: no cover
    from broker.providers.vast.client import VastClient
    from broker.core.records import InstanceInfo, NodeRequest, TaggedResource

#: Image used when the recipe names none: PyTorch with CUDA 12.4 (runs on hosts with cuda_max_good >= 12.4).
DEFAULT_IMAGE = "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"
#: Labels are kept this short (Vast documents no limit; 64 fits every UI).  A standard label
#: (22-character run id, node 0, 12-character installation id, 14-character ledger id) is exactly 64; a longer
#: run id is cut (the installation and client token never are: they decide what may be terminated).
LABEL_MAX = 64
LIST_V1 = "list instances (GET /api/v1/instances/)"
LIST_V0 = "list instances (GET /api/v0/instances/)"

_PENDING = {None, "", "created", "loading", "rebooting", "scheduling"}
_VAST_ID = r"[0-9]{1,20}"
_FAILED = {"exited", "offline", "unknown", "frozen"}


# --------------------------------------------------------------------------------------------------- labels
class Label(NamedTuple):
    """What an instance label says (see :func:`make_label`)."""

    run_id: str
    node_index: int | None
    installation_id: str | None = None
    client_token: str | None = None


def _safe(value: str) -> str:
    return value.replace(":", "_").replace("/", "_").strip()


def make_label(run_id: str, node_index: int, installation_id: str | None = None,
               client_token: str | None = None) -> str:
    """``broker-run:<run_id>:n<i>[/<installation_id>[/<client_token>]]`` (an empty installation id when only the
    token is known), at most :data:`LABEL_MAX` characters: the run id is cut when needed; ``:`` and ``/`` in the
    installation id or token become ``_``."""
    tail = f":n{node_index}"
    if installation_id or client_token:
        tail += f"/{_safe(installation_id or '')}"
    if client_token:
        tail += f"/{_safe(client_token)}"
    room = max(1, LABEL_MAX - len(RUN_TAG) - 1 - len(tail))
    return f"{RUN_TAG}:{run_id[:room]}{tail}"


_NODE = r"n(\d+)(?:/([^/:]*)(?:/([^/:]*))?)?"


def read_label(label: Any) -> Label | None:
    """A label → :class:`Label` (old labels without installation id or token read as None there); None when the
    label is not broker's.  ``broker-run:<run_id>`` (no node) → ``Label(run_id, None)``."""
    if not isinstance(label, str) or not label.startswith(RUN_TAG + ":"):
        return None
    rest = label[len(RUN_TAG) + 1:]
    rid, sep, node = rest.rpartition(":")
    m = re.fullmatch(_NODE, node) if sep and rid else None
    if m:
        return Label(rid, int(m.group(1)), m.group(2) or None, m.group(3) or None)
    return Label(rest, None) if rest else None


def parse_label(label: Any) -> tuple[str, int | None] | None:
    """``"broker-run:<run_id>:n<i>..."`` → ``(run_id, i)``; ``"broker-run:<run_id>"`` → ``(run_id, None)``; else
    None (:func:`read_label` gives the installation id and client token too)."""
    got = read_label(label)
    return (got.run_id, got.node_index) if got else None


# --------------------------------------------------------------------------------------------------- rows
def instance_info(provider_id: str, row: dict[str, Any]) -> InstanceInfo:
    """One instance row (show / list) → InstanceInfo (see :meth:`VastLifecycle.describe_instance`)."""
    from broker.core.records import InstanceInfo

    raw = row.get("actual_status")
    if raw in _PENDING:
        state = "pending"
    elif raw == "running":
        state = "running"
    elif raw == "stopped" or (raw == "exited" and row.get("intended_status") == "stopped"):
        state = "stopped"  # a container stopped on request reads exited with intended_status stopped
    elif raw in _FAILED:
        state = "failed"
    else:
        state = "unknown"
    ssh_host, ssh_port = row.get("ssh_host"), row.get("ssh_port")
    ports = row.get("ports")
    public = row.get("public_ipaddr") or None
    if isinstance(public, str):
        public = public.strip() or None
    if isinstance(ports, dict) and ports.get("22/tcp") and public:
        try:
            ssh_host, ssh_port = public, int(ports["22/tcp"][0]["HostPort"])
        except (KeyError, IndexError, TypeError, ValueError):
            pass
    try:
        port = int(ssh_port) if ssh_port is not None else 22
    except (TypeError, ValueError):
        port = 22
    msg = row.get("status_msg")
    return InstanceInfo(provider_id=str(provider_id), state=state, raw_state=raw if raw is not None else "null",
                        public_ip=public, private_ip="127.0.0.1", ssh_host=ssh_host or None, ssh_port=port,
                        ssh_user="root", message=str(msg).strip() if msg else None,
                        **reported_rate(row))


def reported_rate(row: dict[str, Any]) -> dict[str, Any]:
    """An instance row's ``dph_total`` as the record's rate fields: the raw value, which the record reads
    (:func:`broker.core.records.read_rate`: a number, or a decimal string; anything else is unknown, never the
    planned price); a row without ``dph_total`` reports an unknown rate too."""
    if "dph_total" not in row or row["dph_total"] is None:
        return {"usd_per_hour": None, "rate_unreadable": "the instance row has no dph_total"}
    return {"usd_per_hour": row["dph_total"]}


def _is_row(x: Any) -> bool:
    return isinstance(x, dict) and x.get("id") is not None


def list_page(data: Any, call: str) -> tuple[list[dict[str, Any]], Any]:
    """``{"instances": [{"id": ...}, ...], "next_token": ...}`` → (rows, next token); anything else (no
    ``instances`` list, a bare list, rows without ``id``) is a ProviderError naming ``call``."""
    rows = data.get("instances") if isinstance(data, dict) else None
    expect(data, call, '{"instances": [{"id": ...}, ...], "next_token": ...}',
           isinstance(rows, list) and all(_is_row(x) for x in rows))
    return rows, data.get("next_token")  # type: ignore[union-attr]


def show_row(data: Any, provider_id: str, call: str) -> dict[str, Any] | None:
    """``{"instances": {...}}`` → the row; ``{"instances": null}`` (or a list without it) → None (gone); any other
    shape is a ProviderError naming ``call``."""
    ok = isinstance(data, dict) and "instances" in data
    row = data.get("instances") if ok else None
    ok = ok and (row is None or _is_row(row) or (isinstance(row, list) and all(_is_row(x) for x in row)))
    expect(data, call, '{"instances": {"id": ...} | null}', ok)
    if isinstance(row, list):
        row = next((x for x in row if str(x.get("id")) == str(provider_id)), None)
    return row


# --------------------------------------------------------------------------------------------------- verbs
class VastLifecycle:
    """The lifecycle verbs of :class:`broker.providers.vast.VastProvider` (mixed in; uses ``self.api``)."""

    api: "VastClient"
    price_tolerance: float
    node_workroot: Any
    #: where the instance keeps broker's files (dead-man switch state): :data:`broker.providers.vast.boot.NODE_DIR`
    node_dir: str
    delete_attempts: int
    delete_timeout_s: float
    #: describe's ``usd_per_hour`` is the instance's ``dph_total``, which includes its storage at the disk asked
    reported_rate_includes_storage = True
    #: client token -> why its create was ambiguous (never rented again; only looked up)
    _unverified: dict[str, str]
    #: instance id -> disk (GiB) its create asked for (checked again by describe when unknown at create)
    _disk_wanted: dict[str, float]
    owner_tags = True  # the label carries run, installation and client token (make_label)

    # ---- ids: Vast instance (contract) and offer (ask) ids are integers
    @classmethod
    def valid_id(cls, kind: str, provider_id: str) -> bool:
        """Vast ids are decimal integers (instances, offers): ``123456``; nothing else names a Vast object."""
        return isinstance(provider_id, str) and re.fullmatch(_VAST_ID, provider_id) is not None

    @classmethod
    def id_form(cls, kind: str) -> str:
        return "digits only, e.g. 31337"

    def _url(self, template: str, kind: str, provider_id: Any, call: str) -> str:
        """``template`` with ``{}`` replaced by the validated, URL-escaped id (ProviderError when not an id)."""
        from urllib.parse import quote

        return template.format(quote(self.require_id(kind, str(provider_id), call), safe=""))

    def _label(self, run_id: str, node_index: int, installation_id: str | None = None,
               client_token: str | None = None) -> str:
        return make_label(run_id, node_index, installation_id, client_token)

    def requote(self, offer: Offer, disk_gib: float) -> dict[str, Any]:
        """The offer's current row (``POST /api/v0/bundles/`` with ``id`` eq); raises OfferGone when it is no
        longer rentable, offers less than ``disk_gib`` of disk, or its ``dph_total`` rose more than
        ``price_tolerance`` above ``offer.usd_per_hour``."""
        call = f"re-quote offer {offer.offer_id}"
        try:
            ask_id = int(offer.offer_id)
        except ValueError:
            raise BadInput(f"vast: offer id {offer.offer_id!r} is not a Vast.ai ask id (a price-snapshot offer "
                           "cannot be rented)",
                           hint="plan with live Vast offers (set VAST_API_KEY) before `broker run`") from None
        bid = offer.attrs.get("interruptible") is True
        q = {"id": {"eq": ask_id}, "rentable": {"eq": True}, "rented": {"eq": False},
             "disk_space": {"gte": float(disk_gib)}, "type": "bid" if bid else "on-demand", "limit": 1,
             "allocated_storage": float(disk_gib)}
        rows = [r for r in self.search(q, call) if str(r.get("id")) == offer.offer_id]  # type: ignore[attr-defined]
        if not rows:
            raise OfferGone(PROVIDER, call, f"offer {offer.offer_id} ({offer.instance_type}) is no longer rentable "
                            "(rented by someone else or withdrawn)", hint="broker moves on to the next offer")
        row = rows[0]
        if disk_short(row.get("disk_space"), disk_gib):
            raise OfferGone(PROVIDER, call, f"offer {offer.offer_id} has {row['disk_space']:g} GB of disk, the recipe "
                            f"asks {disk_gib:g} GiB", hint="broker moves on to the next offer")
        if offer.attrs.get("interruptible") is True:
            # an interruptible rental pays its bid, not dph_total: the bid must still win (>= the current min_bid)
            bid = offer.attrs.get("bid_usd_per_hour")
            mb = row.get("min_bid")
            if not isinstance(bid, (int, float)):
                raise BadInput(f"vast: interruptible offer {offer.offer_id} carries no bid",
                               hint="re-plan (`broker plan`): the plan prices the bid")
            if isinstance(mb, (int, float)) and mb > bid:
                raise OfferGone(PROVIDER, call, f"offer {offer.offer_id}'s minimum bid rose to {usd(mb, places=4)}/h, "
                                f"above the planned bid {usd(bid, places=4)}/h",
                                hint="re-plan (`broker plan`) to see current bids")
            return row
        from broker.core.records import read_rate

        price, why = read_rate(row.get("dph_total"))
        if price is None:  # a price broker cannot read is unknown, never the planned one (nor $0)
            raise OfferGone(PROVIDER, call, f"offer {offer.offer_id}'s dph_total cannot be read "
                            f"({why or 'missing'}): its price is unknown", hint="broker moves on to the next offer")
        if price > offer.usd_per_hour * (1 + self.price_tolerance):
            raise OfferGone(PROVIDER, call, f"offer {offer.offer_id} now costs {usd(price, places=4)}/h, planned "
                            f"{usd(offer.usd_per_hour, places=4)}/h (+{(price / offer.usd_per_hour - 1) * 100:.0f}% > "
                            f"{self.price_tolerance * 100:.0f}%)", hint="re-plan (`broker plan`) to see current prices")
        return row

    def create_body(self, req: NodeRequest) -> dict[str, Any]:
        """The ``PUT /api/v0/asks/{id}/`` body: image, disk (GiB), env, onstart (dead-man switch first, with the
        idle stop when ``req.idle_minutes``, then the SSH key, then the request's own onstart; gzip+base64 when
        over 4048 chars), label (run, installation, client token), runtype ssh."""
        parts = ["#!/bin/bash"]
        if req.deadline is not None or req.idle_minutes:
            from broker.core.nodescripts import job_done_path

            parts.append(onstart_script(req.deadline, req.grace_seconds, self.api.url, state_dir=self.node_dir,
                                        idle_minutes=req.idle_minutes,
                                        done_file=job_done_path("root", self.node_workroot)))
        if req.ssh_public_key.strip():
            parts.append(authorized_key_script(req.ssh_public_key))
        if req.onstart:
            parts.append(req.onstart)
        env: dict[str, str] = {"BROKER_RUN_ID": req.run_id, "BROKER_NODE_INDEX": str(req.node_index)}
        for port in req.network.get("ports", []) or []:  # only when the topology needs a port from outside
            env[f"-p {int(port)}:{int(port)}"] = "1"
        return {
            "client_id": "me",
            "image": req.image or DEFAULT_IMAGE,
            "disk": float(req.disk_gib),
            "env": env,
            "onstart": fit_onstart("\n".join(parts) + "\n"),
            "runtype": "ssh_direc ssh_proxy",
            "label": self._label(req.run_id, req.node_index, req.installation_id, req.client_token),
            # on-demand: fail rather than create a stopped instance (the API's default for a running target); a bid
            # sends what the SDK sends (false): one that cannot be scheduled is answered with the instance it left
            # stopped, which create_instance destroys
            "cancel_unavail": req.offer.attrs.get("interruptible") is not True,
            "target_state": "running",
            # an interruptible (bid) rental: Vast rents on-demand when price is absent (interruptible.md 1.2)
            **({"price": float(req.offer.attrs["bid_usd_per_hour"])}
               if req.offer.attrs.get("interruptible") is True else {}),
        }

    def create_instance(self, req: NodeRequest) -> str:
        """Rent ``req.offer`` (re-quoted live first); returns the instance (contract) id.

        Raises OfferGone (rented by someone else, withdrawn, price up > tolerance, disk short: a created instance
        with less disk than asked is destroyed first), AuthError (401/403), ProviderError (402 / insufficient
        credit, hint: add credit), TransientError (429 after retries, or a connect that never reached Vast.ai:
        nothing was rented, call again), AmbiguousCreate (5xx, timeout or an answer without an instance id, and no
        instance with this intent's label could be found: one may exist and bill; do not create again, verify by
        :meth:`list_tagged` (``client_token``)).  A call for an intent whose create was ambiguous never rents
        again: it only looks the instance up by its label.
        """
        oid = req.offer.offer_id
        call = f"create instance from offer {oid} (PUT /api/v0/asks/{oid}/)"
        label = self._label(req.run_id, req.node_index, req.installation_id, req.client_token)
        if req.client_token in self._unverified:
            return self._settle(req, label, call, self._unverified[req.client_token])
        self.requote(req.offer, req.disk_gib)
        body = self.create_body(req)
        try:  # 429 = rejected before processing: safe to resend; nothing else is resent
            # one resend after the create's rate-limit penalty; after that the core waits the error's retry_after_s
            r = self.api.request("PUT", self._url("/api/v0/asks/{}/", "offer", oid, call), call, json_body=body,
                                 retry_on=frozenset({429}), retry_transport=False, accept={400, 404, 410},
                                 attempts=2, rate_interval_s=CREATE_PENALTY_S)
        except TransientError as exc:
            if exc.status == 429 or not getattr(exc, "request_sent", True):
                raise
            return self._settle(req, label, call, exc.message)
        if r.status_code in (400, 404, 410):
            if says_gone(r):
                raise OfferGone(PROVIDER, call, f"offer {oid} was taken before it could be rented "
                                f"(HTTP {r.status_code}: {self.api.scrub(body_message(r))})",
                                hint="broker moves on to the next offer", status=r.status_code)
            raise self.api.error_for(r, call)
        try:
            data: Any = r.json()
        except ValueError:
            data = None
        if isinstance(data, dict) and data.get("success") is False and data.get("new_contract") is not None:
            # a bid Vast could not schedule: it may create the instance stopped and still answer failure with its
            # id (interruptible.md 1.3); destroy it, then say there was no capacity at this bid
            stale = str(data["new_contract"])
            if self.valid_id("instance", stale):
                self.terminate("instance", stale)
            raise CapacityError(PROVIDER, call, f"Vast.ai did not schedule the bid on offer {oid} "
                                f"({self.api.scrub(body_message(r))}); the stopped instance {stale} it created was "
                                "destroyed", hint="broker moves on to the next offer; re-plan to see current bids")
        if isinstance(data, dict) and data.get("success") is False:  # a plain refusal: nothing was rented
            if says_gone(r):
                raise OfferGone(PROVIDER, call, f"offer {oid} was taken before it could be rented "
                                f"({self.api.scrub(body_message(r))})", hint="broker moves on to the next offer")
            raise ProviderError(PROVIDER, call, f"Vast.ai refused: {self.api.scrub(body_message(r))}",
                                hint="check the offer, image and disk, then retry")
        if not (isinstance(data, dict) and data.get("success") and data.get("new_contract") is not None
                and self.valid_id("instance", str(data["new_contract"]))):  # an answer is input too
            return self._settle(req, label, call, f"HTTP {r.status_code} without an instance id "
                                                  f"({self.api.scrub(body_message(r))!r})")
        return self._check_disk(str(data["new_contract"]), req, call)

    def _settle(self, req: NodeRequest, label: str, call: str, why: str) -> str:
        """After a create that may have rented: the instance carrying this intent's label, else AmbiguousCreate."""
        self._unverified[req.client_token] = why
        hint = (f"an instance may exist and bill: broker rents nothing more for this intent and finds it by its "
                f"label {label!r} (`broker reconcile`, the Vast.ai console)")
        try:
            found = self._find_by_label(label, req.offer)
        except ProviderError as exc:
            raise AmbiguousCreate(PROVIDER, call, f"{why}; whether an instance was rented is unknown (the instance "
                                  f"list to check it failed: {exc.message})", hint=hint) from None
        if found is None:
            raise AmbiguousCreate(PROVIDER, call, f"{why}; no instance labelled {label!r} is listed yet, but one "
                                  "may still appear", hint=hint)
        del self._unverified[req.client_token]
        return self._check_disk(str(found["id"]), req, call, found)

    def _find_by_label(self, label: str, offer: Offer | None = None) -> dict[str, Any] | None:
        """The listed instance carrying ``label`` (on the offer's machine when known); raises ProviderError when
        the list cannot be read (never "not found" for an unreadable list)."""
        machine = offer.attrs.get("machine_id") if offer else None
        for row in self._list_rows():
            if row.get("label") == label and (machine is None or row.get("machine_id") in (None, machine)):
                return row
        return None

    def _check_disk(self, provider_id: str, req: NodeRequest, call: str, row: dict[str, Any] | None = None) -> str:
        """An instance with less disk than asked is destroyed and OfferGone raised (the next
        offer is tried).  When its disk is not known yet, :meth:`describe_instance` checks it later."""
        self._disk_wanted[provider_id] = float(req.disk_gib)
        if row is None or row.get("disk_space") is None:
            try:
                row = self._show(provider_id) or row
            except ProviderError:
                pass
        if row is None or not disk_short(row.get("disk_space"), req.disk_gib):
            return provider_id
        have = float(row["disk_space"])
        try:
            gone = self.terminate("instance", provider_id)
        except ProviderError:
            gone = False
        if not gone:  # still there: hand the id back; describe reports it failed, so the core tears it down
            return provider_id
        self._disk_wanted.pop(provider_id, None)
        raise OfferGone(PROVIDER, call, f"instance {provider_id} from offer {req.offer.offer_id} came with "
                        f"{have:g} GB of disk, the recipe asks {req.disk_gib:g} GiB; it was destroyed",
                        hint="broker moves on to the next offer")

    def prepare_access(self, provider_id: str, public_key: str) -> bool:
        """Attach the run's SSH public key to the instance through Vast's key API (``POST
        /api/v0/instances/{id}/ssh/`` with ``{"ssh_key": ...}``), beside the ``onstart`` copy.

        Idempotent: an answer saying the key is already there counts as done.  Call it after create (again after
        an SSH auth failure).  Returns True.  Raises AuthError, TransientError (5xx / 429 after retries: call
        again), ProviderError (refused, or an answer broker cannot read).
        """
        key = public_key.strip()
        call = f"attach the run's SSH key to instance {provider_id} (POST /api/v0/instances/{provider_id}/ssh/)"
        if not key:
            raise BadInput(f"vast: {call}: the public key is empty")
        r = self.api.request("POST", self._url("/api/v0/instances/{}/ssh/", "instance", provider_id, call), call,
                             json_body={"ssh_key": key},
                             accept={400, 409})
        already = "already" in body_message(r).lower() or "exists" in body_message(r).lower()
        if r.status_code in (400, 409):
            if already:
                return True
            raise self.api.error_for(r, call)
        data = self.api.json(r, call)
        expect(data, call, '{"success": true, ...}', isinstance(data, dict) and "success" in data)
        if data.get("success") is False and not already:
            raise ProviderError(PROVIDER, call, f"Vast.ai refused: {self.api.scrub(body_message(r))}",
                                hint="check that the instance exists (`broker status`) and retry")
        return True

    def _show(self, provider_id: str) -> dict[str, Any] | None:
        call = f"describe instance {provider_id} (GET /api/v0/instances/{provider_id}/)"
        r = self.api.request("GET", self._url("/api/v0/instances/{}/", "instance", provider_id, call), call,
                             params={"owner": "me"}, accept={404})
        if r.status_code == 404:
            return None
        return show_row(self.api.json(r, call), provider_id, call)

    def describe_instance(self, provider_id: str, *, region: str | None = None) -> InstanceInfo:
        """``GET /api/v0/instances/{id}/?owner=me`` mapped to InstanceInfo.

        ``actual_status``: null/created/loading/rebooting → pending; running → running; exited/offline/unknown/
        frozen → failed (they never become running: destroy it); stopped → stopped.  Gone (null or 404) →
        terminated.  SSH: ``ports["22/tcp"][0]["HostPort"]`` on ``public_ipaddr`` (direct) else
        ``ssh_host:ssh_port`` (proxy).  ``private_ip`` is 127.0.0.1: the simulated nodes share the one host.
        An instance created here with less ``disk_space`` than asked is ``failed``.  Raises ProviderError when
        the answer's shape is unknown (never "terminated" for an unreadable answer).
        """
        from broker.core.records import InstanceInfo

        row = self._show(provider_id)
        if not row:
            return InstanceInfo(provider_id=provider_id, state="terminated", raw_state="not found")
        info = instance_info(provider_id, row)
        want = self._disk_wanted.get(str(provider_id))
        if want is not None and disk_short(row.get("disk_space"), want):
            info = info.model_copy(update={"state": "failed", "message": (
                f"disk {float(row['disk_space']):g} GB is less than the {want:g} GiB asked; destroy it and use "
                "another offer")})
        return info

    def preemption(self, resource_id: str) -> str | None:
        """Whether Vast.ai took interruptible instance ``resource_id`` back (outbid): its row is a bid rental
        (``is_bid``) and its container was stopped under it: ``actual_status`` ``stopped`` or ``exited`` (or
        ``cur_state`` ``stopped``) while broker never stops an instance (it destroys them), or every state field
        reads ``stopped`` (dstack's outbid test, interruptible.md 1.7).  Returns the reason with Vast's own fields,
        None for an on-demand row, a running or pending one, or one that is gone (destroyed: not a preemption).
        Raises ProviderError / TransientError / AuthError when the instance cannot be read."""
        row = self._show(self.require_id("instance", str(resource_id), f"preemption check of {resource_id}"))
        if not row or row.get("is_bid") is not True:
            return None
        actual, cur = row.get("actual_status"), row.get("cur_state")
        intended, nxt = row.get("intended_status"), row.get("next_state")
        if actual in ("stopped", "exited") or cur == "stopped":
            msg = str(row.get("status_msg") or "").strip()
            return (f"outbid: Vast.ai shows actual_status {actual}, cur_state {cur}, intended_status {intended}, "
                    f"next_state {nxt} on bid instance {resource_id}" + (f" ({self.api.scrub(msg)[:200]})" if msg
                                                                         else ""))
        return None

    def terminate(self, kind: str, provider_id: str, *, region: str | None = None,
                  attrs: dict[str, Any] | None = None) -> bool:
        """Destroy an instance (``DELETE /api/v0/instances/{id}/``; stop would keep billing storage).

        Retried on 5xx / 429 / 409 with backoff for at most ``delete_timeout_s`` (``delete_attempts`` tries).
        Idempotent: 404 / "not found" counts as gone.  Returns True when a describe confirms it gone, False when
        the destroy was accepted but the instance is still listed (call again / poll describe).  Raises
        NotSupported for kinds other than ``instance`` (Vast has no other billable objects here), TransientError
        when the retries run out, ProviderError when Vast.ai refuses.
        """
        if kind != "instance":
            raise NotSupported(PROVIDER, f"terminate {kind}", "Vast.ai resources are instances only")
        call = f"destroy instance {provider_id} (DELETE /api/v0/instances/{provider_id}/)"
        r = self.api.request("DELETE", self._url("/api/v0/instances/{}/", "instance", provider_id, call), call,
                             json_body={},
                             retry_on=DELETE_RETRY_STATUSES, attempts=self.delete_attempts,
                             max_s=self.delete_timeout_s, accept={400, 404, 410})
        if r.status_code in (400, 410) and not says_gone(r):
            raise self.api.error_for(r, call)
        if r.is_success:
            try:
                data = r.json()
            except ValueError:
                data = {}
            if isinstance(data, dict) and data.get("success") is False and not says_gone(r):
                raise ProviderError(PROVIDER, call, f"Vast.ai refused: {self.api.scrub(body_message(r))}",
                                    hint="retry `broker down`; the instance stays listed until it is gone")
        return self.describe_instance(provider_id).state == "terminated"

    def _set_state(self, provider_id: str, state: str) -> None:
        verb = "stop" if state == "stopped" else "start"
        call = f"{verb} instance {provider_id} (PUT /api/v0/instances/{provider_id}/ state={state})"
        r = self.api.request("PUT", self._url("/api/v0/instances/{}/", "instance", provider_id, call), call,
                             json_body={"state": state}, accept={404})
        if r.status_code == 404 or says_gone(r):
            raise ProviderError(PROVIDER, call, f"instance {provider_id} no longer exists",
                                hint="`broker status` shows the run; `broker down RUN` records it gone")
        try:
            data = r.json()
        except ValueError:
            data = {}
        if isinstance(data, dict) and data.get("success") is False:
            raise ProviderError(PROVIDER, call, f"Vast.ai refused: {self.api.scrub(body_message(r))}",
                                hint="`broker status` shows the instance; retry, or `broker down RUN` deletes it")

    def stop(self, provider_id: str, *, region: str | None = None) -> None:
        """``PUT /api/v0/instances/{id}/`` ``{"state": "stopped"}``: the container stops, the disk stays and keeps
        billing ``storage_cost`` (see :meth:`stopped_rate`).  Raises ProviderError (refused / gone),
        TransientError."""
        self._set_state(provider_id, "stopped")

    def start(self, provider_id: str, *, region: str | None = None) -> None:
        """``PUT /api/v0/instances/{id}/`` ``{"state": "running"}``.  The host's ports (SSH included) may differ
        afterwards: describe again.  Raises ProviderError (refused, e.g. the host's GPUs were rented meanwhile),
        TransientError."""
        self._set_state(provider_id, "running")

    def deadman_rearm_script(self, deadline: datetime, grace_seconds: float, *,
                             attrs: dict[str, Any] | None = None) -> str | None:
        """The onstart's dead-man switch again, for the new deadline (:func:`broker.providers.vast.boot.rearm_script`
        in ``node_dir``): a started container runs its original onstart, whose timer holds the first deadline."""
        from broker.providers.vast.boot import rearm_script

        return rearm_script(deadline, grace_seconds, self.api.url, state_dir=self.node_dir)

    def stopped_rate(self, provider_id: str, *, region: str | None = None,
                     attrs: dict[str, Any] | None = None) -> tuple[float, str]:
        """The instance row's ``storage_cost`` ($/GB/month) x ``disk_space`` (GB) / 720 h (a 30-day month: the
        higher hourly figure).  Falls back to ``attrs["disk_gib"]`` and Vast's default $0.10/GB/month when the
        row lacks them.  Raises ProviderError when the instance is gone."""
        row = self._show(provider_id)
        if not row:
            raise ProviderError(PROVIDER, f"describe instance {provider_id}", "the instance no longer exists",
                                hint="`broker down RUN` records it gone")
        per_gb = row.get("storage_cost")
        gb = row.get("disk_space") or (attrs or {}).get("disk_gib")
        basis = "instance row"
        if not isinstance(per_gb, (int, float)):
            per_gb, basis = 0.10, "Vast's default storage price"
        if not isinstance(gb, (int, float)):
            gb, basis = 0.0, basis + "; disk size unknown"
        rate = float(per_gb) * float(gb) / 720.0
        return rate, f"storage {usd(float(per_gb), up_to=4)}/GB/month x {float(gb):g} GB ({basis})"

    def _list_rows(self) -> list[dict[str, Any]]:
        """Every instance of the account: v1 list paginated by ``next_token``; v0 list when v1 is absent.  Raises
        ProviderError for an answer of unknown shape (fail closed)."""
        import json

        rows: list[dict[str, Any]] = []
        params: dict[str, Any] = {"select_filters": json.dumps({}),
                                  "order_by": json.dumps([{"col": "id", "dir": "asc"}]), "limit": json.dumps(25)}
        seen: set[str] = set()
        for _ in range(10_000):
            r = self.api.request("GET", "/api/v1/instances/", LIST_V1, params=params,
                                 accept=set() if rows else {404, 405})
            if r.status_code in (404, 405):
                r0 = self.api.request("GET", "/api/v0/instances/", LIST_V0, params={"owner": "me"})
                return list_page(self.api.json(r0, LIST_V0), LIST_V0)[0]
            page, token = list_page(self.api.json(r, LIST_V1), LIST_V1)
            rows.extend(page)
            if not token:
                return rows
            tok = token if isinstance(token, str) else json.dumps(token)
            expect(token, LIST_V1, "a new next_token", tok not in seen)
            seen.add(tok)
            params["after_token"] = tok
        expect(None, LIST_V1, "an end of the list within 10000 pages", False)
        return rows  # pragma: no cover

    def list_tagged(self, run_id: str | None = None) -> list[TaggedResource]:
        """Instances whose label starts with ``broker-run:`` (all runs, or ``run_id``'s), with the installation
        id and client token their labels carry (None on labels written before those existed).  ``name`` is
        rebuilt as ``broker-<run_id>-n<i>`` (the ledger's node name).

        Without a configured key nothing can be listed and [] is returned (reconcile / the watchdog loop over
        every provider); a rejected key raises AuthError; an unreadable list raises ProviderError.
        """
        from broker.core.records import TaggedResource

        if not self.api.key():
            return []
        out = []
        for row in self._list_rows():
            lab = read_label(row.get("label"))
            if lab is None:
                continue
            rid, idx = lab.run_id, lab.node_index
            if run_id is not None and rid != run_id and not (len(row["label"]) == LABEL_MAX
                                                             and run_id.startswith(rid)):
                continue
            rid = run_id if run_id is not None else rid  # a cut label still belongs to the run asked for
            expect(row.get("id"), LIST_V1, "an integer instance id", self.valid_id("instance", str(row.get("id"))))
            start = row.get("start_date")
            out.append(TaggedResource(
                provider=PROVIDER, kind="instance", provider_id=str(row.get("id")), run_id=rid,
                region=row.get("geolocation"), state=row.get("actual_status") or row.get("cur_state"),
                created_at=datetime.fromtimestamp(float(start), timezone.utc) if isinstance(start, (int, float))
                else None,
                **reported_rate(row),
                name=f"broker-{rid}-n{idx}" if idx is not None else row.get("label"),
                installation_id=lab.installation_id, client_token=lab.client_token))
        return out

