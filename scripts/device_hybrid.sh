#!/usr/bin/env bash
# Proof on a GPU machine (the nvidia-h200-x2 device): the hybrid topology emulated with one GPU per site, NCCL over
# the per-run WireGuard tunnel (`--provider netns --topology hybrid`), the DDP recipe and the all-reduce bench, and
# a blocked UDP port caught by preflight.  Tools missing there (sshd, ip, wg, wireguard-go, iptables) and the
# Python packages (broker itself included) come from scripts/prepare_device_tools.sh: run(carry=["build/devtools",
# ".whl"]).  Logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/broker-hybrid}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONWARNINGS=ignore
export BROKER_HOME=/tmp/broker-home PYTHONUNBUFFERED=1 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET
D=$PWD/build/devtools
# on every node's default PATH too: preflight runs `wg show` over SSH on each node
for t in ip ssh-keygen wg wireguard-go iptables; do command -v $t >/dev/null || ln -sf "$D/bin/$t" /usr/local/bin/$t; done
[ -x /usr/sbin/sshd ] || command -v sshd >/dev/null || export BROKER_SSHD=$D/bin/sshd
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
{
  head -2 /etc/os-release; uname -r; nvidia-smi -L
  for t in ip sshd ssh-keygen wg wireguard-go iptables; do echo "$t: $(command -v $t || echo MISSING)"; done
  echo "BROKER_SSHD=${BROKER_SSHD:-/usr/sbin/sshd}"; ls -la /dev/net/tun 2>&1
  ip link add wgprobe0 type wireguard 2>&1 && echo "kernel wireguard: yes" && ip link del wgprobe0 || echo "kernel wireguard: no"
  iptables -t nat -L -n 2>&1 | head -3
  python3 -c 'import sys,torch,broker;print(sys.executable, torch.__version__, torch.cuda.device_count(), broker.__file__)'
} > "$OUT/env.txt" 2>&1; cat "$OUT/env.txt"
cd recipes
timeout -k 10 300 python3 -m broker run ddp_2node.yaml --provider netns --topology hybrid > "$OUT/hybrid_ddp.log" 2>&1
echo "hybrid ddp rc=$?"
# userspace WireGuard carries tens of MB/s: sizes up to 64 MiB keep the bench within minutes
sed 's/^env:$/env:\n  BENCH_SIZES_MIB: "1,16,64"/' allreduce_bench.yaml > allreduce_tunnel.yaml
timeout -k 10 400 python3 -m broker run allreduce_tunnel.yaml --provider netns --topology hybrid > "$OUT/hybrid_allreduce.log" 2>&1
echo "hybrid allreduce rc=$?"
timeout -k 10 120 python3 -m broker run ddp_2node.yaml --provider netns --topology hybrid --inject udp-blocked --quiet \
  > "$OUT/hybrid_udp_blocked.log" 2>&1; echo "udp-blocked rc=$? (1 expected)"
python3 -m broker netns down --all > /dev/null 2>&1
echo "leftovers: $(ip netns list | wc -l) netns, $(pgrep -c wireguard-go) wireguard-go (zombies included)"
for f in hybrid_ddp hybrid_allreduce hybrid_udp_blocked; do echo "== $f"; grep -E "BENCH|status:|RANK=[01] LOCAL|via NET|NET/Socket : Using|Using network|tunnel up|FAIL|heldout|DDP_OK|error" "$OUT/$f.log" | sort -u | head -14; done
