"""OCI boot scripts: what cloud-init runs on a node at first boot (host firewall, dead-man switch, idle stop,
the boot-done marker).

The generic pieces (idle watch, job-done path, workroot) come from :mod:`broker.core.nodescripts`; this module adds the
OCI self-terminate (instance-principal signer) and the delivery as cloud-init user data.
"""

from __future__ import annotations

import shlex
from datetime import datetime

#: Name of the marker the boot script writes into the node's workroot when it has finished; the core waits for it
#: (or for ``cloud-init status --wait``) before preflight.
BOOT_DONE = "boot.done"

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
    see :func:`broker.core.nodescripts.idle_watch_launcher` for the files in ``state_dir``)."""
    from broker.core.nodescripts import idle_watch_launcher

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


def boot_done_script(path: str, ssh_user: str) -> str:
    """Shell that writes the boot-done marker ``path`` (``<workroot>/boot.done``) last, owned by ``ssh_user`` so
    the run can write beside it; ``$BROKER_WORKROOT`` overrides the folder (tests)."""
    folder, name = path.rsplit("/", 1)
    u = shlex.quote(ssh_user)
    return f"""# broker: boot finished -> marker the core waits for before preflight
BROKER_WORKROOT="${{BROKER_WORKROOT:-{folder}}}"
mkdir -p "$BROKER_WORKROOT" && date -u +%Y-%m-%dT%H:%M:%SZ > "$BROKER_WORKROOT/{name}"
if id {u} >/dev/null 2>&1; then chown {u}:{u} "$BROKER_WORKROOT" "$BROKER_WORKROOT/{name}" 2>/dev/null || true; fi
"""


def cloud_init(vcn_cidr: str, *, deadline: datetime | None = None, grace_seconds: float = 300.0,
               instance_principal: bool = False, onstart: str | None = None, region: str | None = None,
               endpoint: str | None = None, idle_minutes: float | None = None,
               done_file: str = "/home/opc/broker/job.done", ssh_user: str = "opc") -> str:
    """The node's user-data (a bash script cloud-init runs once at first boot): host firewall opened to
    ``vcn_cidr`` only, then the dead-man switch when ``instance_principal`` and a ``deadline`` are given, the idle
    stop (:func:`idle_cloud_init`, watching ``done_file``) when ``instance_principal`` and ``idle_minutes`` are
    given, then ``onstart``, and last the boot-done marker (:data:`BOOT_DONE` beside ``done_file``, i.e.
    ``<workroot>/boot.done``).  Without an instance principal the node cannot end its own billing: the idle stop is
    then the watchdog's alone."""
    parts = ["#!/bin/bash", firewall_script(vcn_cidr)]  # no `set -eu`: a failing step must not skip the rest
    if instance_principal and deadline is not None:
        parts.append(deadman_cloud_init(deadline, grace_seconds, region=region, endpoint=endpoint))
    if instance_principal and idle_minutes:
        parts.append(idle_cloud_init(idle_minutes, done_file=done_file, region=region, endpoint=endpoint))
    if onstart:
        parts.append("# broker: onstart\n" + onstart.rstrip() + "\n")
    parts.append(boot_done_script(done_file.rsplit("/", 1)[0] + "/" + BOOT_DONE, ssh_user))
    return "\n".join(parts)


def boot_wait_command(workroot: str, *, timeout_s: int = 900) -> str:
    """Shell the core runs on a node (over SSH, after it accepts logins) to wait for the boot script: waits for
    cloud-init to finish where it exists (``cloud-init status --wait``, at most ``timeout_s`` seconds), then
    exits 0 only when the boot-done marker ``<workroot>/boot.done`` exists."""
    marker = shlex.quote(workroot.rstrip("/") + "/" + BOOT_DONE)
    return (f"if command -v cloud-init >/dev/null 2>&1; then timeout {int(timeout_s)} cloud-init status --wait "
            f">/dev/null 2>&1; fi; test -e {marker}")
