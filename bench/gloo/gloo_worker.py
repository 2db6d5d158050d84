"""One long-lived torch.distributed Gloo rank, driven by the Go package bench/gloo.

Usage: gloo_worker.py RANK WORLD MASTER_ADDR MASTER_PORT [THREADS [TIMEOUT_SECONDS [IFNAME]]]

Protocol: every reply is one JSON line on the original stdout (fd 1 is redirected to stderr so
that nothing torch or Gloo prints can corrupt it). Commands, one per line on stdin:

  allreduce N ITERS  -> {"n": N, "seconds": [...]}  one all_reduce time per iteration
  check N            -> {"ok": bool, "n": N, "want": x, "bad": k, "first_bad": v}
  quit (or EOF)      -> exits with status 0

After init_process_group returns (every rank has joined) the rank prints
{"ready": true, "rank": R, "world": W, "torch": "..."}. A failed command replies {"error": "..."};
a failure before ready prints {"error": "..."} and exits with status 2.
"""

import json
import os
import sys
import time
import traceback

# The protocol stream is a private duplicate of fd 1; fd 1 itself (and sys.stdout) go to stderr.
_proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr


def reply(obj):
    _proto.write(json.dumps(obj, separators=(",", ":")) + "\n")
    _proto.flush()


def main():
    if len(sys.argv) < 5:
        reply({"error": "usage: RANK WORLD MASTER_ADDR MASTER_PORT [THREADS [TIMEOUT [IFNAME]]]"})
        return 2
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    addr, port = sys.argv[3], int(sys.argv[4])
    threads = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    timeout = float(sys.argv[6]) if len(sys.argv) > 6 else 120.0
    ifname = sys.argv[7] if len(sys.argv) > 7 else "eth0"
    # Without it Gloo resolves the hostname, which inside a namespace means loopback.
    os.environ["GLOO_SOCKET_IFNAME"] = ifname

    try:
        import datetime

        import torch
        import torch.distributed as dist
    except Exception as e:  # noqa: BLE001 - reported to the Go side
        reply({"error": "import torch: %s: %s" % (type(e).__name__, e)})
        return 2
    if not dist.is_available() or not dist.is_gloo_available():
        reply({"error": "torch %s has no Gloo backend" % torch.__version__})
        return 2
    torch.set_num_threads(max(1, threads))
    try:
        dist.init_process_group(
            "gloo",
            init_method="tcp://%s:%d" % (addr, port),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout),
        )
    except Exception as e:  # noqa: BLE001
        reply({"error": "init_process_group: %s: %s" % (type(e).__name__, e)})
        return 2
    reply({"ready": True, "rank": rank, "world": world, "torch": torch.__version__})

    gen = torch.Generator().manual_seed(1234 + rank)
    bufs = {}  # n -> (source, work): allocated once per size

    def buffers(n):
        if n not in bufs:
            bufs.clear()
            src = torch.rand(n, dtype=torch.float32, generator=gen)
            bufs[n] = (src, src.clone())
        return bufs[n]

    while True:
        line = sys.stdin.readline()
        if not line:
            break
        parts = line.split()
        if not parts:
            continue
        cmd = parts[0]
        try:
            if cmd == "quit":
                break
            elif cmd == "allreduce" and len(parts) == 3:
                n, iters = int(parts[1]), int(parts[2])
                if n < 1 or iters < 1:
                    raise ValueError("allreduce wants N >= 1 and ITERS >= 1")
                src, t = buffers(n)
                dist.all_reduce(t)  # warm-up: connections, buffers, caches
                secs = []
                for _ in range(iters):
                    # Fresh inputs each time (untimed) so repeated sums never overflow.
                    t.copy_(src)
                    dist.barrier()
                    t0 = time.perf_counter()
                    dist.all_reduce(t)
                    t1 = time.perf_counter()
                    secs.append(t1 - t0)
                reply({"n": n, "seconds": secs})
            elif cmd == "check" and len(parts) == 2:
                n = int(parts[1])
                if n < 1:
                    raise ValueError("check wants N >= 1")
                t = torch.full((n,), float(rank + 1), dtype=torch.float32)
                dist.all_reduce(t)
                want = world * (world + 1) / 2.0
                bad = int((t != want).sum().item())
                out = {"ok": bad == 0, "n": n, "want": want, "bad": bad}
                if bad:
                    out["first_bad"] = float(t[(t != want).nonzero()[0]].item())
                reply(out)
            else:
                raise ValueError("unknown command %r" % line.strip())
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            reply({"error": "%s: %s: %s" % (cmd, type(e).__name__, e)})
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    _proto.flush()
    # Skip interpreter teardown: Gloo's background threads can make it slow or hang.
    os._exit(code)
