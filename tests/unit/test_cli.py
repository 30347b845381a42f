"""`specserve generate`, called in-process through app.cli.main."""

from __future__ import annotations

import json

import pytest
import yaml

from app.cli import main
from app.config import PROJECT_ROOT

CONFIG = str(PROJECT_ROOT / "configs/engine.yaml")
PROMPT = "def fibonacci(n):\n    "
KEYS = {"text", "token_ids", "drafted_tokens", "accepted_tokens", "elapsed_s"}


def run_json(capsys, *extra: str) -> dict:
    rc = main(["generate", "--config", CONFIG, "--prompt", PROMPT, "--max-tokens", "24", "--json", *extra])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    lines = [line for line in captured.out.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one JSON object on stdout, got {captured.out!r}"
    result = json.loads(lines[0])
    assert isinstance(result, dict) and KEYS <= result.keys()
    return result


def test_json_output_and_greedy_spec_on_off_agree(capsys, tokenizer, encode, plain_greedy, check_against_reference):
    on = run_json(capsys, "--speculation", "on", "--num-speculative-tokens", "5")
    off = run_json(capsys, "--speculation", "off")
    assert on["token_ids"] == off["token_ids"] and len(on["token_ids"]) == 24
    assert on["text"] == off["text"] == tokenizer.decode(on["token_ids"])
    assert on["drafted_tokens"] > 0 and 0 <= on["accepted_tokens"] <= on["drafted_tokens"]
    assert on["num_speculative_tokens"] == 5
    assert off["drafted_tokens"] == off["accepted_tokens"] == 0
    assert isinstance(on["elapsed_s"], float) and on["elapsed_s"] > 0
    assert on["finish_reason"] == "length"
    check_against_reference(plain_greedy(encode(PROMPT), 24), off["token_ids"], off["finish_reason"], "cli")


def test_json_sampled_with_seed_is_reproducible_and_uses_config_k(capsys):
    args = ("--temperature", "0.7", "--top-p", "0.9", "--top-k", "50", "--seed", "5")
    a = run_json(capsys, *args)
    b = run_json(capsys, *args)
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
    assert a["num_speculative_tokens"] == 4  # from configs/engine.yaml


def test_explicit_zero_speculative_tokens_means_plain(capsys):
    out = run_json(capsys, "--speculation", "on", "--num-speculative-tokens", "0")
    assert out["num_speculative_tokens"] == 0 and out["drafted_tokens"] == 0


def test_ngram_config_and_stop(capsys, tmp_path):
    config = yaml.safe_load((PROJECT_ROOT / "configs/engine.yaml").read_text())
    config["speculation"] = {"proposer": "ngram", "num_speculative_tokens": 3}
    del config["draft"]
    path = tmp_path / "ngram.yaml"
    path.write_text(yaml.safe_dump(config))
    rc = main(["generate", "--config", str(path), "--prompt", PROMPT, "--max-tokens", "30", "--stop", " iff", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["finish_reason"] == "stop" and " iff" not in out["text"]


def test_plain_text_output(capsys):
    rc = main(["generate", "--config", CONFIG, "--prompt", PROMPT, "--max-tokens", "8"])
    captured = capsys.readouterr()
    assert rc == 0 and captured.out.startswith(PROMPT)
    assert "8 tokens" in captured.err and "finish: length" in captured.err


@pytest.mark.parametrize(
    "argv,err",
    [
        (["--config", "/nonexistent.yaml"], "No such file"),
        (["--config", CONFIG, "--temperature", "5"], "temperature"),
        (["--config", CONFIG, "--max-tokens", "0"], "max_tokens"),
        (["--config", CONFIG, "--num-speculative-tokens", "-1"], "outside 0..8"),
        (["--config", CONFIG, "--num-speculative-tokens", "99"], "outside 0..8"),
    ],
)
def test_bad_input_exits_2_with_a_message(capsys, argv, err):
    assert main(["generate", *argv, "--prompt", "x"]) == 2
    assert err in capsys.readouterr().err


def test_bad_config_contents(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("target: {path: models/target}\nspeculation: {proposer: ngram, k: 2}\n")
    assert main(["generate", "--config", str(path), "--prompt", "x"]) == 2
    assert "Extra inputs" in capsys.readouterr().err


def test_argparse_rejects_unknown_speculation_value():
    with pytest.raises(SystemExit):
        main(["generate", "--config", CONFIG, "--prompt", "x", "--speculation", "maybe"])
