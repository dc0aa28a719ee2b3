"""Operator benchmark on a fresh local control plane (targets: shared BENCHMARKS.md, "Operator").

Measures, with the real operator process (`tessera operator run`) and simulated H200 nodes:
- apply -> every child object exists, and apply -> Ready, over N deployments one at a time (p50);
- M deployments applied in one `kubectl apply` -> all Ready (seconds);
- the operator's resident memory (peak, sampled every 0.5 s);
- write requests the operator makes during idle resyncs (from the API server's audit log).

Prints a table last; writes bench/results/operator_bench.json.
Usage: python bench/operator_bench.py [--sequential 10] [--burst 100]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import kubernetes
from tessera.operator import constants as c
from tessera.operator.kube import CHILD_KINDS, Kube

from tessera.devcluster import DevCluster, NodePool, ensure_binaries

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "operator_bench.json"
CHILDREN_PER_DEPLOYMENT = 18
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}


def tiny(name: str) -> dict[str, Any]:
    """A small DeepSeek V3-shaped model on one GPU per pod: prefill, 1 decode, router."""
    phase = {"tensorParallel": 1, "kvCache": {"dtype": "fp8_e4m3"}}
    return {
        "apiVersion": "tessera.dev/v1alpha1", "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": name, "contextLength": 8192, "architecture": {
                "preset": "deepseek-v3",
                "config": {"num_hidden_layers": 4, "n_routed_experts": 16}}},
            "engine": {"image": "tessera/runtime:bench"},
            "prefill": {**phase, "weights": {"dtype": "fp8", "uri": "hf://b/fp8"}},
            "decode": {**phase, "weights": {"dtype": "int4", "uri": "hf://b/int4"}},
        },
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class RssSampler(threading.Thread):
    """Peak resident set size of one process, from /proc."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak_kib, self.done = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            try:
                for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        self.peak_kib = max(self.peak_kib, int(line.split()[1]))
            except FileNotFoundError:
                return


class Watcher:
    """Reads the cluster through the Python client (a kubectl process per poll would cost
    more than the latencies being measured)."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kube = Kube(kubernetes.config.new_client_from_config(str(kubeconfig)))

    def count_children(self, namespace: str, name: str) -> int:
        total = 0
        for (api_version, _), plural in CHILD_KINDS.items():
            prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
            total += len(self.kube.request(
                "GET", f"{prefix}/namespaces/{namespace}/{plural}",
                query=[("labelSelector", f"{c.LABEL_DEPLOYMENT}={name}")])["items"])
        return total

    def create(self, namespace: str, md: dict[str, Any]) -> None:
        self.kube.request("POST", f"/apis/{c.API_VERSION_FULL}/namespaces/{namespace}/{c.PLURAL}",
                          md)

    def ready_names(self, namespace: str) -> set[str]:
        items = self.kube.request(
            "GET", f"/apis/{c.API_VERSION_FULL}/namespaces/{namespace}/{c.PLURAL}")["items"]
        return {md["metadata"]["name"] for md in items
                if any(x["type"] == "Ready" and x["status"] == "True"
                       for x in md.get("status", {}).get("conditions", []))}


def wait_until(what: str, check: Any, timeout: float, interval: float = 0.05) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(interval)
    return time.monotonic()


def operator_writes(audit_log: Path, since: int) -> int:
    n = 0
    with audit_log.open("rb") as f:
        f.seek(since)
        for line in f:
            e = json.loads(line)
            agent = e.get("userAgent", "")
            n += (e.get("stage") == "ResponseComplete" and e["verb"] in WRITE_VERBS
                  and (agent.startswith("tessera-operator") or agent.startswith("kopf/")))
    return n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequential", type=int, default=10,
                        help="deployments applied one at a time for the latency p50s")
    parser.add_argument("--burst", type=int, default=100,
                        help="deployments applied at once")
    parser.add_argument("--resync-seconds", type=float, default=10.0)
    args = parser.parse_args()

    # 3 pods per deployment, 2 of them with one GPU: enough 8-GPU nodes for every one.
    gpus = 2 * (args.sequential + args.burst)
    pools = (NodePool("bench", nodes=-(-gpus // 8) + 1),)
    state = Path(tempfile.mkdtemp(prefix="tessera-bench-"))
    rows: dict[str, Any] = {}
    with DevCluster.create(state, ensure_binaries(), pools, timeout=180) as cluster:
        cluster.kubectl("apply", "-f", str(ROOT / "crds" / "modeldeployment.yaml"))
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                        "crd/modeldeployments.tessera.dev")
        log = (state / "operator.log").open("wb")
        op = subprocess.Popen([sys.executable, "-m", "tessera", "operator", "run",
                               "--resync-seconds", str(args.resync_seconds)],
                              env=cluster.env, stdout=log, stderr=subprocess.STDOUT)
        rss = RssSampler(op.pid)
        rss.start()
        try:
            time.sleep(3)  # let it finish starting
            cluster.kubectl("create", "namespace", "seq")
            cluster.kubectl("create", "namespace", "burst")
            watch = Watcher(cluster.kubeconfig)
            to_children, to_ready = [], []
            for i in range(args.sequential):
                name = f"seq-{i}"
                # Created through the client, so kubectl's own start-up is not counted.
                t0 = time.monotonic()
                watch.create("seq", tiny(name))
                t1 = wait_until("children", lambda n=name: watch.count_children(
                    "seq", n) == CHILDREN_PER_DEPLOYMENT, 60)
                t2 = wait_until("Ready", lambda n=name: n in watch.ready_names("seq"), 120)
                to_children.append(t1 - t0)
                to_ready.append(t2 - t0)
            burst = {"apiVersion": "v1", "kind": "List",
                     "items": [tiny(f"burst-{i}") for i in range(args.burst)]}
            load_before = os.getloadavg()[0]
            cpu0 = cpu_seconds(op.pid)
            t0 = time.monotonic()
            cluster.kubectl("apply", "-n", "burst", "-f", "-", input=burst, timeout=300)
            t1 = wait_until("all Ready", lambda: len(watch.ready_names("burst")) == args.burst,
                            600, interval=1.0)
            burst_cpu = cpu_seconds(op.pid) - cpu0
            load_after = os.getloadavg()[0]
            time.sleep(2 * args.resync_seconds)  # settle: late status updates
            since = os.path.getsize(cluster.audit_log)
            time.sleep(3 * args.resync_seconds)
            idle_writes = operator_writes(cluster.audit_log, since)
            resyncs = (state / "operator.log").read_text().count("resync:")
        finally:
            rss.done.set()
            op.terminate()
            op.wait(timeout=30)
        rows = {
            "apply_to_children_p50_s": round(statistics.median(to_children), 3),
            "apply_to_children_all_s": [round(x, 3) for x in to_children],
            "apply_to_ready_p50_s": round(statistics.median(to_ready), 3),
            "apply_to_ready_all_s": [round(x, 3) for x in to_ready],
            "burst_deployments": args.burst,
            "burst_all_ready_s": round(t1 - t0, 2),
            "burst_operator_cpu_s": round(burst_cpu, 1),
            # The machine is shared: the 1-minute load average says how busy it was.
            "burst_load_average_before_after": [round(load_before, 2), round(load_after, 2)],
            "operator_peak_rss_mib": round(rss.peak_kib / 1024, 1),
            "idle_window_s": 3 * args.resync_seconds,
            "idle_writes": idle_writes,
            "resyncs_logged": resyncs,
        }
    result = {
        "benchmark": "operator", "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "cluster": {"nodes": pools[0].nodes, "gpus_per_node": pools[0].gpus_per_node},
        "rows": rows,
        "targets": {"apply_to_children_p50_s": 1.0, "apply_to_ready_p50_s": 5.0,
                    "burst_all_ready_s": 90.0, "operator_peak_rss_mib": 200.0,
                    "idle_writes": 0},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'measure':28} {'value':>10} {'target':>10}")
    for key, target in result["targets"].items():
        print(f"{key:28} {rows[key]:>10} {target:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
