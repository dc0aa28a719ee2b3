"""What kwok does to the simulated pods: its Stage objects, written into kwok's config.

kwok replaces its built-in pod behaviour with whatever pod stages its config holds, so the
usual lifecycle is spelled out here (placed pods run and turn Ready, a Job's pods then
succeed, deleted pods go away), plus one stage of our own: an engine that exits.

Annotate a running pod with `tessera.dev/simulate-exit-code` (and optionally
`tessera.dev/simulate-exit-message`, its termination message) and kwok turns it into what a
kubelet shows for a container that keeps exiting: not ready, waiting in CrashLoopBackOff,
the last termination with that exit code and message.
"""

from __future__ import annotations

from typing import Any

import yaml

ANNOTATION_EXIT_CODE = "tessera.dev/simulate-exit-code"
ANNOTATION_EXIT_MESSAGE = "tessera.dev/simulate-exit-message"

_NOT_DELETING = {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"}

# A placed pod (kwok sees only pods bound to its nodes) gets addresses, runs and is Ready.
_RUN_TEMPLATE = """\
{{ $now := Now }}
phase: Running
startTime: {{ $now | Quote }}
hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
{{ $host := or .spec.hostNetwork false }}
{{ $uid := or .metadata.uid "" }}
{{ $name := or .metadata.name "" }}
{{ $ns := or .metadata.namespace "" }}
podIP: {{ PodIPWith .spec.nodeName $host $uid $name $ns | Quote }}
conditions:
{{ range list "Initialized" "ContainersReady" "Ready" }}
- type: {{ . }}
  status: "True"
  lastTransitionTime: {{ $now | Quote }}
{{ end }}
{{ range .spec.readinessGates }}
- type: {{ .conditionType | Quote }}
  status: "True"
  lastTransitionTime: {{ $now | Quote }}
{{ end }}
initContainerStatuses:
{{ range .spec.initContainers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  ready: true
  restartCount: 0
  state:
    terminated:
      exitCode: 0
      reason: Completed
      startedAt: {{ $now | Quote }}
      finishedAt: {{ $now | Quote }}
{{ end }}
containerStatuses:
{{ range .spec.containers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  ready: true
  started: true
  restartCount: 0
  state:
    running: {startedAt: {{ $now | Quote }}}
{{ end }}
"""

# A running pod of a Job has done its work.
_SUCCEED_TEMPLATE = """\
{{ $now := Now }}
phase: Succeeded
containerStatuses:
{{ range .spec.containers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  ready: false
  started: false
  restartCount: 0
  state:
    running: null
    terminated:
      exitCode: 0
      reason: Completed
      startedAt: {{ $now | Quote }}
      finishedAt: {{ $now | Quote }}
{{ end }}
"""

# The pod stays Running (restartPolicy Always), its containers exit again and again.
_EXIT_TEMPLATE = """\
{{ $now := Now }}
{{ $code := index .metadata.annotations "EXIT_CODE" }}
{{ $said := or ( index .metadata.annotations "EXIT_MESSAGE" ) "" }}
conditions:
{{ range list "ContainersReady" "Ready" }}
- type: {{ . }}
  status: "False"
  reason: ContainersNotReady
  lastTransitionTime: {{ $now | Quote }}
{{ end }}
containerStatuses:
{{ range .spec.containers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  ready: false
  started: false
  restartCount: 3
  state:
    running: null
    waiting:
      reason: CrashLoopBackOff
      {{ $why := printf "restarting failed container=%s pod=%s" .name $.metadata.name }}
      message: {{ printf "back-off 40s %s" $why | Quote }}
  lastState:
    terminated:
      exitCode: {{ $code }}
      reason: Error
      message: {{ $said | Quote }}
      startedAt: {{ $now | Quote }}
      finishedAt: {{ $now | Quote }}
{{ end }}
""".replace("EXIT_CODE", ANNOTATION_EXIT_CODE).replace("EXIT_MESSAGE", ANNOTATION_EXIT_MESSAGE)


def _stage(name: str, match: list[dict[str, Any]], next_: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage", "metadata": {"name": name},
            "spec": {"resourceRef": {"apiGroup": "v1", "kind": "Pod"},
                     "selector": {"matchExpressions": match}, "next": next_}}


def pod_stages() -> list[dict[str, Any]]:
    return [
        _stage("pod-run", [_NOT_DELETING,
                           {"key": ".status.podIP", "operator": "DoesNotExist"}],
               {"statusTemplate": _RUN_TEMPLATE}),
        _stage("pod-job-succeed", [
            _NOT_DELETING,
            {"key": ".status.phase", "operator": "In", "values": ["Running"]},
            {"key": ".metadata.ownerReferences.[].kind", "operator": "In", "values": ["Job"]},
        ], {"statusTemplate": _SUCCEED_TEMPLATE}),
        # Once: the stage's own status leaves no container ready, so it no longer matches.
        _stage("pod-engine-exit", [
            _NOT_DELETING,
            {"key": f'.metadata.annotations["{ANNOTATION_EXIT_CODE}"]', "operator": "Exists"},
            {"key": ".status.phase", "operator": "In", "values": ["Running"]},
            {"key": ".status.containerStatuses.[].ready", "operator": "In", "values": ["true"]},
        ], {"statusTemplate": _EXIT_TEMPLATE}),
        _stage("pod-delete", [{"key": ".metadata.deletionTimestamp", "operator": "Exists"}],
               {"finalizers": {"empty": True}, "delete": True}),
    ]


def kwok_config() -> str:
    """kwok's --config file: our pod stages (node stages stay kwok's built-in ones)."""
    return yaml.safe_dump_all(pod_stages(), sort_keys=False)
