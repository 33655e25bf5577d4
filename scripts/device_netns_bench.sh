#!/usr/bin/env bash
# Measurement on a GPU machine (used on the nvidia-h200-x2 device): all-reduce bandwidth of the same 2-node recipe
# as `local` (simulated nodes on one host) and as `netns` (one GPU per namespace, distinct NCCL_HOSTID, over SSH:
# NCCL must use NET/Socket), plus an injected firewall caught by preflight.  Missing sshd / ip / ssh-keygen and
# Python packages may be supplied as build/devtools (binaries + libs) and .whl (wheels).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/broker-bench}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONWARNINGS=ignore
export BROKER_HOME=/tmp/broker-home PYTHONUNBUFFERED=1
{
  head -2 /etc/os-release; uname -r; nvidia-smi -L
  for t in ip sshd ssh-keygen unshare iptables nvidia-smi; do echo "$t: $(command -v $t || ls /usr/sbin/$t 2>/dev/null || echo MISSING)"; done
  python3 -c 'import sys,torch;print(sys.executable, torch.__version__, torch.cuda.device_count())'
} 2>&1 | tee "$OUT/env.txt"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
D=$PWD/build/devtools
command -v ip >/dev/null || export PATH=$PATH:$D/bin
command -v ssh-keygen >/dev/null || export PATH=$PATH:$D/bin
[ -x /usr/sbin/sshd ] || command -v sshd >/dev/null || export BROKER_SSHD=$D/bin/sshd
echo "ip=$(command -v ip) ssh-keygen=$(command -v ssh-keygen) BROKER_SSHD=${BROKER_SSHD:-/usr/sbin/sshd}" | tee -a "$OUT/env.txt"
python3 -m broker netns up 2 --json > "$OUT/netns_up.json" 2>&1; tail -c 600 "$OUT/netns_up.json"; python3 -m broker netns down --all
timeout -k 10 200 python3 -m broker run recipes/allreduce_bench.yaml --provider local > "$OUT/local.log" 2>&1; echo "local rc=$?"
timeout -k 10 240 python3 -m broker run recipes/allreduce_bench.yaml --provider netns > "$OUT/netns.log" 2>&1; echo "netns rc=$?"
timeout -k 10 120 python3 -m broker run recipes/allreduce_bench.yaml --provider netns --inject firewall --quiet \
  > "$OUT/netns_firewall.log" 2>&1; echo "firewall rc=$? (1 expected)"
python3 -m broker netns down --all
for f in local netns; do echo "== $f"; grep -E "BENCH|status:|RANK=[01] LOCAL|via NET|via P2P|via SHM|NET/Socket : Using|NET/IB|Using network" "$OUT/$f.log" | sort -u | head -20; done
grep -E "status:|tcp 1->0" "$OUT/netns_firewall.log" | head -5
