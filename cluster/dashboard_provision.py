"""``flexspec dashboard provision``: upload the dashboard (``cluster/dashboard.py``) and a Prometheus datasource to a
Grafana server through ``grafana-client`` (the ``[ops]`` extra), creating or updating both in place."""

from __future__ import annotations

import copy
from typing import Any

from cluster.dashboard import DATASOURCE_VAR, build_dashboard


def provision(
    grafana_url: str,
    prometheus_url: str,
    credential: str | tuple[str, str] | None = None,
    datasource_name: str = "flexspec-prometheus",
    folder: str | None = "flexspec",
    timeout_s: float = 10.0,
) -> dict[str, Any]:
    """Create or update a Prometheus datasource and the dashboard in Grafana; returns Grafana's dashboard reply.

    Idempotent: the datasource (uid = ``datasource_name``), the folder and the dashboard (uid
    ``flexspec-overview``) are updated in place when they exist. The dashboard's data-source variable defaults to
    the uploaded datasource.

    Args:
        credential: an API key / service-account token, a ``(user, password)`` pair, or None (credentials in the
            URL, or anonymous).

    Raises:
        grafana_client.client.GrafanaException: Grafana refused a request (e.g. 401 for a bad key).
        requests.RequestException: Grafana is unreachable.
    """
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaClientError

    api = GrafanaApi.from_url(grafana_url, credential=credential, timeout=timeout_s)
    datasource = {
        "uid": datasource_name,
        "name": datasource_name,
        "type": "prometheus",
        "access": "proxy",
        "url": prometheus_url,
        "jsonData": {"httpMethod": "POST"},
    }
    try:
        api.datasource.get_datasource_by_uid(datasource_name)
        api.datasource.update_datasource_by_uid(datasource_name, datasource)
    except GrafanaClientError as e:
        if e.status_code != 404:
            raise
        api.datasource.create_datasource(datasource)
    payload: dict[str, Any] = {
        "dashboard": with_default_datasource(build_dashboard(), datasource_name),
        "overwrite": True,
        "message": "flexspec dashboard provision",
    }
    if folder:
        try:
            api.folder.get_folder(folder)
        except GrafanaClientError as e:
            if e.status_code != 404:
                raise
            api.folder.create_folder(folder, uid=folder)
        payload["folderUid"] = folder
    return api.dashboard.update_dashboard(payload)


def with_default_datasource(dashboard: dict[str, Any], datasource_uid: str) -> dict[str, Any]:
    """A copy of ``dashboard`` whose data-source variable starts on ``datasource_uid``."""
    out = copy.deepcopy(dashboard)
    for var in out["templating"]["list"]:
        if var["name"] == DATASOURCE_VAR:
            var["current"] = {"text": datasource_uid, "value": datasource_uid}
    return out
