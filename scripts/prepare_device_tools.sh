#!/usr/bin/env bash
# Prepare what scripts/device_netns_bench.sh needs on a bare GPU machine with no package registry: this machine's
# sshd, ssh-keygen and ip with their non-glibc libraries (build/devtools, git-ignored) and the broker's Python
# dependencies as cp312 wheels (.whl, git-ignored).  Carry both: run(carry=["build/devtools", ".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
D=build/devtools
rm -rf "$D"; mkdir -p "$D/bin" "$D/libexec" "$D/lib"
bins=(/usr/sbin/sshd "$(command -v ssh-keygen)" "$(readlink -f "$(command -v ip)")")
cp "${bins[@]}" "$D/libexec/"
for b in "${bins[@]}"; do ldd "$b" | awk '/=>/{print $3}'; done | sort -u \
  | grep -v -E "/(libc|libm|libresolv|libpthread|libdl|librt)\.so" | xargs -I{} cp -L {} "$D/lib/"
for t in sshd ssh-keygen ip; do
  printf '#!/bin/sh\nD=$(dirname "$(readlink -f "$0")")/..\nLD_LIBRARY_PATH="$D/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$D/libexec/%s" "$@"\n' "$t" > "$D/bin/$t"
  chmod +x "$D/bin/$t"
done
PY=${PYTHON:-python3}
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  pydantic==2.14.4 pydantic_core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0 typing-inspection==0.4.5 \
  python-dotenv==1.2.4 asyncssh==2.24.1 cryptography==49.0.0 cffi==2.1.1 pycparser==3.12 platformdirs==4.14.8 \
  tenacity==9.2.1 typing_extensions==4.16.0 typer==0.29.2
du -sh "$D" .whl
