"""The thin adapter to the API server: apply, delete, list, patch status, post an event.

Every call goes through here, and every (group, resource, verb) it uses is in
constants.RBAC_RULES.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, NamedTuple

import kubernetes
from tessera.operator import constants as c
from tessera.operator.refusals import (
    NamespaceGone,
    RejectedError,
    Rejection,
    api_message,
    is_refusal,
    namespace_gone,
)

Obj = dict[str, Any]


class Listing(NamedTuple):
    items: list[Obj]
    version: str  # the list's resourceVersion: it shows every change up to this one

log = logging.getLogger(__name__)

# Child kinds: (apiVersion, kind) -> plural resource name. All namespaced.
CHILD_KINDS: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("apps/v1", "Deployment"): "deployments",
    (c.LWS_API_VERSION, c.LWS_KIND): c.LWS_PLURAL,  # served only where LWS is installed
    ("batch/v1", "Job"): "jobs",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
}
# What the store holds of the cluster besides deployments and events: the children and their
# pods (read for what the scheduler and the engines say; a stranded group's leader is deleted).
PLURALS = {**CHILD_KINDS, ("v1", "Pod"): "pods"}
USER_AGENT = "tessera-operator"


def _collection(api_version: str, plural: str, namespace: str | None) -> str:
    prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"


def _path(obj: Obj) -> str:
    plural = PLURALS[(obj["apiVersion"], obj["kind"])]
    meta = obj["metadata"]
    return f"{_collection(obj['apiVersion'], plural, meta['namespace'])}/{meta['name']}"


def new_api_client(retries: bool = True) -> kubernetes.client.ApiClient:
    """A client from the in-cluster service account, else from KUBECONFIG / ~/.kube/config.
    With `retries=False` a failed request raises at once, for a caller that keeps its own
    time (the leader Lease); urllib3 would otherwise retry it, each time with a new timeout."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    config = kubernetes.client.Configuration.get_default_copy()
    if not retries:
        config.retries = False
    client = kubernetes.client.ApiClient(config)
    client.user_agent = USER_AGENT
    return client


def _refused(e: kubernetes.client.ApiException, kind: str, name: str) -> Exception:
    """What a failed write to `kind` `name` raises: NamespaceGone when its namespace is going,
    RejectedError when the API server says no, else the error itself (a passing failure)."""
    said = api_message(e.body, str(e.reason))
    if namespace_gone(e.body):
        return NamespaceGone(said)
    if e.status is None or not is_refusal(e.status):
        return e
    return RejectedError(Rejection(kind, name, e.status, said))


class Kube:
    def __init__(self, client: kubernetes.client.ApiClient) -> None:
        self._client = client

    def request(self, method: str, path: str, body: Any = None,
                query: list[tuple[str, str]] | None = None,
                content_type: str = "application/json", timeout: float | None = None) -> Any:
        """One API call; the decoded JSON answer. Raises kubernetes.client.ApiException, or
        urllib3's errors when the API server cannot be reached within `timeout` seconds."""
        params = self._client.param_serialize(
            method=method, resource_path=path, query_params=query or [], body=body,
            header_params={"Accept": "application/json", "Content-Type": content_type},
            auth_settings=["BearerToken"])
        response = self._client.call_api(*params, _request_timeout=timeout)
        response.read()
        return self._client.response_deserialize(response, {"2XX": "object"}).data

    def apply(self, obj: Obj) -> Obj:
        """Server-side apply under the one field manager; forced, so our fields win back.
        Raises RejectedError, quoting the API server, when it refuses the object."""
        try:
            return self.request("PATCH", _path(obj), obj,
                                [("fieldManager", c.FIELD_MANAGER), ("force", "true")],
                                "application/apply-patch+yaml")
        except kubernetes.client.ApiException as e:
            raise _refused(e, obj["kind"], obj["metadata"]["name"]) from None

    def delete(self, obj: Obj) -> None:
        """Raises RejectedError, quoting the API server, when it refuses; one already gone
        is deleted."""
        try:
            self.request("DELETE", _path(obj), {"propagationPolicy": "Background"})
        except kubernetes.client.ApiException as e:
            if e.status != 404:
                raise _refused(e, obj["kind"], obj["metadata"]["name"]) from None

    def serves(self, api_version: str, plural: str) -> bool:
        """Whether the API server serves `plural` in `api_version` (discovery; a cluster
        without a CRD answers 404 for its group)."""
        path = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
        try:
            resources = self.request("GET", path).get("resources", [])
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return False
            raise
        return any(r.get("name") == plural for r in resources)

    def list_labelled(self, api_version: str, kind: str, plural: str,
                      selector: str) -> Listing:
        """Every object of this kind in the cluster (all namespaces) matching `selector`;
        none where the cluster does not serve the kind (an optional CRD such as LWS)."""
        path = _collection(api_version, plural, None)
        try:
            listed = self.request("GET", path, query=[("labelSelector", selector)])
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return Listing([], "")
            raise
        # List items come without apiVersion/kind; put them back so items look like watch events.
        return Listing([{"apiVersion": api_version, "kind": kind, **item}
                        for item in listed["items"]],
                       listed.get("metadata", {}).get("resourceVersion", ""))

    def patch_status(self, md: Obj, patch: Obj) -> Obj | None:
        """The patched ModelDeployment; None when it is gone (deleted since it was read).
        Raises RejectedError, quoting the API server, when it refuses the write."""
        meta = md["metadata"]
        path = (f"{_collection(c.API_VERSION_FULL, c.PLURAL, meta['namespace'])}/"
                f"{meta['name']}/status")
        try:
            return self.request("PATCH", path, {"status": patch}, content_type=(
                "application/merge-patch+json"))
        except kubernetes.client.ApiException as e:
            if e.status != 404:
                raise _refused(e, c.KIND, meta["name"]) from None
            return None

    def post_event(self, md: Obj, type_: str, reason: str, message: str) -> None:
        meta = md["metadata"]
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": c.API_VERSION_FULL, "kind": c.KIND,
                               "name": meta["name"], "namespace": meta["namespace"],
                               "uid": meta["uid"]},
            "type": type_, "reason": reason, "message": message[:1024],
            "source": {"component": c.FIELD_MANAGER},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        try:
            self.request("POST", _collection("v1", "events", meta["namespace"]), event)
        except kubernetes.client.ApiException as e:
            # An event is a courtesy, status is the record: one the API server refuses (its
            # namespace being deleted, a quota on events) is dropped with one line.
            if e.status is None or not (is_refusal(e.status) or e.status == 404):
                raise
            log.info("%s/%s: event %s not posted: %s", meta["namespace"], meta["name"], reason,
                     api_message(e.body, str(e.reason)))
