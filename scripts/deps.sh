#!/usr/bin/env bash
# Installs what xdpagg's make targets need, only what is missing (idempotent).
#   scripts/deps.sh            runtime/test needs: root, Go, iproute2 (debugging), ethtool
#   scripts/deps.sh --clang    also clang/llvm/libbpf-dev/bpftool, to regenerate BPF objects
#   scripts/deps.sh --bench    also Debian's python3-torch (Gloo baseline, run by /usr/bin/python3)
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
clang=0 bench=0
for a in "$@"; do
	case "$a" in
	--clang) clang=1 ;;
	--bench) bench=1 ;;
	*) echo "deps: unknown flag $a (use --clang, --bench)" >&2; exit 2 ;;
	esac
done
if [ $clang = 1 ]; then
	command -v clang >/dev/null 2>&1 || want+=(clang)
	command -v llvm-strip >/dev/null 2>&1 || want+=(llvm)
	command -v bpftool >/dev/null 2>&1 || want+=(bpftool)
	[ -e /usr/include/bpf/bpf_helpers.h ] || want+=(libbpf-dev)
fi
if [ $bench = 1 ]; then
	/usr/bin/python3 -c 'import torch.distributed as d; assert d.is_gloo_available()' >/dev/null 2>&1 || want+=(python3-torch)
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
