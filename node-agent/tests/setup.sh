#!/usr/bin/env bash
# Installs what the node-agent integration tests and benchmark need on a Debian
# machine, and prints the kernel release whose headers they build modules against.
# Idempotent: apt runs only when something is missing.
#   docker-registry  the real OCI registry the tests push to and pull from
#   kmod             modprobe, depmod, modinfo
#   gcc make         building the sample modules
#   openssl          the registry's self-signed TLS certificate
#   linux-headers-*  Kbuild for one kernel (linux-headers-amd64: the newest)
set -euo pipefail

packages=(docker-registry kmod gcc make openssl)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

newest_headers() {
    ls -d /usr/src/linux-headers-*-amd64 2>/dev/null \
        | sed -n 's|^/usr/src/linux-headers-\([0-9.]*-[0-9]*-amd64\)$|\1|p' \
        | sort -V | tail -n 1
}
kernel="${KMM_TEST_KERNEL:-$(newest_headers)}"
if [ -n "$kernel" ] && [ ! -f "/usr/src/linux-headers-$kernel/Makefile" ]; then
    missing+=("linux-headers-$kernel")
elif [ -z "$kernel" ]; then
    missing+=(linux-headers-amd64)
fi

if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "missing Debian packages: ${missing[*]} (install them as root)" >&2
        exit 1
    fi
    echo "installing: ${missing[*]}" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
    kernel="${KMM_TEST_KERNEL:-$(newest_headers)}"
fi
if [ -z "$kernel" ] || [ ! -f "/usr/src/linux-headers-$kernel/Makefile" ]; then
    echo "no usable linux-headers for kernel ${kernel:-<none>}" >&2
    exit 1
fi
echo "$kernel"
