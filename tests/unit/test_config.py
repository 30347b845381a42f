"""Typed configs: extra keys refused at every level, YAML loading, bad values rejected."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from app.config import (
    PROJECT_ROOT,
    AppConfig,
    DeploymentOptions,
    EngineConfig,
    EngineLimits,
    ModelSpec,
    SamplingParams,
    SpeculationConfig,
    load_engine_config,
    load_yaml,
)

TARGET = {"path": "models/target"}


def test_engine_yaml_loads():
    config = load_engine_config(PROJECT_ROOT / "configs/engine.yaml")
    assert config.target.path == "models/target" and config.target.dtype == "float32"
    assert config.target.device == "cpu" and config.target.num_threads == 2
    assert config.draft is not None and config.draft.path == "models/draft"
    assert config.speculation.proposer == "draft_model"
    assert config.speculation.num_speculative_tokens == 4 and config.speculation.max_speculative_tokens == 8
    assert config.limits == EngineLimits()
    assert config.target.resolved_path() == str(PROJECT_ROOT / "models/target")


def test_app_and_serve_config_shapes_load(tmp_path):
    engine = yaml.safe_load((PROJECT_ROOT / "configs/engine.yaml").read_text())
    app_file = tmp_path / "app.yaml"
    app_file.write_text(yaml.safe_dump({"model_name": "m", "engine": engine}))
    serve_file = tmp_path / "serve.yaml"
    serve_file.write_text(yaml.safe_dump({"applications": [{"name": "a", "args": {"engine": engine}}]}))
    want = load_engine_config(PROJECT_ROOT / "configs/engine.yaml")
    assert load_engine_config(app_file) == want
    assert load_engine_config(serve_file) == want


@pytest.mark.parametrize(
    "model,data",
    [
        (ModelSpec, {**TARGET, "dtyp": "float32"}),
        (SpeculationConfig, {"num_speculative_tokens": 2, "k": 3}),
        (SamplingParams, {"temperature": 0.5, "top_n": 3}),
        (EngineLimits, {"max_batch": 3}),
        (EngineConfig, {"target": TARGET, "speculation": {"proposer": "ngram"}, "extra": 1}),
        (EngineConfig, {"target": {**TARGET, "device_map": "auto"}, "speculation": {"proposer": "ngram"}}),
        (EngineConfig, {"target": TARGET, "speculation": {"proposer": "ngram", "num_spec_tokens": 4}}),
        (DeploymentOptions, {"num_replica": 2}),
        (AppConfig, {"engine": {"target": TARGET, "speculation": {"proposer": "ngram"}}, "router": {}}),
    ],
)
def test_extra_keys_are_refused(model, data):
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        model.model_validate(data)


def test_extra_key_in_yaml_is_refused(tmp_path):
    engine = yaml.safe_load((PROJECT_ROOT / "configs/engine.yaml").read_text())
    engine["speculation"]["num_speculative_token"] = 3  # a typo must not be silently ignored
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(engine))
    with pytest.raises(ValidationError, match="num_speculative_token"):
        load_engine_config(path)


@pytest.mark.parametrize(
    "model,data,match",
    [
        (ModelSpec, {**TARGET, "dtype": "float64"}, "dtype"),
        (ModelSpec, {**TARGET, "max_context": 8}, "max_context"),
        (ModelSpec, {**TARGET, "num_threads": 0}, "num_threads"),
        (ModelSpec, {}, "path"),
        (SpeculationConfig, {"num_speculative_tokens": 0}, "num_speculative_tokens"),
        (SpeculationConfig, {"num_speculative_tokens": 17, "max_speculative_tokens": 16}, "num_speculative_tokens"),
        (SpeculationConfig, {"num_speculative_tokens": 6, "max_speculative_tokens": 5}, "num_speculative_tokens 6 > max"),
        (SpeculationConfig, {"ngram_min": 3, "ngram_max": 2}, "ngram_min 3 > ngram_max 2"),
        (SpeculationConfig, {"proposer": "medusa"}, "proposer"),
        (SamplingParams, {"temperature": -0.1}, "temperature"),
        (SamplingParams, {"temperature": 2.5}, "temperature"),
        (SamplingParams, {"top_p": 0.0}, "top_p"),
        (SamplingParams, {"top_p": 1.5}, "top_p"),
        (SamplingParams, {"top_k": -1}, "top_k"),
        (SamplingParams, {"max_tokens": 0}, "max_tokens"),
        (SamplingParams, {"seed": -1}, "seed"),
        (SamplingParams, {"temperature": "hot"}, "temperature"),
        (EngineLimits, {"max_num_seqs": 0}, "max_num_seqs"),
        (EngineLimits, {"max_queue": -1}, "max_queue"),
        (EngineLimits, {"request_timeout_s": 0}, "request_timeout_s"),
        (EngineConfig, {"target": TARGET}, "no draft model is configured"),
        (DeploymentOptions, {"num_replicas": 2, "autoscaling_config": {"min_replicas": 1}}, "not both"),
    ],
)
def test_bad_values_are_rejected(model, data, match):
    with pytest.raises(ValidationError, match=match):
        model.model_validate(data)


def test_configs_are_frozen_and_greedy_means_temperature_zero():
    params = SamplingParams()
    assert params.greedy and not SamplingParams(temperature=0.7).greedy
    with pytest.raises(ValidationError):
        params.temperature = 1.0  # type: ignore[misc]
    # the default draft_model proposer is fine once a draft is configured; ngram needs none
    EngineConfig(target=ModelSpec(path="models/target"), draft=ModelSpec(path="models/draft"))
    EngineConfig(target=ModelSpec(path="models/target"), speculation=SpeculationConfig(proposer="ngram"))


def test_yaml_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        load_yaml(path)
    with pytest.raises(ValueError, match="expected a mapping"):
        load_engine_config(path)


def test_hub_ids_are_left_alone():
    assert ModelSpec(path="meta-llama/Llama-3.2-1B").resolved_path() == "meta-llama/Llama-3.2-1B"
