#!/usr/bin/env bash
# Prepare what scripts/device_netns_bench.sh and scripts/device_hybrid.sh need on a bare GPU machine with no package
# registry: this machine's sshd, ssh-keygen, ip, wg, wireguard-go and iptables (nft) with their non-glibc libraries
# and iptables' extensions (build/devtools, git-ignored), and broker itself plus its Python dependencies as cp312
# wheels (.whl, git-ignored).  Carry both: run(carry=["build/devtools", ".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
D=build/devtools
rm -rf "$D"; mkdir -p "$D/bin" "$D/libexec" "$D/lib"
bins=(/usr/sbin/sshd "$(command -v ssh-keygen)" "$(readlink -f "$(command -v ip)")" "$(command -v wg)"
      "$(command -v wireguard-go)" "$(readlink -f "$(command -v iptables)")")
cp "${bins[@]}" "$D/libexec/"
for b in "${bins[@]}"; do ldd "$b" | awk '/=>/{print $3}'; done | sort -u \
  | grep -v -E "/(libc|libm|libresolv|libpthread|libdl|librt)\.so" | xargs -I{} cp -L {} "$D/lib/"
for t in sshd ssh-keygen ip wg wireguard-go; do
  printf '#!/bin/sh\nD=$(dirname "$(readlink -f "$0")")/..\nLD_LIBRARY_PATH="$D/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$D/libexec/%s" "$@"\n' "$t" > "$D/bin/$t"
  chmod +x "$D/bin/$t"
done
# iptables is a multi-call binary (xtables-nft-multi iptables ...) whose matches/targets are shared objects
cp -r /usr/lib/x86_64-linux-gnu/xtables "$D/xtables"
printf '#!/bin/sh\nD=$(dirname "$(readlink -f "$0")")/..\nXTABLES_LIBDIR="$D/xtables" LD_LIBRARY_PATH="$D/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$D/libexec/%s" iptables "$@"\n' "$(basename "${bins[5]}")" > "$D/bin/iptables"
chmod +x "$D/bin/iptables"
PY=${PYTHON:-python3}
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  pydantic==2.14.4 pydantic_core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0 typing-inspection==0.4.5 \
  python-dotenv==1.2.4 asyncssh==2.24.1 cryptography==49.0.0 cffi==2.1.1 pycparser==3.12 platformdirs==4.14.8 \
  tenacity==9.2.1 typing_extensions==4.16.0 typer==0.28.0 astroid==4.3.4
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl .  # broker itself (broker.providers is a package-dir)
du -sh "$D" .whl
