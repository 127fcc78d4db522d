"""A Python peer process for the cross-process tests (_common.py describes
the protocol); it needs NumPy, not torch.

    python3 peer.py serve TRANSPORTS        # prints ADDR; stdin "check" checks back/*
    python3 peer.py client ADDR TRANSPORTS  # prints OK transport=...
    python3 peer.py bench-serve TRANSPORTS SIZE
    python3 peer.py serve-rows TRANSPORTS   # the tensors of the rows tests (_common.rows_setup)
    python3 peer.py write-rows ADDR TRANSPORTS ROW,ROW,... ROUNDS  # send_rows of written_row(r, round)
"""

import gc
import sys

import tensorrpc
from _common import client_checks, rows_setup, serve_check, serve_setup, write_rows


def serve(transports, setup):
    srv = tensorrpc.Server(transports=transports.split(","))
    setup(srv)
    print("ADDR " + srv.address, flush=True)
    failed = None
    if sys.stdin.readline().strip() == "check":
        try:
            print("BACK ok %d" % serve_check(srv), flush=True)
        except Exception as e:
            failed = e
    sys.stdin.read()
    gc.collect()
    allocs = srv.close()
    print("POOL allocs=%d live=%d" % (allocs, tensorrpc.live_tensors()), flush=True)
    if failed is not None:
        raise failed
    return 0 if allocs == 0 and tensorrpc.live_tensors() == 0 else 1


def bench_setup(size):
    def setup(srv):
        import numpy as np

        with srv.empty(size, "uint8", output="tensor") as t:
            # Pseudo-random bytes, the same every run, which no codec
            # shrinks, as gopeer's bench tensor (benchBytes): the tcp
            # plane's auto compression samples them and sends them as
            # they are. Writing them touches every page.
            t.numpy()[:] = np.frombuffer(np.random.default_rng(1).bytes(size), np.uint8)
            srv.publish("bench", t)  # a pool tensor: no copy
    return setup


def main(argv):
    mode = argv[1]
    if mode == "serve":
        return serve(argv[2], serve_setup)
    if mode == "serve-rows":
        return serve(argv[2], rows_setup)
    if mode == "write-rows":
        with tensorrpc.Client(argv[2], transports=argv[3].split(",")) as c:
            write_rows(c, [int(r) for r in argv[4].split(",")], int(argv[5]))
            transport = c.transport
        print("OK transport=" + transport, flush=True)
        return 0
    if mode == "bench-serve":
        return serve(argv[2], bench_setup(int(argv[3])))
    if mode == "client":
        with tensorrpc.Client(argv[2], transports=argv[3].split(",")) as c:
            client_checks(c)
            transport = c.transport
        gc.collect()
        if tensorrpc.live_tensors():
            print("live tensors after close: %d" % tensorrpc.live_tensors(), file=sys.stderr)
            return 1
        print("OK transport=" + transport, flush=True)
        return 0
    print("unknown mode " + mode, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
