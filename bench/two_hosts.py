#!/usr/bin/env python3
"""Two hosts over a veth link (two network namespaces, scripts/netns_pair.sh) against one host.

1. Step time: mlp_train over Gloo at 2 hosts x 1 rank against 1 host x 2 ranks, alternated
   A B A B, medians of the runtime's own median iteration time (--stats-json).
2. Failure detection: with a job training at 2 hosts x 1 rank, the time from host b's death
   (its launcher killed with SIGKILL and its link taken down) to host a's launcher exiting, at a
   given --heartbeat-timeout; and from one rank's SIGKILL on host b to host a's exit.

3. --table: the side-by-side table on a rate-limited link (scripts/netns_pair.sh rate: tc tbf on
   both ends) at each --rates (1gbit, 10gbit, off = unshaped), 2 hosts x 1 rank, per model: PyTorch
   DDP and DDP + ZeroRedundancyOptimizer (python3-torch, bench/peers/torch_mlp_worker.py), shardflow's
   ZeRO stages in each overlap mode, the link's own time for DDP's bytes (bench_collectives'
   all-reduce, reduce-scatter and all-gather of the model's fp32 bytes between the hosts) and the
   compute alone (mlp_train at world 1). Every configuration once per round, --reps rounds (A B A
   B), medians; --png draws it.
4. --gpt: the same for examples/gpt_train (the default 10.7 M-parameter GPT, 8 sequences of 64
   characters per rank) against bench/peers/torch_gpt.py's PyTorch DDP and DDP + ZeroRedundancyOptimizer,
   at 1 and/or 2 ranks per host, and examples/python/gpt.py (shardflow.torch) in the rows named
   "shardflow.torch (Python)"; --only picks rows by name; --trace-dir traces the best shardflow row
   and draws its median iteration with tools/trace_plot.py.

Root only. Usage: sudo python3 bench/two_hosts.py --build build [--reps 3] [--json out.json]
       sudo /usr/bin/python3 bench/two_hosts.py --build build --table [--rates 1gbit,10gbit,off]
            [--models 512x8,1024x8] [--reps 3] [--json bench/results/two_hosts_link.json] [--png bench/results/two_hosts_link.png]
       sudo /usr/bin/python3 bench/two_hosts.py --build build --gpt [--rates 1gbit,10gbit] [--ranks-per-host 1,2]
            [--reps 2] [--json bench/results/two_hosts_gpt.json] [--png bench/results/two_hosts_gpt.png] [--trace-dir bench/results/gpt_traces]
            [--only "PyTorch,ZeRO-2 interleaved + prefetch,shardflow.torch"]
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
PREFIX = "10.213.0"
HOST_A, HOST_B = PREFIX + ".1", PREFIX + ".2"
TOKEN = "bench-two-hosts"  # every launcher's --token; etcd's password for user "shardflow" (etcd_up)


def host_addr(host):
    """Host "a", "b", "c", ...'s address (scripts/netns_pair.sh up NAME PREFIX HOSTS)."""
    return "%s.%d" % (PREFIX, "abcdef".index(host) + 1)
MODELS = {"256x4": [256] * 5, "1024x8": [1024] * 9, "512x8": [512] * 9}
BATCH = 32  # per rank


def sh(*args):
    subprocess.run([PAIR, *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class Etcd:
    """A real etcd cluster (Debian's etcd-server), one member inside each network-namespace host on
    its address, with authentication as docs/launching.md tells a user to set it up: the launchers'
    token is the password of user "shardflow", which may read and write /shardflow/. A host cut off
    takes its member with it; a majority of the others keeps the store."""

    def __init__(self, hosts, workdir):
        self.hosts, self.dir, self.procs = hosts, workdir, []
        peers = ",".join("m%s=http://%s:2380" % (h, host_addr(h)) for h in hosts)
        for h in hosts:
            a = host_addr(h)
            log = open(os.path.join(workdir, "etcd-%s.log" % h), "w")
            # Elections in 0.5 s rather than 1 s: a lost host's member is replaced by a vote.
            self.procs.append(subprocess.Popen(
                ["ip", "netns", "exec", "%s-%s" % (NAME, h), "/usr/bin/etcd", "--name", "m" + h, "--data-dir",
                 os.path.join(workdir, "etcd-" + h), "--listen-client-urls", "http://%s:2379" % a, "--advertise-client-urls",
                 "http://%s:2379" % a, "--listen-peer-urls", "http://%s:2380" % a, "--initial-advertise-peer-urls",
                 "http://%s:2380" % a, "--initial-cluster", peers, "--initial-cluster-state", "new", "--initial-cluster-token",
                 NAME, "--heartbeat-interval", "50", "--election-timeout", "500"], stdout=log, stderr=subprocess.STDOUT))
        self.wait_healthy(30, auth=False)
        for c in ("user add root:root-password", "user grant-role root root", "role add shardflow-job",
                  "role grant-permission shardflow-job --prefix=true readwrite /shardflow/", "user add shardflow:" + TOKEN,
                  "user grant-role shardflow shardflow-job", "auth enable"):
            if self.ctl(c.split(), auth=False).returncode != 0:
                self.stop()
                sys.exit("etcdctl %s failed" % c)

    def endpoints(self):
        return ",".join("%s:2379" % host_addr(h) for h in self.hosts)

    def ctl(self, args, auth=True):
        return subprocess.run(["ip", "netns", "exec", "%s-%s" % (NAME, self.hosts[0]), "/usr/bin/etcdctl", "--dial-timeout", "2s",
                               "--endpoints", self.endpoints()] + (["--user", "root:root-password"] if auth else []) + args,
                              env=dict(os.environ, ETCDCTL_API="3"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_healthy(self, limit_s, auth=True):
        """Every member answering (after a host's link came back: its member caught up)."""
        end = time.monotonic() + limit_s
        while self.ctl(["endpoint", "health"], auth).returncode != 0:
            if time.monotonic() > end:
                return False
            time.sleep(0.2)
        return True

    def stop(self):
        for p in self.procs:
            p.kill()
            p.wait()


def launcher(build, host, node, nnodes, nproc, prog, hb_timeout=10, port=29533):
    return ["ip", "netns", "exec", "%s-%s" % (NAME, host), os.path.join(build, "bin/shardflow"), "run",
            "--nnodes", str(nnodes), "--node-rank", str(node), "--nproc-per-node", str(nproc),
            "--master-addr", HOST_A, "--master-port", str(port), "--token", TOKEN,
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


# --table: what each row runs. shardflow rows are mlp_train flags; the stages' best modes as a user
# would set them (interleaved + forward prefetch), and stage 1's modes one by one.
# Note [Mirrored shards]: the twin rows' flags (the snapshot directory is the fallback twins need;
# no snapshot is taken in these few steps).
TWINS = ["--redundancy", "2", "--snapshot-dir", "/var/tmp/shardflow_twins_bench", "--snapshot-every", "1000"]
SHARDFLOW_ROWS = {
    "shardflow ZeRO-0 (DDP)": ["--zero-stage", "0"],
    "shardflow ZeRO-1 none": ["--zero-stage", "1", "--overlap", "none"],
    "shardflow ZeRO-1 after_backward": ["--zero-stage", "1", "--overlap", "after_backward"],
    "shardflow ZeRO-1 interleaved": ["--zero-stage", "1", "--overlap", "interleaved"],
    "shardflow ZeRO-1 interleaved + prefetch": ["--zero-stage", "1", "--overlap", "interleaved", "--forward-prefetch"],
    "shardflow ZeRO-1 interleaved + prefetch, all-reduced grads": ["--zero-stage", "1", "--overlap", "interleaved",
                                                                   "--forward-prefetch", "--no-reduce-scatter"],
    "shardflow ZeRO-2 interleaved + prefetch": ["--zero-stage", "2", "--overlap", "interleaved", "--forward-prefetch"],
    # Note [Mirrored shards]: a twin of each shard on the other host (the snapshot directory is the
    # fallback it needs; no snapshot is taken in the table's steps).
    "shardflow ZeRO-1 interleaved + prefetch, redundancy 2": ["--zero-stage", "1", "--overlap", "interleaved", "--forward-prefetch",
                                                              *TWINS],
    "shardflow ZeRO-2 interleaved + prefetch, redundancy 2": ["--zero-stage", "2", "--overlap", "interleaved", "--forward-prefetch",
                                                              *TWINS],
    # --ranks-per-host 2: the two levels (shm inside a host, Gloo between), with and without twins a
    # host away (Note [Syncs from the twin, two levels]).
    "shardflow ZeRO-1 interleaved + prefetch, two levels": ["--zero-stage", "1", "--overlap", "interleaved", "--forward-prefetch",
                                                            "--backend", "hierarchical"],
    "shardflow ZeRO-1 interleaved + prefetch, two levels, redundancy 2": ["--zero-stage", "1", "--overlap", "interleaved",
                                                                          "--forward-prefetch", "--backend", "hierarchical", *TWINS],
    "shardflow ZeRO-2 interleaved + prefetch, two levels": ["--zero-stage", "2", "--overlap", "interleaved", "--forward-prefetch",
                                                            "--backend", "hierarchical"],
    "shardflow ZeRO-2 interleaved + prefetch, two levels, redundancy 2": ["--zero-stage", "2", "--overlap", "interleaved",
                                                                          "--forward-prefetch", "--backend", "hierarchical", *TWINS],
}
TABLE_STEPS = 40


def mlp_cmd(build, sizes, steps, world, flags, stats):
    return [os.path.join(build, "examples/mlp_train"), "--sizes", ",".join(map(str, sizes)), "--steps", str(steps),
            "--global-batch", str(BATCH * world), "--optimizer", "adam", "--lr", "1e-3", "--quiet", "--stats-json", stats,
            "--timeout", "300", *flags]


def run_both(argvs, what, env=None):
    procs = [subprocess.Popen(a, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for a in argvs]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        sys.exit("two_hosts: %s failed:\n%s" % (what, "\n".join(outs)))
    return outs


def shardflow_row(build, sizes, flags, tmp, per_host=1):
    stats = os.path.join(tmp, "stats.json")
    backend = [] if "--backend" in flags else ["--backend", "gloo"]
    prog = mlp_cmd(build, sizes, TABLE_STEPS, 2 * per_host, [*backend, *flags], stats)
    run_both([launcher(build, h, n, 2, per_host, prog) for h, n in (("a", 0), ("b", 1))], "shardflow " + " ".join(flags))
    with open(stats) as f:
        m = json.load(f)["median"]
    return m["iteration_ms"], m.get("wire_bytes", 0)


def torch_row(sizes, mode, tmp):
    store, out = os.path.join(tmp, "torch_store"), os.path.join(tmp, "torch.json")
    for f in (store, out):
        if os.path.exists(f):
            os.remove(f)
    worker = os.path.join(HERE, "peers", "torch_mlp_worker.py")
    argvs = [["ip", "netns", "exec", "%s-%s" % (NAME, h), "env", "GLOO_SOCKET_IFNAME=%s%s" % (NAME, h), "/usr/bin/python3", worker,
              str(r), "2", store, ",".join(map(str, sizes)), str(TABLE_STEPS), mode, out] for h, r in (("a", 0), ("b", 1))]
    run_both(argvs, "PyTorch " + mode)
    with open(out) as f:
        return json.load(f)["median_step_ms"]


def world1_row(build, sizes, tmp):
    stats = os.path.join(tmp, "w1.json")
    run_both([["ip", "netns", "exec", NAME + "-a"] + mlp_cmd(build, sizes, TABLE_STEPS, 1, [], stats)], "world 1")
    with open(stats) as f:
        return json.load(f)["median"]["iteration_ms"]


def link_rows(build, sizes=None, nbytes=None, per_host=1):
    """bench_collectives between the hosts on the model's fp32 bytes: {op: ms}."""
    if nbytes is None:
        psi = sum(sizes[i] * sizes[i + 1] + sizes[i + 1] for i in range(len(sizes) - 1))
        nbytes = psi * 4
    nbytes = nbytes // 64 * 64  # divisible by the world's blocks
    prog = [os.path.join(build, "bench/bench_collectives"), "--backend", "gloo", "--bytes", str(nbytes), "--reps", "6"]
    outs = run_both([launcher(build, h, n, 2, per_host, prog) for h, n in (("a", 0), ("b", 1))], "bench_collectives")
    ms = {}
    for line in "\n".join(outs).splitlines():
        line = line[line.find("|"):] if "|" in line else ""  # the launcher's "[rank 0] " prefix
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and cells[0] == "gloo" and cells[2] in ("allreduce", "reduce_scatter", "allgather"):
            ms[cells[2]] = float(cells[4]) / 1e3
    return ms


def table(args, build):
    rates = args.rates.split(",")
    models = args.models.split(",")
    torch_ok = subprocess.run(["/usr/bin/python3", "-c", "import torch"], stderr=subprocess.DEVNULL).returncode == 0
    per_host = int(args.ranks_per_host)  # the table takes one
    rows = (["PyTorch DDP", "PyTorch DDP + ZeroRedundancyOptimizer"] if torch_ok and per_host == 1 else []) + \
        [r for r in SHARDFLOW_ROWS if per_host > 1 or "hierarchical" not in SHARDFLOW_ROWS[r]]
    if args.only:
        rows = [r for r in rows if any(picks(o, r) for o in only_names(args.only))]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o777)
        for rate in rates:
            sh("rate", NAME, rate)
            for model in models:
                sizes = MODELS[model]
                key = "%s%s, link %s" % (model, ", 2 hosts x %d ranks" % per_host if per_host > 1 else "", "unshaped" if rate == "off" else rate)
                runs = {r: [] for r in rows}
                wire = {}
                runs["compute alone (world 1)"] = []
                links = []
                for rep in range(args.reps):  # A B A B: every row once per round
                    links.append(link_rows(build, sizes, per_host=per_host))
                    runs["compute alone (world 1)"].append(world1_row(build, sizes, tmp))
                    for r in rows:
                        if r.startswith("PyTorch"):
                            runs[r].append(torch_row(sizes, "zero" if "Zero" in r else "ddp", tmp))
                        else:
                            ms, wire[r] = shardflow_row(build, sizes, SHARDFLOW_ROWS[r], tmp, per_host)
                            runs[r].append(ms)
                    print("  %s round %d done" % (key, rep + 1), flush=True)
                med = {r: statistics.median(v) for r, v in runs.items()}
                link = {op: statistics.median(l[op] for l in links) for op in links[0]}
                out[key] = {"runs_ms": runs, "median_ms": med, "link_ms": link, "wire_bytes": wire}
                ddp_link = link.get("allreduce", 0.0)
                bound = max(ddp_link, med["compute alone (world 1)"])
                print("\n%s: link alone (bench_collectives, median) all-reduce %.1f ms, reduce-scatter %.1f ms, "
                      "all-gather %.1f ms; compute alone %.1f ms; bound max(link, compute) %.1f ms" %
                      (key, link.get("allreduce", 0), link.get("reduce_scatter", 0), link.get("allgather", 0),
                       med["compute alone (world 1)"], bound))
                ref = med.get("PyTorch DDP")
                for r in rows:
                    extra = ", %.2fx PyTorch DDP" % (med[r] / ref) if ref else ""
                    print("  %-62s %8.1f ms  %.2fx bound%s%s" % (r, med[r], med[r] / bound, extra,
                                                               ", %.1f MB on the wire" % (wire[r] / 1e6) if wire.get(r) else ""),
                          flush=True)
        sh("rate", NAME, "off")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.png:
        plot(out, args.png)


# --gpt: examples/gpt_train against bench/peers/torch_gpt.py (the same model, windows and AdamW groups)
# on the rate-limited link, --ranks-per-host 1 and/or 2. Each rank takes GPT_ROWS sequences of the
# global batch. shardflow rows are gpt_train flags.
GPT_ROWS = 8
GPT_STEPS = 12
GPT_ROWS_SHARDFLOW = {
    "shardflow ZeRO-0 (DDP)": ["--zero-stage", "0"],
    "shardflow ZeRO-1 none": ["--zero-stage", "1", "--overlap", "none"],
    "shardflow ZeRO-1 interleaved": ["--zero-stage", "1", "--overlap", "interleaved"],
    "shardflow ZeRO-1 interleaved + prefetch": ["--zero-stage", "1", "--overlap", "interleaved", "--forward-prefetch"],
    "shardflow ZeRO-2 interleaved + prefetch": ["--zero-stage", "2", "--overlap", "interleaved", "--forward-prefetch"],
    "shardflow ZeRO-2 interleaved": ["--zero-stage", "2", "--overlap", "interleaved"],
    # Stage 2's pool held backward 22-30 ms an iteration with 2 gradient buckets in flight (RESULTS.md, "What a rank's bound
    # cannot see"): the budget split four ways instead (smaller buckets, the same memory).
    "shardflow ZeRO-2 interleaved + prefetch, 4 in flight": ["--zero-stage", "2", "--overlap", "interleaved", "--forward-prefetch",
                                                             "--max-buckets-in-flight", "4"],
    # Issue 47: without the small last bucket (Note [A small last bucket]), PyTorch's layout.
    "shardflow ZeRO-1 interleaved + prefetch, no small last bucket": ["--zero-stage", "1", "--overlap", "interleaved", "--forward-prefetch",
                                                                      "--last-bucket-mb", "0"],
    "shardflow ZeRO-2 interleaved + prefetch, no small last bucket": ["--zero-stage", "2", "--overlap", "interleaved", "--forward-prefetch",
                                                                      "--last-bucket-mb", "0"],
    # Note [Mirrored shards]: a twin of each shard on the other host (issue 48's steady-state cost).
    "shardflow ZeRO-1 interleaved + prefetch, redundancy 2": ["--zero-stage", "1", "--overlap", "interleaved", "--forward-prefetch",
                                                              *TWINS],
    "shardflow ZeRO-2 interleaved + prefetch, redundancy 2": ["--zero-stage", "2", "--overlap", "interleaved", "--forward-prefetch",
                                                              *TWINS],
    # The twin on the same host (the next rank): no bytes between the hosts, but a lost host takes
    # a shard and its twin together (with 2 ranks a host; at 1 it is the other host again).
    "shardflow ZeRO-2 interleaved + prefetch, redundancy 2, twin on the same host": [
        "--zero-stage", "2", "--overlap", "interleaved", "--forward-prefetch", "--twin-distance", "1", *TWINS],
    # Several ranks a host (issue 34): the two levels, shm inside a host and Gloo between hosts.
    "shardflow ZeRO-0 (DDP), two levels": ["--zero-stage", "0", "--backend", "hierarchical"],
    "shardflow ZeRO-2 interleaved + prefetch, two levels": ["--zero-stage", "2", "--overlap", "interleaved", "--forward-prefetch",
                                                            "--backend", "hierarchical"],
    "shardflow ZeRO-2 interleaved + prefetch, two levels, redundancy 2": [
        "--zero-stage", "2", "--overlap", "interleaved", "--forward-prefetch", "--backend", "hierarchical", *TWINS],
    # The Python front end (issue 35): examples/python/gpt.py through shardflow.torch, the same flags.
    "shardflow.torch (Python) ZeRO-0 (DDP)": ["--python", "--zero-stage", "0"],
    "shardflow.torch (Python) ZeRO-2 interleaved + prefetch": ["--python", "--zero-stage", "2", "--overlap", "interleaved", "--forward-prefetch"],
    "shardflow.torch (Python) ZeRO-0 (DDP), two levels": ["--python", "--zero-stage", "0", "--backend", "hierarchical"],
    "shardflow.torch (Python) ZeRO-2 interleaved + prefetch, two levels": ["--python", "--zero-stage", "2", "--overlap", "interleaved",
                                                                           "--forward-prefetch", "--backend", "hierarchical"],
}


def only_names(only):
    """--only's entries: split at commas not followed by a space (row names have ", " in them)."""
    import re
    return re.split(r",(?! )", only)


def picks(only, row):
    """--only's test: a name part, or with a trailing $ the row's whole name (shardflow's prefix may be left out)."""
    if only.endswith("$"):
        return row in (only[:-1], "shardflow " + only[:-1])
    return only in row


def gpt_rows_for(per_host):
    """The shardflow rows that run with per_host ranks a host: the two levels need several."""
    return [r for r, flags in GPT_ROWS_SHARDFLOW.items() if per_host > 1 or "hierarchical" not in flags]


def gpt_cmd(build, world, flags, steps=GPT_STEPS):
    return [os.path.join(build, "examples/gpt_train"), "--batch", str(GPT_ROWS * world), "--steps", str(steps),
            "--sample-chars", "0", "--eval-windows", "16", "--log-every", str(steps), "--timeout", "600", *flags]


def median_step(outs):
    for line in "\n".join(outs).splitlines():
        if "median step " in line:
            return float(line.split("median step ")[1].split(" ms")[0])
    sys.exit("two_hosts: no 'median step' line in:\n" + "\n".join(outs))


def gpt_python_cmd(build, world, flags, init):
    """examples/python/gpt.py with gpt_cmd's batch and steps (its own weights need --init)."""
    return ["env", "PYTHONPATH=" + os.path.join(build, "python"), "/usr/bin/python3", os.path.join(HERE, "..", "examples", "python", "gpt.py"),
            "--batch", str(GPT_ROWS * world), "--steps", str(GPT_STEPS), "--log-every", str(GPT_STEPS), "--timeout", "600", "--init", init, *flags]


def gpt_shardflow_row(build, per_host, flags, trace=None, init=None):
    backend = [] if "--backend" in flags else ["--backend", "gloo"]
    stats = None
    if "--python" in flags:
        prog = gpt_python_cmd(build, 2 * per_host, [*backend, *(f for f in flags if f != "--python")], init)
    else:
        stats = tempfile.mktemp(prefix="gpt_stats_", suffix=".json")
        prog = gpt_cmd(build, 2 * per_host, [*backend, *flags, "--stats-json", stats] + (["--trace", trace] if trace else []),
                       steps=GPT_STEPS + (4 if trace else 0))
    outs = run_both([launcher(build, h, n, 2, per_host, prog) for h, n in (("a", 0), ("b", 1))], "gpt_train " + " ".join(flags))
    step = median_step(outs)
    if stats and os.path.exists(stats):
        # The run's own bound (Note [The iteration's bound]), rank 0's median, beside its median step.
        with open(stats) as f:
            median = json.load(f)["median"]
        os.remove(stats)
        if median.get("bound_ms"):
            # over_bound: the median of the iterations' own ratios (the medians' ratio beside it).
            print("    %s: step %.1f ms, iteration %.1f ms, bound %.1f ms, iteration / bound %.3f (of the medians %.3f)" %
                  (" ".join(flags), step, median["iteration_ms"], median["bound_ms"], median.get("over_bound", 0.0),
                   median["iteration_ms"] / median["bound_ms"]), flush=True)
    return step


def gpt_torch_row(per_host, zero, init, data, tmp):
    store, out = os.path.join(tmp, "torch_store"), os.path.join(tmp, "torch.json")
    for f in (store, out):
        if os.path.exists(f):
            os.remove(f)
    world = 2 * per_host
    argvs = [["ip", "netns", "exec", "%s-%s" % (NAME, h), "env", "GLOO_SOCKET_IFNAME=%s%s" % (NAME, h), "/usr/bin/python3",
              os.path.join(HERE, "peers", "torch_gpt.py"), "--rank", str(node * per_host + local), "--world", str(world), "--store", store,
              "--data", data, "--init", init, "--steps", str(GPT_STEPS), "--batch", str(GPT_ROWS * world), "--threads", "1",
              "--timing", out] + (["--zero"] if zero else [])
             for h, node in (("a", 0), ("b", 1)) for local in range(per_host)]
    run_both(argvs, "PyTorch GPT" + (" + ZeroRedundancyOptimizer" if zero else ""))
    with open(out) as f:
        return json.load(f)["median_step_ms"]


def gpt_table(args, build):
    data = os.path.join(build, "data", "fortunes.safetensors")
    torch_ok = subprocess.run(["/usr/bin/python3", "-c", "import torch"], stderr=subprocess.DEVNULL).returncode == 0
    torch_rows = ["PyTorch DDP", "PyTorch DDP + ZeroRedundancyOptimizer"] if torch_ok else []
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o777)
        init = os.path.join(tmp, "init.safetensors")
        run_both([gpt_cmd(build, 1, ["--save-init", init], steps=0)], "gpt_train --save-init")
        nbytes = os.path.getsize(init)  # the fp32 parameters (and a small header)
        for rate in args.rates.split(","):
            sh("rate", NAME, rate)
            for per_host in [int(x) for x in args.ranks_per_host.split(",")]:
                key = "GPT, 2 hosts x %d rank%s, link %s" % (per_host, "s" if per_host > 1 else "", "unshaped" if rate == "off" else rate)
                rows = [r for r in torch_rows + gpt_rows_for(per_host) if not args.only or any(picks(o, r) for o in only_names(args.only))]
                runs = {r: [] for r in rows}
                runs["compute alone (world 1)"] = []
                links = []
                for rep in range(args.reps):  # A B A B
                    links.append(link_rows(build, nbytes=nbytes, per_host=per_host))
                    runs["compute alone (world 1)"].append(median_step(run_both(
                        [["ip", "netns", "exec", NAME + "-a"] + gpt_cmd(build, 1, ["--threads", "1"])], "world 1")))
                    for r in rows:
                        if r.startswith("PyTorch"):
                            runs[r].append(gpt_torch_row(per_host, "Zero" in r, init, data, tmp))
                        else:
                            runs[r].append(gpt_shardflow_row(build, per_host, GPT_ROWS_SHARDFLOW[r], init=init))
                    print("  %s round %d done" % (key, rep + 1), flush=True)
                med = {r: statistics.median(v) for r, v in runs.items()}
                link = {op: statistics.median(l[op] for l in links) for op in links[0]}
                out[key] = {"runs_ms": runs, "median_ms": med, "link_ms": link, "param_bytes": nbytes}
                bound = max(link.get("allreduce", 0.0), med["compute alone (world 1)"])
                print("\n%s: link alone all-reduce of the parameters' bytes %.1f ms; compute alone %.1f ms; bound %.1f ms" %
                      (key, link.get("allreduce", 0), med["compute alone (world 1)"], bound))
                ref, zref = med.get("PyTorch DDP"), med.get("PyTorch DDP + ZeroRedundancyOptimizer")
                for r in rows:
                    print("  %-45s %8.1f ms  %.2fx bound%s%s" % (r, med[r], med[r] / bound, ", %.2fx PyTorch DDP" % (med[r] / ref) if ref else "",
                                                             ", %.2fx PyTorch ZeRO" % (med[r] / zref) if zref else ""), flush=True)
                if args.trace_dir:
                    os.makedirs(args.trace_dir, exist_ok=True)
                    # The best shardflow row once more with a trace, drawn at its median iteration.
                    best = min((r for r in gpt_rows_for(per_host) if r in med and "--python" not in GPT_ROWS_SHARDFLOW[r]), key=lambda r: med[r])
                    stem = os.path.join(tmp, "trace.json")
                    gpt_shardflow_row(build, per_host, GPT_ROWS_SHARDFLOW[best], trace=stem)
                    tag = key.replace("GPT, ", "gpt_").replace(" x ", "x").replace(" ", "_").replace(",", "")
                    png = os.path.join(args.trace_dir, tag + ".png")
                    traces = sorted(os.path.join(tmp, f) for f in os.listdir(tmp) if f.startswith("trace.rank"))
                    subprocess.run(["/usr/bin/python3", os.path.join(HERE, "..", "tools", "trace_plot.py"), *traces, "-o", png], check=True)
                    for t in traces:
                        os.replace(t, os.path.join(args.trace_dir, tag + "." + os.path.basename(t).split(".", 1)[1]))
                    out[key]["trace"] = {"row": best, "png": os.path.relpath(png, os.path.join(HERE, ".."))}
                    print("  trace of '%s' -> %s" % (best, png), flush=True)
        sh("rate", NAME, "off")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.png:
        plot(out, args.png, "")


def plot(out, png, what="MLP "):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = list(out)
    fig, axes = plt.subplots(len(keys), 1, figsize=(10, 2.6 + 0.45 * len(out[keys[0]]["median_ms"]) * len(keys) / 1.6), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        med = out[key]["median_ms"]
        names = list(med)
        colors = ["#999999" if n.startswith("PyTorch") else "#4c72b0" if n.startswith("shardflow") else "#55a868" for n in names]
        ax.barh(names, [med[n] for n in names], color=colors)
        link = out[key]["link_ms"].get("allreduce", 0)
        ax.axvline(link, color="#c44e52", linestyle="--", label="link alone: all-reduce of the model (%.0f ms)" % link)
        ax.axvline(med["compute alone (world 1)"], color="#55a868", linestyle=":", label="compute alone")
        ax.invert_yaxis()
        ax.set_title("%s%s%s, Gloo, median step (ms)" % (what, key, ", 2 hosts x 1 rank" if what else ""), fontsize=10)
        ax.tick_params(axis="y", labelsize=7)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--table", action="store_true", help="the side-by-side table on a rate-limited link (3.)")
    ap.add_argument("--rates", default="1gbit,10gbit,off")
    ap.add_argument("--models", default="512x8,1024x8")
    ap.add_argument("--png")
    ap.add_argument("--gpt", action="store_true", help="the table for examples/gpt_train against bench/peers/torch_gpt.py (4.)")
    ap.add_argument("--ranks-per-host", default="1", help="with --gpt: 1, 2 or 1,2; with --table: 1 or 2 (2: the two-level rows too)")
    ap.add_argument("--only", help="with --gpt or --table: only the rows whose names contain one of these (comma-separated; "
                                   "NAME$: that row alone; commas followed by a space belong to a name)")
    ap.add_argument("--trace-dir", help="with --gpt: trace the best shardflow row of each table and draw it here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("two_hosts: needs root (network namespaces)")
    build = os.path.abspath(args.build)
    sh("up", NAME)
    if args.table or args.gpt:
        try:
            (gpt_table if args.gpt else table)(args, build)
        finally:
            sh("down", NAME)
        return
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
