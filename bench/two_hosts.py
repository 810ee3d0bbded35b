#!/usr/bin/env python3
"""Two hosts over a veth link (two network namespaces, scripts/netns_pair.sh) against one host.

1. Step time: mlp_train over Gloo at 2 hosts x 1 rank against 1 host x 2 ranks, alternated
   A B A B, medians of the runtime's own median iteration time (--stats-json).
2. Failure detection: with a job training at 2 hosts x 1 rank, the time from host b's death
   (its launcher killed with SIGKILL and its link taken down) to host a's launcher exiting, at a
   given --heartbeat-timeout; and from one rank's SIGKILL on host b to host a's exit.

Root only. Usage: sudo python3 bench/two_hosts.py --build build [--reps 3] [--json out.json]
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PAIR = os.path.join(HERE, "..", "scripts", "netns_pair.sh")
NAME = "sfbench%d" % (os.getpid() % 100000)
HOST_A, HOST_B = "10.213.0.1", "10.213.0.2"
MODELS = {"256x4": [256] * 5, "1024x8": [1024] * 9}
BATCH = 32  # per rank


def sh(*args):
    subprocess.run([PAIR, *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def launcher(build, host, node, nnodes, nproc, prog, hb_timeout=10, port=29533):
    return ["ip", "netns", "exec", "%s-%s" % (NAME, host), os.path.join(build, "bin/shardflow"), "run",
            "--nnodes", str(nnodes), "--node-rank", str(node), "--nproc-per-node", str(nproc),
            "--master-addr", HOST_A, "--master-port", str(port), "--token", "bench-two-hosts",
            "--heartbeat-timeout", str(hb_timeout), "--kill-grace", "2", "--"] + prog


def trainer(build, sizes, steps, world, extra=()):
    return [os.path.join(build, "examples/mlp_train"), "--sizes", ",".join(map(str, sizes)), "--steps", str(steps),
            "--global-batch", str(BATCH * world), "--optimizer", "adam", "--lr", "1e-3", "--backend", "gloo",
            "--zero-stage", "1", "--overlap", "interleaved", "--timeout", "120", *extra]


ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def step_ms(build, sizes, steps, two_hosts, tmp):
    stats = os.path.join(tmp, "stats.json")
    prog = trainer(build, sizes, steps, 2, ["--quiet", "--stats-json", stats])
    if two_hosts:
        procs = [subprocess.Popen(launcher(build, h, n, 2, 1, prog), env=ENV, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE) for h, n in (("a", 0), ("b", 1))]
    else:
        procs = [subprocess.Popen(launcher(build, "a", 0, 1, 2, prog), env=ENV, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        if p.returncode != 0:
            sys.exit("two_hosts: training failed:\n" + err.decode())
    with open(stats) as f:
        return json.load(f)["median"]["iteration_ms"]


class Watched:
    """A launcher whose output is read on a thread, so the bench can wait for a line."""

    def __init__(self, argv):
        self.p = subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines, self.exited_at = [], None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.append(line)
        self.p.wait()
        self.exited_at = time.monotonic()

    def wait_for(self, text, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(text in l for l in self.lines):
                return True
            time.sleep(0.05)
        return False


def detection_s(build, how, hb_timeout):
    prog = trainer(build, MODELS["256x4"], 10**7, 2, ["--log-every", "1"])
    a = Watched(launcher(build, "a", 0, 2, 1, prog, hb_timeout))
    b = Watched(launcher(build, "b", 1, 2, 1, prog, hb_timeout))
    try:
        if not a.wait_for("20/10000000", 120):
            sys.exit("two_hosts: the job did not start:\n" + "".join(a.lines + b.lines))
        if how == "host":
            t0 = time.monotonic()
            b.p.send_signal(signal.SIGKILL)
            sh("link", NAME, "down")
        else:
            pid = next(int(l.split("(pid ")[1].split(")")[0]) for l in b.lines if "started rank 1 (pid " in l)
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
        a.p.wait(timeout=120)
        while a.exited_at is None:
            time.sleep(0.01)
        if a.p.returncode == 0:
            sys.exit("two_hosts: host a exited 0 after host b's death")
        return a.exited_at - t0
    finally:
        for w in (a, b):
            if w.p.poll() is None:
                w.p.kill()
                w.p.wait()
        sh("link", NAME, "up")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("two_hosts: needs root (network namespaces)")
    build = os.path.abspath(args.build)
    sh("up", NAME)
    out = {"steps": {}, "detection": {}}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            # A veth starts at Ethernet's 1500 bytes; loopback (one host) runs at 64 KiB. On 2 cores
            # the per-segment TCP work shows, so both MTUs are measured.
            for mtu in (1500, 65520):
                sh("mtu", NAME, str(mtu))
                for model, sizes in MODELS.items():
                    steps = 300 if model == "256x4" else 60
                    runs = {"1 host x 2": [], "2 hosts x 1": []}
                    for _ in range(args.reps):  # A B A B
                        runs["1 host x 2"].append(step_ms(build, sizes, steps, False, tmp))
                        runs["2 hosts x 1"].append(step_ms(build, sizes, steps, True, tmp))
                    med = {k: statistics.median(v) for k, v in runs.items()}
                    ratio = med["2 hosts x 1"] / med["1 host x 2"]
                    out["steps"]["%s, link MTU %d" % (model, mtu)] = {"runs_ms": runs, "median_ms": med,
                                                                     "ratio_two_hosts_over_one": ratio}
                    print("%-7s link MTU %5d: step (median iteration ms) 1 host x 2 %.3f, 2 hosts x 1 %.3f, ratio %.2f" %
                          (model, mtu, med["1 host x 2"], med["2 hosts x 1"], ratio), flush=True)
            sh("mtu", NAME, "1500")
            for how, hb in (("host", 3), ("host", 10), ("rank", 10)):
                ts = [detection_s(build, how, hb) for _ in range(args.reps)]
                key = "%s death, heartbeat timeout %d s" % (how, hb)
                out["detection"][key] = {"runs_s": ts, "median_s": statistics.median(ts)}
                print("%-40s -> other host exits after %.2f s (median of %s)" %
                      (key, statistics.median(ts), ", ".join("%.2f" % t for t in ts)), flush=True)
    finally:
        sh("down", NAME)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
