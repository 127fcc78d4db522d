"""The summary of a device-check run (scripts/device-check.sh run).

    python3 scripts/device_check_summary.py STEPDIR OUTDIR [NO_GPU_REASON]

reads what the steps left in STEPDIR (steps.tsv, each step's log and JSON
lines) and writes OUTDIR/summary.md, printed too: the machine, the steps
(status, seconds), the Go tests, then one line per goal of issue 26 and of
DESIGN.md's 16-core column, with measured, ceiling, ratio, target and met
("not measured" and why when its step did not give it), and
OUTDIR/results.jsonl: every step's JSON lines, each with a "step" field.
It never fails on missing or partial output: a run cut short, or one
without a GPU, still gets its summary.
"""

import json
import os
import re
import sys

KiB, MiB = 1 << 10, 1 << 20

# The files of JSON lines each step leaves, in the order results.jsonl
# lists them.
JSONL = (
    ("devbench", "devbench.jsonl"),
    ("bench-cuda", "bench-cuda.jsonl"),
    ("handoffs", "handoffs.jsonl"),
    ("streams", "streams.jsonl"),
    ("tensorbench", "tensorbench.jsonl"),
    ("python-spin", "python-spin50.jsonl"),
    ("python-spin-200us", "python-spin200.jsonl"),
)


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def json_lines(path):
    out = []
    for line in read(path).splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def size_name(n):
    if n >= MiB and n % MiB == 0:
        return "%d MiB" % (n // MiB)
    if n >= KiB and n % KiB == 0:
        return "%d KiB" % (n // KiB)
    return "%d B" % n


class Summary:
    def __init__(self, tmp, nogpu):
        self.tmp, self.nogpu = tmp, nogpu
        self.steps = {}
        for line in read(os.path.join(tmp, "steps.tsv")).splitlines():
            f = (line.split("\t") + [""] * 5)[:5]
            self.steps[f[0]] = {"status": f[1], "rc": f[2], "seconds": f[3], "note": f[4]}
        self.data = {step: json_lines(os.path.join(tmp, name)) for step, name in JSONL}
        self.goals = []

    def why_missing(self, step):
        """Why a goal of step has no measurement."""
        s = self.steps.get(step)
        if s is None:
            return "not measured: step %s did not run" % step
        if s["status"] == "skipped":
            return "not measured: %s skipped (%s)" % (step, s["note"])
        if s["status"] != "ok":
            return "not measured: %s %s (rc %s)" % (step, s["status"], s["rc"])
        return "not measured: %s gave no such result" % step

    def goal(self, step, name, target, ok, measured=None, ceiling=None, ratio=None):
        """Adds a goal's line: measured None means it was not measured, ok
        None that the line has no target (it is shown for its numbers)."""
        if measured is None:
            self.goals.append((name, "—", "—", "—", target, self.why_missing(step)))
            return
        met = "—" if ok is None else "yes" if ok(ratio) else "**no**"
        self.goals.append((name, measured, ceiling, "%.2f" % ratio, target, met))

    def find(self, step, **kw):
        for r in self.data.get(step, []):
            if all(r.get(k) == v for k, v in kw.items()):
                return r
        return None

    # --- issue 26: device tensors

    def device_goals(self):
        at_least = lambda t: (lambda r: r >= t)
        for way in ("htod", "dtoh"):
            g = self.find("devbench", case="pinned-" + way, bytes=256 * MiB)
            t = self.find("bench-cuda", case="torch-pinned-" + way, bytes=256 * MiB)
            name = "gpudirect pinned %s / torch pinned, 256 MiB" % way
            if g and t and not g.get("error") and t["gb_per_s"] > 0:
                self.goal("devbench", name, "≥ 0.8", at_least(0.8), "%.1f GB/s" % g["gb_per_s"],
                          "%.1f GB/s" % t["gb_per_s"], g["gb_per_s"] / t["gb_per_s"])
            else:
                self.goal("devbench" if not g else "bench-cuda", name, "≥ 0.8", None)
        cases = (("fetchtodevice-shm", "staged FetchToDevice shm / min(shm Fetch, pinned copy)", 0.8),
                 ("senddevice-shm", "staged SendDevice shm / min(shm Fetch, pinned copy)", 0.8),
                 ("fetchtodevice-tcp", "staged FetchToDevice tcp / min(tcp Fetch, pinned copy)", 0.8),
                 ("senddevice-tcp", "staged SendDevice tcp / min(tcp Fetch, pinned copy)", 0.8),
                 ("ipc-fetchtodevice", "CUDA IPC FetchToDevice / device-to-device copy", 0.5))
        for case, name, target in cases:
            rs = [r for r in self.data["devbench"] if r.get("case") == case]
            if not rs:
                self.goal("devbench", name, "≥ %.1f" % target, None)
            for r in rs:
                label = "%s, %s" % (name, size_name(r["bytes"]))
                if r.get("error"):
                    self.goals.append((label, "error: " + r["error"][:80], "—", "—", "≥ %.1f" % target, "**no**"))
                    continue
                of = r.get("of_ceiling", 0)
                ceil = "%.1f GB/s (%s)" % (r["gb_per_s"] / of, r.get("ceiling", "?")) if of else r.get("ceiling", "?")
                self.goal("devbench", label, "≥ %.1f" % target, at_least(target), "%.1f GB/s" % r["gb_per_s"], ceil, of)
        for n in (64 * MiB, 256 * MiB):
            i = self.find("devbench", case="ipc-fetchtodevice", bytes=n)
            t = self.find("bench-cuda", case="torch-rpc", bytes=n)
            name = "CUDA IPC / PyTorch RPC cuda→cuda, %s" % size_name(n)
            if i and t and not i.get("error") and t["gb_per_s"] > 0:
                self.goal("devbench", name, "≥ 1.5", at_least(1.5), "%.1f GB/s" % i["gb_per_s"],
                          "%.1f GB/s (torch RPC)" % t["gb_per_s"], i["gb_per_s"] / t["gb_per_s"])
            else:
                self.goal("devbench" if not i else "bench-cuda", name, "≥ 1.5", None)
        for n in (4 * KiB, MiB):
            p = self.find("bench-cuda", case="trpc-fetch-cuda", bytes=n)
            t = self.find("bench-cuda", case="torch-rpc", bytes=n)
            name = "Python CUDA fetch p50 / PyTorch RPC p50, %s" % size_name(n)
            if p and t and t["p50_us"] > 0:
                self.goal("bench-cuda", name, "≤ 0.25", lambda r: r <= 0.25, "%.0f µs" % p["p50_us"],
                          "%.0f µs (torch RPC)" % t["p50_us"], p["p50_us"] / t["p50_us"])
            else:
                self.goal("bench-cuda", name, "≤ 0.25", None)

    # --- DESIGN.md's 16-core column

    def tensorbench_goals(self):
        def transfer(case, n, c):
            return self.find("tensorbench", kind="transfer", case=case, bytes=n, concurrency=c)

        def of_ceiling(case, n, c, target, name):
            r = transfer(case, n, c)
            if r and r.get("of_ceiling"):
                self.goal("tensorbench", name, "≥ %g" % target if target else "—",
                          (lambda x: x >= target) if target else None,
                          "%.2f GB/s" % r["gb_per_s"], "%.2f GB/s (%s)" % (r["ceiling_gb_per_s"], r["ceiling"]),
                          r["of_ceiling"])
            else:
                self.goal("tensorbench", name, "≥ %g" % target if target else "—", None)

        for plane, ceiling, goals in (("tcp", "raw sockets", {(1, MiB): 0.9, (1, 64 * MiB): 1.0, (16, MiB): 0.7, (16, 64 * MiB): 0.7}),
                                      ("shm", "memcpy", {(1, MiB): 0.7, (16, MiB): 0.5, (16, 64 * MiB): 0.5})):
            for c in (1, 4, 16, 64):
                for n in (MiB, 64 * MiB):
                    target = goals.get((c, n))
                    if target is None and not transfer("trpc-" + plane, n, c):
                        continue  # no goal, not measured: no line
                    of_ceiling("trpc-" + plane, n, c, target,
                               "%s Fetch, %d stream%s, %s / %s" % (plane, c, "s" if c > 1 else "", size_name(n), ceiling))
        for plane, ping in (("tcp", "tcp-socket"), ("shm", "unix-socket")):
            r, p = transfer("trpc-" + plane, 4 * KiB, 1), transfer(ping, 4 * KiB, 1)
            name = "4 KiB Fetch p50, one stream, %s / %s ping-pong" % (plane, ping)
            if r and p and p["p50_us"] > 0:
                self.goal("tensorbench", name, "≤ 1.5", lambda x: x <= 1.5, "%.1f µs" % r["p50_us"],
                          "%.1f µs" % p["p50_us"], r["p50_us"] / p["p50_us"])
            else:
                self.goal("tensorbench", name, "≤ 1.5", None)
        for case in ("call-rate", "call-rate-inline"):
            rs = [r for r in self.data["tensorbench"] if r.get("kind") == "rate" and r.get("case") == case]
            r = max(rs, key=lambda r: r.get("callers", 0), default=None)
            name = "4 KiB Calls/s, %s callers, %s / gRPC unary" % (r["callers"] if r else 16, case)
            if r:
                self.goal("tensorbench", name, "≥ 6", lambda x: x >= 6, "%.0f calls/s" % r["calls_per_s"],
                          "%.0f calls/s" % r["baseline_calls_per_s"], r["ratio"])
            else:
                self.goal("tensorbench", name, "≥ 6", None)

    def sequential(self, case):
        """handoffs' line of case for 4 KiB calls made one after another
        (lines with -streams N say "streams": N, and -size its bytes)."""
        for r in self.data.get("handoffs", []):
            if r.get("case") == case and r.get("streams", 1) == 1 and r.get("bytes", 4 * KiB) == 4 * KiB:
                return r
        return None

    def handoff_goals(self):
        for case, target in (("fetch-tcp", 3), ("fetch-shm", 2)):
            r = self.sequential(case)
            name = "hand-offs per 4 KiB call, %s (idle-P starts)" % case
            if r:
                self.goal("handoffs", name, "≤ %d" % target, lambda x: x <= target,
                          "%.2f (%.2f)" % (r["handoffs"], r.get("p_starts", 0)), "2 (raw socket ping-pong)", r["handoffs"])
            else:
                self.goal("handoffs", name, "≤ %d" % target, None)
        # Concurrent streams on one session (-streams): shown for their
        # numbers (issue 24, item 2: what the streams queue on).
        for r in self.data.get("handoffs", []):
            if r.get("streams", 1) > 1:
                self.goal("handoffs", "hand-offs per %s Fetch, %d streams on one session, %s (µs a call, all streams)" %
                          (size_name(r.get("bytes", 0)), r["streams"], r.get("case")), "—", None,
                          "%.2f (%.1f µs)" % (r["handoffs"], r.get("wall_per_call_ns", 0) / 1e3), "—", r["handoffs"])

    def streams_lines(self):
        """benchmarks/cmd/streams: how evenly 16 streams progress, shown
        for its numbers (issue 24, item 2)."""
        for r in self.data.get("streams", []):
            lanes = "TENSORRPC_LANES=%s" % r["lanes_env"] if r.get("lanes_env") else "default lanes"
            self.goal("streams", "slowest/fastest stream within %g ms (p50), %d streams of %s, %s, %s (GB/s)" %
                      (r.get("window_ms", 0), r.get("streams", 0), size_name(r.get("bytes", 0)), r.get("plane"), lanes),
                      "—", None, "%.2f (%.2f GB/s)" % (r.get("window_slowest_over_fastest_p50", 0), r.get("gb_per_s", 0)),
                      "—", r.get("window_slowest_over_fastest_p50", 0))

    def python_goals(self):
        # The goal is judged at the default poll spin; the 200 µs rows,
        # when measured, show whether a longer spin would help.
        for step, label in (("python-spin", "poll 50 µs"), ("python-spin-200us", "TENSORRPC_POLL_US=200")):
            for plane in ("shm", "tcp"):
                for n, target in ((4 * KiB, 1.5), (MiB, 1.2)):
                    py = self.find(step, transport=plane, bytes=n, case="py-tensor")
                    go = self.find(step, transport=plane, bytes=n, case="go")
                    name = "Python / Go p50, %s, %s (%s)" % (plane, size_name(n), label)
                    if py and go:
                        self.goal("python-spin", name, "≤ %.1f" % target, lambda x: x <= target,
                                  "%.1f µs" % py["p50_us"], "%.1f µs (Go)" % go["p50_us"], py["p50_over_go"])
                    elif step == "python-spin":
                        self.goal("python-spin", name, "≤ %.1f" % target, None)
        # Against PyTorch's own RPC (TensorPipe), where torch ran: at least
        # 2× on shm and 1.5× on tcp, at every size measured.
        for plane, target in (("shm", 2.0), ("tcp", 1.5)):
            rows = [r for r in self.data.get("python-spin", []) if r.get("transport") == plane and r.get("case") == "torch-rpc"]
            for r in sorted(rows, key=lambda r: r["bytes"]):
                py = self.find("python-spin", transport=plane, bytes=r["bytes"], case="py-tensor")
                if not py or "p50_over_py_tensor" not in r:
                    continue
                name = "PyTorch RPC p50 / Python p50, %s, %s" % (plane, size_name(r["bytes"]))
                self.goal("python-spin", name, "≥ %.1f" % target, lambda x: x >= target,
                          "%.1f µs" % py["p50_us"], "%.1f µs (torch RPC)" % r["p50_us"], r["p50_over_py_tensor"])

    # --- issue 27: the telemetry's cost

    def otel_goals(self):
        """Parses the otel step's benchmark line: each case's p50 and its
        p50 against no telemetry's, paired by turn."""
        vals = {}
        for line in read(os.path.join(self.tmp, "otel.log")).splitlines():
            if line.startswith("BenchmarkFetch4KiBTwoProcesses"):
                for v, unit in re.findall(r"([\d.]+) (\S+)", line):
                    vals[unit] = float(v)
        if vals:
            self.data["otel"] = [dict({"case": "Fetch4KiBTwoProcesses"}, **vals)]
        for case, label in (("metrics-only", "metrics only"), ("sampled-1pct", "1% of traces sampled")):
            name = "4 KiB Fetch p50 with telemetry (%s) / without, two processes" % label
            ratio = vals.get(case + "/off-paired")
            if ratio is not None and case + "-p50-µs" in vals and "off-p50-µs" in vals:
                self.goal("otel", name, "≤ 1.15", lambda x: x <= 1.15, "%.1f µs" % vals[case + "-p50-µs"],
                          "%.1f µs (off)" % vals["off-p50-µs"], ratio)
            else:
                self.goal("otel", name, "≤ 1.15", None)

    def allreduce(self):
        """Parses the allreduce step's log: mean ms per all-reduce by plane and P."""
        ms, cur = {}, None
        for line in read(os.path.join(self.tmp, "allreduce.log")).splitlines():
            m = re.match(r"allreduce-run plane=(\w+) p=(\d+)", line)
            if m:
                cur = (m.group(1), int(m.group(2)))
                continue
            m = re.search(r"^time ([\d.]+) (µs|ms|s) per all-reduce", line) or re.search(r"timed: ([\d.]+) (ms),", line)
            if m and cur:
                ms[cur] = float(m.group(1)) * {"µs": 1e-3, "ms": 1, "s": 1e3}[m.group(2)]
                self.data.setdefault("allreduce", []).append({"plane": cur[0], "p": cur[1], "ms_per_allreduce": ms[cur]})
        return ms

    def allreduce_goals(self):
        ms = self.allreduce()
        ps = sorted({p for _, p in ms}) or [4, 8]
        for p in ps:
            for plane in ("tcp", "shm"):
                ours, gloo = ms.get((plane, p)), ms.get(("gloo", p))
                name = "all-reduce %s, P = %d, Gloo time / ours" % (plane, p)
                if ours and gloo:
                    self.goal("allreduce", name, "≥ 1.5", lambda x: x >= 1.5, "%.2f ms" % ours, "%.2f ms (Gloo)" % gloo, gloo / ours)
                else:
                    self.goal("allreduce", name, "≥ 1.5", None)

    # --- output

    def facts(self):
        log = read(os.path.join(self.tmp, "facts.log")).splitlines()
        gpus = [l for l in log if l.startswith("GPU ")]
        torch = [l for l in log if l.startswith("torch ")]
        cores = next((l for l in log if l.strip().isdigit()), "?")
        build = read(os.path.join(self.tmp, "BUILD")).splitlines()
        lines = ["- machine: %s cores; %s" % (cores.strip(), "; ".join(gpus) if gpus else "no GPU listed by nvidia-smi")]
        if torch:
            lines.append("- " + torch[0])
        if build:
            lines.append("- binaries: " + "; ".join(build[:2]))
        return lines

    def tests(self):
        rows = []
        for step in ("gpudirect-tests", "rpc-tests"):
            results = re.findall(r"^\s*--- (PASS|FAIL|SKIP): (\S+)", read(os.path.join(self.tmp, step + ".log")), re.M)
            for res, name in results:
                self.data.setdefault(step, []).append({"test": name, "result": res})
            if results:
                count = {k: sum(1 for r, _ in results if r == k) for k in ("PASS", "FAIL", "SKIP")}
                failed = [n for r, n in results if r == "FAIL"]
                rows.append("- %s: %d passed, %d failed, %d skipped%s" % (step, count["PASS"], count["FAIL"], count["SKIP"],
                                                                          (": " + ", ".join(failed)) if failed else ""))
        check = read(os.path.join(self.tmp, "cuda-check.log"))
        if check:
            rows.append("- cuda-check: %s" % ("cuda check OK" if "cuda check OK" in check else "did not print 'cuda check OK'"))
        return rows

    def timelines(self):
        """The scheduler's events of a 4 KiB call, as most calls went
        (handoffs' timelines, when its JSON lines have them)."""
        md = []
        for case in ("fetch-tcp", "pingpong-tcp", "fetch-shm", "call-tcp"):
            r = self.sequential(case)
            tl = (r or {}).get("timeline") or {}
            steps = tl.get("steps") or []
            if not steps:
                continue
            md += ["", "%s: the scheduler's events in a call, as %d of %d calls went (median µs since the call began, traced)" %
                   (case, tl.get("calls", 0), r.get("calls", 0)), "", "| step | µs | gap µs | what |", "| ---: | ---: | ---: | --- |"]
            prev = 0.0
            for i, st in enumerate(steps):
                at = st.get("at_ns", 0) / 1e3
                md.append("| %d | %.1f | %.1f | %s |" % (i + 1, at, at - prev, st.get("what", "").replace("github.com/tensorrpc/tensorrpc/", "")))
                prev = at
        return md

    def markdown(self):
        self.device_goals()
        self.tensorbench_goals()
        self.handoff_goals()
        self.streams_lines()
        self.python_goals()
        self.allreduce_goals()
        self.otel_goals()
        md = ["# device check", ""]
        if self.nogpu:
            md += ["**%s**: the GPU steps were skipped and the device goals are not measured." % self.nogpu, ""]
        md += self.facts() + [""]
        md += ["| step | status | seconds | note |", "| --- | --- | ---: | --- |"]
        for name, s in self.steps.items():
            status = s["status"] if s["status"] in ("ok", "skipped") else "**%s** (rc %s)" % (s["status"], s["rc"])
            md.append("| %s | %s | %s | %s |" % (name, status, s["seconds"], s["note"]))
        tests = self.tests()
        if tests:
            md += [""] + tests
        md += ["", "| goal | measured | ceiling | ratio | target | met |", "| --- | ---: | ---: | ---: | ---: | --- |"]
        md += ["| %s |" % " | ".join(g) for g in self.goals]
        met = sum(1 for g in self.goals if g[5] == "yes")
        missed = sum(1 for g in self.goals if g[5] == "**no**")
        md += ["", "%d goals met, %d missed, %d not measured." % (met, missed, len(self.goals) - met - missed)]
        md += self.timelines()
        return "\n".join(md) + "\n"

    def jsonl(self):
        out = []
        for step, rows in self.data.items():
            for r in rows:
                out.append(json.dumps(dict({"step": step}, **r)))
        for g in self.goals:
            out.append(json.dumps({"step": "summary", "goal": g[0], "measured": g[1], "ceiling": g[2], "ratio": g[3],
                                   "target": g[4], "met": g[5].strip("*")}, ensure_ascii=False))
        return "\n".join(out) + ("\n" if out else "")


def main():
    if len(sys.argv) < 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    tmp, out = sys.argv[1], sys.argv[2]
    s = Summary(tmp, sys.argv[3] if len(sys.argv) > 3 else "")
    md = s.markdown()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out, "results.jsonl"), "w") as f:
        f.write(s.jsonl())
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
