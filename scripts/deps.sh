#!/usr/bin/env bash
# Installs what xdpagg's make targets need, only what is missing (idempotent).
#   scripts/deps.sh            runtime/test needs: root, Go, iproute2 (debugging), ethtool
#   scripts/deps.sh --clang    also clang/llvm/libbpf-dev/bpftool, to regenerate BPF objects
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
	echo "xdpagg needs root: XDP, BPF maps and network namespaces need CAP_BPF and CAP_NET_ADMIN." >&2
	echo "Run again as root (e.g. sudo make test)." >&2
	exit 1
fi
if ! command -v go >/dev/null 2>&1; then
	if [ -x /usr/local/go/bin/go ]; then
		echo "deps: go is at /usr/local/go/bin but not on PATH; add it: export PATH=\$PATH:/usr/local/go/bin" >&2
	else
		echo "deps: Go 1.26 is required (https://go.dev/dl); not found on PATH" >&2
	fi
	exit 1
fi

want=()
command -v ip >/dev/null 2>&1 || want+=(iproute2)
command -v ethtool >/dev/null 2>&1 || want+=(ethtool)
if [ "${1:-}" = "--clang" ]; then
	command -v clang >/dev/null 2>&1 || want+=(clang)
	command -v llvm-strip >/dev/null 2>&1 || want+=(llvm)
	command -v bpftool >/dev/null 2>&1 || want+=(bpftool)
	[ -e /usr/include/bpf/bpf_helpers.h ] || want+=(libbpf-dev)
fi
if [ ${#want[@]} -gt 0 ]; then
	if ! command -v apt-get >/dev/null 2>&1; then
		echo "deps: missing ${want[*]} and no apt-get here: install them with your package manager" >&2
		exit 1
	fi
	echo "deps: installing ${want[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null
fi
# Modules (from the Go module proxy); a no-op when cached.
go mod download
