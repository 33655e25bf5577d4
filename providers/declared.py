"""What each provider can do, and why not: one :class:`~broker.core.capabilities.Declaration` per provider.

Read by the registry (:mod:`broker.providers`: every provider list the core needs) and by each adapter class
(``caps = <NAME>``), so a capability is written here once.  Imports nothing but
:mod:`broker.core.capabilities` (no adapter, no SDK): ``broker --help`` and ``broker plan`` read it for free.
A group left out has its defaults (documented in :mod:`broker.core.capabilities`: what a provider without the
feature does).  Where a feature is absent, ``unsupported`` says why in words a user can act on: refusals
(``broker stop``, ``broker quota``, ``broker slurm up``, a hybrid plan) show it.
"""

from __future__ import annotations

from broker.core.capabilities import (Access, Deadman, Declaration, Hybrid, Preemption, Prices, Quotas, Renting,
                                      Timing)

_NOT_RENTED = "nothing is rented there: no price, no limit, nothing a provider can take back"

LOCAL = Declaration(
    name="local", adapter="broker.providers.local:LocalProvider",
    topologies=("local",),
    renting=Renting(planned_by_default=True, local_exec=True),  # the nodes are processes on this machine
    timing=Timing(setup_allowance_s=0),  # nothing is billed
    unsupported={
        "multi-node": "the local provider is this machine: its nodes share one host (netns emulates several hosts; "
                      "a cloud rents them)",
        "hybrid": "this machine is node 0 of a hybrid run; the other nodes come from a cloud (oci, aws, gcp)",
        "stop": "its nodes are processes on this machine",
        "slurm-nodes": "slurm up builds its cluster on netns or cloud nodes, not on this machine's processes",
        "quota": _NOT_RENTED, "interruptible": _NOT_RENTED, "live-prices": _NOT_RENTED,
        "node-switch": "nothing is rented: the job's processes end with it",
    })

VAST = Declaration(
    name="vast", adapter="broker.providers.vast:VastProvider",
    topologies=("simulated",),  # hosts sit behind separate NATs; no /dev/net/tun
    renting=Renting(rents=True, planned_by_default=True,
                    stoppable=True),  # PUT /instances/{id}/ {"state": "stopped"|"running"}; storage bills while stopped
    access=Access(credentials_hint="VAST_API_KEY",
                  credential_files=(),  # the key is a value (VAST_API_KEY), its files have names staging always skips
                  env_vars=("VAST_API_KEY", "VAST_API_URL")),
    # docker image pull on the host; containers start sshd from onstart, well before the job's image work is done
    timing=Timing(setup_allowance_s=600, ssh_ready_timeout_s=180.0),
    deadman=Deadman(node_switch="self-destroy via the Vast API at {grace}"),
    prices=Prices(snapshot="vast.csv", native_query=True,  # --vast-query
                  live_offer_search=True),  # live_offers()
    preemption=Preemption(interruptible=True, interruptible_bid=True, preemptions_per_hour=0.1),
    unsupported={
        "multi-node": "Vast.ai hosts sit behind separate NATs and share no private network, so the nodes of one job "
                      "cannot reach each other's ports: rent one host with several GPUs (topology simulated)",
        "hybrid": "hybrid needs a VM with /dev/net/tun for WireGuard/Tailscale; vast containers have none",
        "slurm-nodes": "Slurm's daemons need root, systemd-free hosts and one private network between the nodes; "
                       "Vast.ai gives containers behind separate NATs",
        "quota": "Vast.ai has no service limits: your account's credit is the limit",
    })

OCI = Declaration(
    name="oci", adapter="broker.providers.oci:OCIProvider",
    topologies=("simulated", "multi-node", "hybrid"),
    renting=Renting(rents=True, planned_by_default=True,
                    stoppable=True,  # InstanceAction STOP / START; boot volume bills (and most GPU shapes keep billing)
                    slurm_nodes=True),
    access=Access(credentials_hint="an OCI config (OCI_CONFIG_FILE, OCI_COMPARTMENT_ID)",
                  credential_files=("OCI_CONFIG_FILE",),
                  env_vars=("OCI_CONFIG_FILE", "OCI_PROFILE", "OCI_COMPARTMENT_ID", "OCI_REGION",
                            "OCI_SERVICE_ENDPOINT", "OCI_IMAGE_ID", "OCI_SUBNET_ID", "OCI_INSTANCE_PRINCIPAL")),
    # GPU VMs and bare-metal shapes boot slowly; after RUNNING, sshd on an Oracle Linux GPU image accepts logins
    # 30-60 s later and cloud-init (firewall, OCI CLI install for the dead-man switch) runs on
    timing=Timing(setup_allowance_s=900, ssh_ready_timeout_s=600.0),
    quotas=Quotas(quota=True, quota_unit="gpus", quota_scope="AD"),  # gpu-<model>-count limits
    # an in-OS shutdown does not stop OCI GPU billing: only an API terminate with an instance principal does
    deadman=Deadman(node_switch="self-terminate with an instance principal at {grace}",
                    node_switch_requires="instance_principal"),
    prices=Prices(snapshot="oci.csv", live_price_list="public"),  # public_price_offers()
    preemption=Preemption(interruptible=True, preemptions_per_hour=0.05),
    hybrid=Hybrid(ingress_rule_format="IngressSecurityRule"),
)

AWS = Declaration(
    name="aws", adapter="broker.providers.aws:AWSProvider",
    topologies=("simulated", "multi-node", "hybrid"),
    renting=Renting(rents=True, planned_by_default=True,
                    stoppable=True,  # StopInstances / StartInstances; EBS volumes bill while stopped
                    slurm_nodes=True),
    access=Access(credentials_hint="AWS credentials (AWS_PROFILE or AWS_ACCESS_KEY_ID)",
                  credential_files=("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_WEB_IDENTITY_TOKEN_FILE"),
                  env_vars=("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                            "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ENDPOINT_URL", "AWS_AMI_ID", "AWS_SUBNET_ID",
                            "AWS_SSH_USER")),
    # after ``running``, sshd on the Deep Learning AMI accepts logins 30-60 s later and user data runs on
    timing=Timing(setup_allowance_s=600, ssh_ready_timeout_s=420.0),
    quotas=Quotas(quota=True, quota_unit="vcpus",  # Running On-Demand G and VT / P instances count vCPUs
                  quota_scope="region"),
    deadman=Deadman(node_switch="scheduled shutdown at {grace}, InstanceInitiatedShutdownBehavior=terminate"),
    prices=Prices(snapshot="aws.csv", live_price_list="api",  # live_prices(), the Pricing API
                  live_prices_source="AWS Pricing API get_products (on-demand Linux, shared)"),
    preemption=Preemption(interruptible=True, interruptible_bid=True, preemptions_per_hour=0.02),
    hybrid=Hybrid(ingress_rule_format="IpPermissions"),
)

GCP = Declaration(
    name="gcp", adapter="broker.providers.gcp:GCPProvider",
    topologies=("simulated", "multi-node", "hybrid"),
    renting=Renting(rents=True, planned_by_default=True, slurm_nodes=True),
    access=Access(credentials_hint="Google ADC (gcloud auth application-default login or "
                                   "GOOGLE_APPLICATION_CREDENTIALS) and GOOGLE_CLOUD_PROJECT",
                  credential_files=("GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG"),
                  env_vars=("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "GCLOUD_PROJECT", "GCP_REGION",
                            "GCP_ZONES", "GCP_IMAGE", "GCP_NETWORK", "GCP_SSH_USER", "GCP_SSH_SOURCE_RANGES",
                            "GCP_QUOTA_CONTACT_EMAIL")),
    timing=Timing(setup_allowance_s=900,  # DLVM first boot installs the NVIDIA driver
                  ssh_ready_timeout_s=600.0),
    quotas=Quotas(quota=True, quota_unit="gpus",  # NVIDIA_<MODEL>_GPUS, GPUS_ALL_REGIONS (CPU metrics: vcpus beside)
                  quota_scope="region"),
    deadman=Deadman(node_switch="self-delete with the VM's service account at {grace} (else power off)"),
    prices=Prices(snapshot="gcp.csv", live_price_list="api",
                  live_prices_source="GPU prices from the Cloud Billing Catalog API (host part from the snapshot)"),
    # Spot VMs (docs/reference/gcp-fixtures.md "Spot VMs"); Google publishes no preemption rate: broker assumes 0.05
    preemption=Preemption(interruptible=True, preemptions_per_hour=0.05),
    unsupported={
        "stop": "Compute Engine can stop a VM, but broker stop/start is not built for GCP yet: `broker down` ends "
                "the machines",
    })

NETNS = Declaration(
    name="netns", adapter="broker.providers.netns:NetnsProvider",
    topologies=("multi-node", "hybrid"),  # hybrid: two NAT'd sites emulated here
    renting=Renting(slurm_nodes=True),  # the nodes are reached over SSH inside their namespaces
    timing=Timing(setup_allowance_s=0),
    unsupported={
        "stop": "its nodes are network namespaces here",
        "quota": _NOT_RENTED, "interruptible": _NOT_RENTED, "live-prices": _NOT_RENTED,
        "node-switch": "nothing is rented: `broker down` removes the namespaces",
    })

SLURM = Declaration(
    name="slurm", adapter="broker.providers.slurm:SlurmProvider",
    topologies=("slurm",),
    renting=Renting(),  # the cluster's owner bills, not broker
    access=Access(env_vars=("BROKER_SLURM_HOST", "BROKER_SLURM_PYTHON", "BROKER_SLURM_PARTITION",
                            "BROKER_SLURM_ACCOUNT")),
    timing=Timing(setup_allowance_s=0),
    unsupported={
        "multi-node": "a Slurm cluster's nodes are allocated by its scheduler: use topology slurm",
        "hybrid": "a Slurm job runs inside the cluster; its nodes cannot join a tunnel to this machine",
        "stop": "Slurm allocations cannot be suspended by broker",
        "slurm-nodes": "it is a Slurm cluster already: submit to it (`broker run --provider slurm`)",
        "quota": "the cluster's own limits (partitions, accounts) apply: `sinfo` / `sacctmgr` show them",
        "interruptible": "a Slurm cluster does not rent interruptible capacity, and broker does not requeue its jobs",
        "node-switch": "the scheduler ends the job at its time limit",
        "live-prices": "the cluster's owner bills, not broker",
    })

FAKE = Declaration(
    name="fake", adapter="broker.providers.fake:FakeProvider",
    topologies=("simulated", "multi-node"),
    # rented through the same ledger-first provisioning as a cloud, but nothing is billed; its "instances" are this
    # machine (local processes); stoppable: the state file keeps a stopped instance and bills its disk rate
    renting=Renting(rents=True, pretend=True, local_exec=True, stoppable=True),
    access=Access(env_vars=("BROKER_FAKE_STATE", "BROKER_FAKE_PREEMPT", "BROKER_FAKE_USD_PER_HOUR",
                            "BROKER_FAKE_READY_S", "BROKER_FAKE_STOPPED_USD_PER_HOUR")),
    # its state file is consistent at once (real APIs lag) and read locally: a node it took back is noticed in 2 s
    timing=Timing(setup_allowance_s=0, create_settle_s=0.0, node_check_s=2.0),
    # pretend: its offers carry a half-price interruptible figure, and a run may be "preempted"
    preemption=Preemption(interruptible=True, preemptions_per_hour=0.1),
    unsupported={
        "hybrid": "the pretend cloud's nodes are processes here, with no tunnel device of their own",
        "slurm-nodes": "its nodes are processes on this machine (use netns for an emulated Slurm cluster)",
    })

#: name -> its declaration, in registry order (the order of every derived list)
DECLARED: dict[str, Declaration] = {d.name: d for d in (LOCAL, VAST, OCI, AWS, GCP, NETNS, SLURM, FAKE)}
