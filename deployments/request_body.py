"""Request bodies: a raw JSON body parsed into an OpenAI request model, with a 400 whose `param`
names the field (never FastAPI's 422), and the OpenAPI schema of the handlers that parse so."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from app.protocol.openai_api import UNKNOWN_FIELD
from deployments.request_run import RequestError


def _inline_refs(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline_refs(defs[ref.rsplit("/", 1)[1]], defs)
        return {k: _inline_refs(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline_refs(v, defs) for v in node]
    return node


def json_body(model) -> dict[str, Any]:
    """OpenAPI request body for a handler that parses its raw Request (to answer 400, not 422)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": _inline_refs(schema, defs)}}}}


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc: tuple) -> str | None:
    """The request field a validation error is about: pydantic puts union members in the loc
    ("prompt.str", "prompt.list[int].0"); OpenAI's `param` names only the field ("prompt")."""
    parts: list[str] = []
    for p in loc:
        if isinstance(p, str) and (p in _UNION_TAGS or "[" in p):
            break
        parts.append(str(p))
    return ".".join(parts) or None


def parse_body(raw: bytes, model: Any) -> Any:
    """The body as `model` (or as the model `model(data)` picks), or a RequestError 400 naming the field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError(400, "request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise RequestError(400, "request body must be a JSON object")
    try:  # a "\ud800" escape decodes to a lone surrogate, which the tokenizer cannot take
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(400, "request body contains a lone UTF-16 surrogate escape") from None
    except RecursionError:
        raise RequestError(400, "request body is nested too deeply") from None
    if not isinstance(model, type):
        model = model(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        err = errors[0]
        param = _param(err.get("loc", ()))
        msg = UNKNOWN_FIELD if err.get("type") == "extra_forbidden" else str(err.get("msg"))
        if param and len(err.get("loc", ())) > param.count(".") + 1:  # a union: what each member wanted
            n = param.count(".") + 1
            msg = "; ".join(f"as {'.'.join(map(str, x['loc'][n:]))}: {x['msg']}"
                            for x in errors if _param(x.get("loc", ())) == param)
        raise RequestError(400, f"{param}: {msg}" if param else msg, param) from None
    except RecursionError:
        raise RequestError(400, "request body is nested too deeply") from None
