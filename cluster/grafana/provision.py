"""Upload the specserve dashboard to a Grafana server through its HTTP API (grafana-client).

    python -m cluster.grafana.provision --url http://127.0.0.1:3000 --token "$GRAFANA_TOKEN" \
        [--folder specserve] [--datasource-url http://127.0.0.1:9090]

- Authentication: a service-account token (`--token`, or the GRAFANA_TOKEN environment
  variable; sent as `Authorization: Bearer ...`), or basic auth in the URL
  (`http://admin:admin@127.0.0.1:3000`).
- The folder is looked up by uid (derived from its title) and created when absent.
- With `--datasource-url`, a Prometheus datasource (uid `specserve-prometheus`) is created when
  absent and made the dashboard's default `${datasource}`.
- The dashboard is posted to /api/dashboards/db with `overwrite: true`, so re-running replaces
  the previous version (Grafana keeps the history).
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
from typing import Any

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError

from cluster.grafana.dashboard import build_dashboard

DEFAULT_DATASOURCE_UID = "specserve-prometheus"
DEFAULT_DATASOURCE_NAME = "specserve Prometheus"
NOT_FOUND = 404


def folder_uid(title: str) -> str:
    """Grafana uids: <= 40 chars of [a-zA-Z0-9_-]."""
    uid = re.sub(r"[^a-zA-Z0-9_-]+", "-", title.strip()).strip("-").lower()[:40]
    if not uid:
        raise ValueError(f"folder title {title!r} gives an empty uid")
    return uid


def ensure_folder(api: GrafanaApi, title: str) -> str:
    uid = folder_uid(title)
    try:
        api.folder.get_folder(uid)
    except GrafanaClientError as err:
        if err.status_code != NOT_FOUND:
            raise
        api.folder.create_folder(title, uid=uid)
    return uid


def ensure_prometheus_datasource(api: GrafanaApi, url: str, uid: str = DEFAULT_DATASOURCE_UID,
                                 name: str = DEFAULT_DATASOURCE_NAME) -> str:
    try:
        api.datasource.get_datasource_by_uid(uid)
    except GrafanaClientError as err:
        if err.status_code != NOT_FOUND:
            raise
        api.datasource.create_datasource({
            "uid": uid, "name": name, "type": "prometheus", "access": "proxy", "url": url,
            "isDefault": False, "jsonData": {"httpMethod": "POST", "timeInterval": "10s"},
        })
    return uid


def with_default_datasource(dashboard: dict[str, Any], datasource_uid: str) -> dict[str, Any]:
    """Preselect `datasource_uid` in the dashboard's `${datasource}` variable."""
    out = copy.deepcopy(dashboard)
    for var in out["templating"]["list"]:
        if var["name"] == "datasource":
            var["current"] = {"selected": True, "text": datasource_uid, "value": datasource_uid}
    return out


def provision(api: GrafanaApi, folder: str, datasource_url: str | None = None,
              dashboard: dict[str, Any] | None = None) -> dict[str, Any]:
    """Create folder (and datasource) if absent, upload the dashboard; returns Grafana's answer."""
    dash = dashboard if dashboard is not None else build_dashboard()
    if datasource_url:
        dash = with_default_datasource(dash, ensure_prometheus_datasource(api, datasource_url))
    uid = ensure_folder(api, folder)
    payload = {"dashboard": dash, "folderUid": uid, "overwrite": True,
               "message": "provisioned by cluster.grafana.provision"}
    result: dict[str, Any] = api.dashboard.update_dashboard(payload)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Upload the specserve Grafana dashboard.")
    parser.add_argument("--url", required=True, help="Grafana base URL, e.g. http://127.0.0.1:3000")
    parser.add_argument("--token", default=os.environ.get("GRAFANA_TOKEN"),
                        help="service-account token (default: $GRAFANA_TOKEN)")
    parser.add_argument("--folder", default="specserve", help="folder title (created if absent)")
    parser.add_argument("--datasource-url", default=None,
                        help="create a Prometheus datasource with this URL if absent")
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args(argv)

    api = GrafanaApi.from_url(args.url, credential=args.token, timeout=args.timeout)
    api.connect()  # GET /api/health: fail early with a clear error if the URL is wrong
    result = provision(api, args.folder, args.datasource_url)
    print(f"dashboard {result.get('uid')} version {result.get('version')}: "
          f"{result.get('status')} {result.get('url', '')}", file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
