"""The operator when the API server goes away, against the real local control plane.

The outage is the API server process stopped (SIGSTOP) and resumed (SIGCONT): connections
are still accepted but nothing answers, as when it hangs or the network drops its replies.
A stop and restart of the process would cost its start-up (tens of seconds on a busy
machine), longer than the few seconds a leader may go without renewing its Lease.

- A short outage: the leader keeps going, retries its Lease, and reconciles afterwards.
- A long one: the leader cannot renew before its Lease could expire, so it exits (its
  Deployment restarts it); the restarted operator converges with no duplicate children.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from tessera.operator import leader
from test_operator_e2e import (
    Operator,
    apply,
    children,
    pod_uids,
    poll,
    tiny,
    wait_ready,
)

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def crd(cluster: Any) -> None:
    cluster.kubectl("apply", "-f", str(ROOT / "crds" / "modeldeployment.yaml"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/modeldeployments.tessera.dev")


@contextmanager
def api_server_paused(cluster: Any) -> Iterator[None]:
    (apiserver,) = (p for p in cluster.processes if p.name == "kube-apiserver")
    os.kill(apiserver.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(apiserver.pid, signal.SIGCONT)


def lease_renewed_at(kubectl: Any, namespace: str) -> datetime.datetime:
    lease = json.loads(kubectl("get", "lease", "tessera-operator", "-n", namespace,
                               "-o", "json").stdout)
    return datetime.datetime.fromisoformat(lease["spec"]["renewTime"])


def electing(cluster: Any, namespace: str, log: Path) -> Operator:
    return Operator(cluster.env, log, "--leader-election", f"{namespace}/tessera-operator")


def test_a_short_outage_is_ridden_out(cluster: Any, kubectl: Any, namespace: str,
                                      tmp_path: Path) -> None:
    op = electing(cluster, namespace, tmp_path / "operator.log")
    op.start()
    try:
        apply(kubectl, namespace, tiny("calm"))
        wait_ready(kubectl, namespace, "calm")
        offset = len(op.log.read_bytes())
        # Pause from just before the next renewal (at the last one + RENEW_SECONDS) for 5 s:
        # that renewal times out (2 s) while the API server is paused, even if it starts up
        # to 2 s late on a busy machine; the retry, 2 s later, is answered once it resumes,
        # before the renew deadline (10 s after the last renewal).
        renewal = lease_renewed_at(kubectl, namespace) + datetime.timedelta(
            seconds=leader.RENEW_SECONDS)
        until = (renewal - datetime.datetime.now(datetime.UTC)).total_seconds()
        if until < 1.0:  # too close to aim at: take the one after
            until += leader.RENEW_SECONDS
        time.sleep(until - 0.5)
        with api_server_paused(cluster):
            time.sleep(leader.RETRY_SECONDS + 3)
        poll("the lease renewed again", lambda: "renewed lease" in op.text(offset), timeout=30)
        assert op.proc is not None and op.proc.poll() is None, op.text(offset)[-3000:]

        changed = tiny("calm")
        changed["spec"]["decode"]["replicas"] = 1
        apply(kubectl, namespace, changed)
        poll("decode scaled to 1 after the outage",
             lambda: len(pod_uids(kubectl, namespace, "decode")) == 1, timeout=60)
        log = op.text(offset)
        assert "renewing lease" in log and "retrying in" in log
        assert "Traceback" not in log, log[-3000:]
    finally:
        op.stop()


def test_a_leader_that_cannot_renew_exits_and_its_restart_converges(
        cluster: Any, kubectl: Any, namespace: str, tmp_path: Path) -> None:
    first = electing(cluster, namespace, tmp_path / "first.log")
    first.start()
    try:
        apply(kubectl, namespace, tiny("outage"))
        # Cut the API server off while the children are still being applied.
        poll("a first child", lambda: children(kubectl, namespace, "outage"), timeout=30)
        with api_server_paused(cluster):
            assert first.proc is not None
            proc = first.proc
            poll("the leader to give up", lambda: proc.poll() is not None,
                 timeout=leader.RENEW_DEADLINE_SECONDS + 2 * leader.RETRY_SECONDS + 10)
    finally:
        first.stop()
    assert first.proc.returncode == 1
    log = first.text()
    assert "could not renew lease" in log and "exiting" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    partial = children(kubectl, namespace, "outage")

    # What the Deployment does: start it again. It waits for the old Lease to expire.
    second = electing(cluster, namespace, tmp_path / "second.log")
    second.start()
    try:
        wait_ready(kubectl, namespace, "outage")
        final = children(kubectl, namespace, "outage")
        assert len(final) == 18 and len(set(final)) == 18 and set(partial) <= set(final)
        for phase, want in (("prefill", 1), ("decode", 2), ("router", 1)):
            assert len(pod_uids(kubectl, namespace, phase)) == want, phase
        replicasets = json.loads(kubectl("get", "replicasets", "-n", namespace, "-o",
                                         "json").stdout)["items"]
        assert len(replicasets) == 3  # one per Deployment: no template was re-created
        assert "Traceback" not in second.text()
    finally:
        second.stop()
