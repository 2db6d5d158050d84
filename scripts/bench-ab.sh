#!/usr/bin/env bash
# Interleaved A/B of two xdpagg bench command lines on this machine:
#   scripts/bench-ab.sh ITERATIONS "CMD_A" "CMD_B"
# runs CMD_A, CMD_B, CMD_A, CMD_B, ... ITERATIONS times each (every command a full `xdpagg bench`
# invocation without --json/--quiet/--out, which are added), and prints per size the medians with
# p10-p90 of each and the paired ratio time(A)/time(B) (the k-th timed allreduce of A's i-th run
# against the k-th of B's i-th run; > 1: B is faster), and the CPU s/GB of each. For a build-time
# change, give two binaries (e.g. one built with GOEXPERIMENT= and one without).
set -euo pipefail
n=$1 a=$2 b=$3
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for i in $(seq 1 "$n"); do
	for v in A B; do
		cmd=$a
		[ "$v" = B ] && cmd=$b
		$cmd --json --quiet --out "$out/run" | python3 -c '
import json, sys
for c in json.load(sys.stdin)["report"]["cells"]:
    for s in c["seconds"]:
        print(sys.argv[1], c["bytes"], s * 1e3, c.get("cpu_s_per_GB", 0))
' "$v" >>"$out/samples"
	done
done
python3 - "$out/samples" <<'PY'
import collections, statistics, sys
t, cpu = collections.defaultdict(list), collections.defaultdict(list)
for line in open(sys.argv[1]):
    v, b, ms, c = line.split()
    t[(int(b), v)].append(float(ms))
    cpu[(int(b), v)].append(float(c))
def q(x, p):
    x = sorted(x)
    return x[min(len(x) - 1, int(p * (len(x) - 1) + 0.5))]
for b in sorted({k[0] for k in t}):
    for v in "AB":
        x = t[(b, v)]
        print("%s %9d bytes: n=%d median %.2f ms (p10 %.2f, p90 %.2f), CPU s/GB %.2f"
              % (v, b, len(x), statistics.median(x), q(x, .1), q(x, .9), statistics.median(cpu[(b, v)])))
    r = [x / y for x, y in zip(t[(b, "A")], t[(b, "B")])]
    print("  paired time(A)/time(B): median %.3f (p10 %.3f, p90 %.3f)" % (statistics.median(r), q(r, .1), q(r, .9)))
PY
