"""A bound Application for `serve build`, which imports an Application object (not a builder):

    serve build deployments.local_app:app -o serve_local.yaml   # then: serve deploy serve_local.yaml

It is configs/local.yaml's application; for other configs use `serve deploy <config>.yaml`
(import_path: deployments.builder:build_app with `args:`).
"""

from app.config import PROJECT_ROOT
from deployments.builder import build_app

app = build_app({"config": str(PROJECT_ROOT / "configs" / "local.yaml")})
