"""A thin EC2 front for end-to-end tests: an HTTP server on 127.0.0.1 that forwards every EC2 query-protocol request
to a moto server and adds what moto lacks, so the REAL AWS adapter (boto3, ``endpoint_url`` = :attr:`url`) rents
instances that are hosts of a netns cluster (:mod:`broker.providers.netns`) with a real sshd, and EC2 can take a
spot instance back.

What it adds (facts: docs/reference interruptible.md 2.6 and cloud-apis.md C5):

* ``RunInstances`` (forwarded): each launched instance takes the next free netns host.  What cloud-init does on a
  real VM is done here instead of running the user data (it schedules ``shutdown -h``): the ``ssh-*`` key the
  user data appends to ``authorized_keys`` goes into the hosts' ``authorized_keys`` and the boot-done marker is
  written into ``workroot``.  A spot launch (``InstanceMarketOptions.MarketType=spot``) gets a spot request id
  ``sir-...``, as real RunInstances spot instances do (moto gives none).
* ``DescribeInstances`` (forwarded, then rewritten): an instance's ``ipAddress`` / ``privateIpAddress`` are its
  host's address; a spot instance carries its ``spotInstanceRequestId``; one EC2 interrupted reads ``stateReason``
  ``Server.SpotInstanceTermination`` ("Server.SpotInstanceTermination: Spot instance termination") whatever moto
  says (it terminated it for us, which moto records as ``Client.UserInitiatedShutdown``).
* ``DescribeSpotPriceHistory`` (forwarded): ``spotPrice`` rewritten by ``spot_price`` (moto's is a placeholder).
* ``DescribeSpotInstanceRequests`` for those request ids (answered here): ``active`` / ``fulfilled`` while the
  instance runs, ``closed`` / the interruption's code (``instance-terminated-no-capacity`` ...) once EC2 took it,
  ``closed`` / ``instance-terminated-by-user`` once the client terminated it.
* :meth:`EC2SpotFront.interrupt` (test hook): EC2 takes spot instance ``iid`` back: its host is lost (every
  process in its namespace is killed) and moto terminates it; with ``interrupt_on_terminate`` set, EC2 takes every
  spot instance back as the client's own ``TerminateInstances`` for it arrives (a preemption reported during
  teardown).

``terminates`` records the instance ids of every client ``TerminateInstances``; ``calls`` the Action of every
request.  Signatures are not checked (moto does not either).
"""

from __future__ import annotations

import base64
import os
import re
import secrets
import shlex
import threading
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs

from werkzeug import Request, Response
from werkzeug.serving import WSGIRequestHandler, make_server

from tests.support.netns_faults import kill_host

#: the state reason of an instance EC2's Spot service terminated, as DescribeInstances reads it
SPOT_TERMINATION = ("Server.SpotInstanceTermination", "Server.SpotInstanceTermination: Spot instance termination")
_HOP_HEADERS = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}


class _Quiet(WSGIRequestHandler):
    def log_request(self, *args: Any, **kwargs: Any) -> None:
        pass


class EC2SpotFront:
    """The front; use as a context manager.  ``moto_url``: the moto server's base URL; ``hosts``: a netns cluster
    (instances take its hosts in order; a launch with none free is answered ``InsufficientInstanceCapacity``);
    ``workroot``: the nodes' workroot (the provider's ``node_workroot``), where the boot-done marker goes (hosts
    whose ``login_user`` is the AMI's, e.g. ``netns_hosts(n, login_user="ubuntu")``: that user's own
    ``/home/<user>/broker`` on its host instead, owned by it);
    ``spot_price(instance_type)``: the ``spotPrice`` DescribeSpotPriceHistory answers ($/h as text; moto's is a
    placeholder 0.00001), None keeps moto's."""

    def __init__(self, moto_url: str, hosts: Any, workroot: Path, *,
                 spot_price: Callable[[str], str | None] | None = None):
        self.moto_url, self.hosts, self.workroot = moto_url.rstrip("/"), hosts, Path(workroot)
        self.spot_price = spot_price
        self.lock = threading.RLock()
        self.host_of: dict[str, int] = {}
        self.spot_request: dict[str, str] = {}  # instance id -> sir-...
        self.interrupted: dict[str, str] = {}  # instance id -> the spot request status code
        self.user_terminated: set[str] = set()
        self.interrupt_on_terminate = False
        self.terminates: list[str] = []
        self.calls: list[str] = []
        self._free = list(range(hosts.n))
        self._srv = make_server("127.0.0.1", 0, self._app, threaded=True, request_handler=_Quiet)
        self.url = f"http://127.0.0.1:{self._srv.server_port}"
        self._thread = threading.Thread(target=self._srv.serve_forever, daemon=True)

    def __enter__(self) -> "EC2SpotFront":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._srv.shutdown()
        self._srv.server_close()

    # ------------------------------------------------------------------ test side
    def moto(self) -> Any:
        """A boto3 EC2 client straight to moto (not through this front): what is really there."""
        import boto3

        return boto3.client("ec2", region_name="us-east-1", endpoint_url=self.moto_url,
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def live(self) -> list[str]:
        """Instance ids moto holds in any state but ``terminated``."""
        resp = self.moto().describe_instances(Filters=[{"Name": "instance-state-name", "Values": [
            "pending", "running", "shutting-down", "stopping", "stopped"]}])
        return [i["InstanceId"] for r in resp["Reservations"] for i in r["Instances"]]

    def interrupt(self, iid: str, code: str = "instance-terminated-no-capacity") -> None:
        """EC2 takes spot instance ``iid`` back: its host is lost, moto terminates it, and from now on it reads
        ``StateReason`` :data:`SPOT_TERMINATION` and its spot request ``closed`` / ``code``."""
        with self.lock:
            if iid not in self.spot_request:
                raise AssertionError(f"{iid} is not a spot instance of this front")
            self.interrupted[iid] = code
            host = self.host_of.get(iid)
        if host is not None:
            kill_host(self.hosts.ns(host))
        self.moto().terminate_instances(InstanceIds=[iid])

    # ------------------------------------------------------------------ the proxy
    def _app(self, environ: Any, start_response: Any) -> Any:
        req = Request(environ)
        body = req.get_data()
        form = {k: v[0] for k, v in parse_qs(body.decode("utf-8", "replace")).items()}
        action = form.get("Action", "")
        with self.lock:
            self.calls.append(action)
        if action == "DescribeSpotInstanceRequests":
            ids = [v for k, v in form.items() if k.startswith("SpotInstanceRequestId.")]
            mine = {s: i for i, s in self.spot_request.items()}
            if ids and all(s in mine for s in ids):
                return self._spot_requests([mine[s] for s in ids])(environ, start_response)
        if action == "TerminateInstances":
            ids = [v for k, v in form.items() if k.startswith("InstanceId.")]
            with self.lock:
                self.terminates += ids
                now = [i for i in ids if self.interrupt_on_terminate and i in self.spot_request
                       and i not in self.interrupted]
                self.user_terminated.update(i for i in ids if i not in self.interrupted and i not in now)
            for iid in now:  # EC2 takes it back as the client's terminate arrives
                self.interrupt(iid)
        status, headers, content = self._forward(req, body)
        if status == 200 and action == "RunInstances":
            content = self._launched(form, content)
        elif status == 200 and action == "DescribeInstances":
            content = self._rewrite(content)
        elif status == 200 and action == "DescribeSpotPriceHistory" and self.spot_price is not None:
            content = self._prices(content)
        return Response(content, status=status, headers=headers)(environ, start_response)

    def _forward(self, req: Request, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        import requests

        headers = {k: v for k, v in req.headers.items() if k.lower() not in _HOP_HEADERS}
        url = self.moto_url + req.full_path.rstrip("?")
        r = requests.request(req.method, url, data=body, headers=headers, timeout=60)
        out = [(k, v) for k, v in r.headers.items() if k.lower() not in _HOP_HEADERS | {"content-encoding"}]
        return r.status_code, out, r.content

    def _launched(self, form: dict[str, str], content: bytes) -> bytes:
        root = ET.fromstring(content)
        ns = _ns(root)
        spot = form.get("InstanceMarketOptions.MarketType") == "spot"
        script = base64.b64decode(form.get("UserData", "")).decode("utf-8", "replace")
        quoted = re.findall(r'^printf "%s\\n" (.+?) >> "\$BROKER_SSH_HOME', script, re.M)
        keys = [shlex.split(m)[0] for m in quoted]
        hosts: list[int] = []
        for item in root.iter(f"{ns}item"):
            iid = item.findtext(f"{ns}instanceId")
            if not iid or item.find(f"{ns}instanceState") is None:
                continue
            with self.lock:
                if not self._free:
                    raise AssertionError("no netns host left for " + iid)
                self.host_of[iid] = self._free.pop(0)
                hosts.append(self.host_of[iid])
                if spot:
                    self.spot_request[iid] = "sir-" + secrets.token_hex(4)
            with open(self.hosts.root / "ssh" / "authorized_keys", "a") as f:  # cloud-init: the user data's key
                f.writelines(k.strip() + "\n" for k in keys)
        user = getattr(self.hosts, "login_user", "root")
        if user == "root":
            self.workroot.mkdir(parents=True, exist_ok=True)
            (self.workroot / "boot.done").write_text("")  # the user data's last line
        for h in hosts if user != "root" else []:  # the AMI's user: its own workroot in the host's /home/<user>
            home = self.hosts.root / f"node{h}" / "home" / user
            work = home / "broker"
            work.mkdir(parents=True, exist_ok=True)
            (work / "boot.done").write_text("")
            st = home.stat()
            for f in (work, work / "boot.done"):
                os.chown(f, st.st_uid, st.st_gid)
        return content

    def _rewrite(self, content: bytes) -> bytes:
        root = ET.fromstring(content)
        ns = _ns(root)
        ET.register_namespace("", ns.strip("{}"))
        for inst in root.iter(f"{ns}item"):
            iid = inst.findtext(f"{ns}instanceId")
            if not iid or inst.find(f"{ns}instanceState") is None:
                continue
            with self.lock:
                host, sir, code = self.host_of.get(iid), self.spot_request.get(iid), self.interrupted.get(iid)
            if host is not None:
                for tag in ("ipAddress", "privateIpAddress"):
                    el = inst.find(f"{ns}{tag}")
                    if el is None:
                        el = ET.SubElement(inst, f"{ns}{tag}")
                    el.text = self.hosts.ip(host)
            if sir and inst.find(f"{ns}spotInstanceRequestId") is None:
                ET.SubElement(inst, f"{ns}spotInstanceRequestId").text = sir
            if code:
                sr = inst.find(f"{ns}stateReason")
                if sr is None:
                    sr = ET.SubElement(inst, f"{ns}stateReason")
                for child in list(sr):
                    sr.remove(child)
                ET.SubElement(sr, f"{ns}code").text = SPOT_TERMINATION[0]
                ET.SubElement(sr, f"{ns}message").text = SPOT_TERMINATION[1]
        return ET.tostring(root, encoding="utf-8", xml_declaration=True)

    def _prices(self, content: bytes) -> bytes:
        root = ET.fromstring(content)
        ns = _ns(root)
        ET.register_namespace("", ns.strip("{}"))
        for row in root.iter(f"{ns}item"):
            el, it = row.find(f"{ns}spotPrice"), row.findtext(f"{ns}instanceType")
            price = self.spot_price(it) if el is not None and it else None
            if price is not None:
                el.text = price
        return ET.tostring(root, encoding="utf-8", xml_declaration=True)

    def _spot_requests(self, iids: list[str]) -> Response:
        states = {i["InstanceId"]: i["State"]["Name"] for r in self.moto().describe_instances(
            InstanceIds=iids)["Reservations"] for i in r["Instances"]}
        items = []
        for iid in iids:
            with self.lock:
                code = self.interrupted.get(iid)
                if code is None and (iid in self.user_terminated or states.get(iid) == "terminated"):
                    code = "instance-terminated-by-user"
                sir = self.spot_request[iid]
            state = "active" if code is None else "closed"
            items.append(f"<item><spotInstanceRequestId>{sir}</spotInstanceRequestId><state>{state}</state>"
                         f"<status><code>{code or 'fulfilled'}</code><updateTime>2026-12-02T00:00:00.000Z"
                         f"</updateTime><message>{code or 'fulfilled'}</message></status>"
                         f"<instanceId>{iid}</instanceId><type>one-time</type></item>")
        xml = ('<?xml version="1.0" encoding="UTF-8"?>\n<DescribeSpotInstanceRequestsResponse '
               'xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>7b2c3c1e-spot-front</requestId>'
               f"<spotInstanceRequestSet>{''.join(items)}</spotInstanceRequestSet>"
               "</DescribeSpotInstanceRequestsResponse>")
        return Response(xml, status=200, content_type="text/xml")


def _ns(root: ET.Element) -> str:
    return root.tag[:root.tag.index("}") + 1] if root.tag.startswith("{") else ""
