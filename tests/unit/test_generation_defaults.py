"""Server-wide sampling defaults: where each comes from, what wins, and that a request's own
fields always do."""

import json

import pytest

from kvpark.pod.args import parse_args
from kvpark.pod.requests.generation_defaults import (
    build_defaults,
    config_file,
    defaults_for,
    from_generation_config,
    parse_override,
)


def test_flags_become_request_fields_in_llama_servers_meanings():
    args = parse_args(["--temp", "0.3", "--top-k", "7", "--top-p", "0.9", "--min-p", "0.1",
                       "-s", "42", "-n", "12", "--repeat-penalty", "1.1", "--repeat-last-n",
                       "32", "--presence-penalty", "0.5", "--frequency-penalty", "0.25",
                       "-m", "synthetic:tiny"], env={})
    assert dict(defaults_for(args).fields) == {
        "temperature": 0.3, "top_k": 7, "top_p": 0.9, "min_p": 0.1, "seed": 42,
        "max_tokens": 12, "repeat_penalty": 1.1, "repeat_last_n": 32,
        "presence_penalty": 0.5, "frequency_penalty": 0.25}


def test_llama_servers_off_values_set_nothing():
    args = parse_args(["-s", "-1", "-n", "-1", "-m", "synthetic:tiny"], env={})
    assert dict(defaults_for(args).fields) == {}


def test_no_flags_no_defaults():
    assert dict(defaults_for(parse_args(["-m", "synthetic:tiny"], env={})).fields) == {}


def test_flags_also_read_the_environment():
    args = parse_args(["-m", "synthetic:tiny"], env={"KVPARK_TEMP": "0", "KVPARK_SEED": "9"})
    assert dict(defaults_for(args).fields) == {"temperature": 0.0, "seed": 9}


def test_a_request_field_wins_and_null_means_the_default():
    defaults = build_defaults([("flag", {"temperature": 0.0, "max_tokens": 5})])
    body = {"temperature": 0.7, "max_tokens": None, "prompt": "x"}
    assert defaults.under(body, 100) == {"temperature": 0.7, "max_tokens": 5, "prompt": "x"}
    assert body == {"temperature": 0.7, "max_tokens": None, "prompt": "x"}  # not mutated


def test_a_default_max_tokens_never_exceeds_the_context():
    defaults = build_defaults([("flag", {"max_tokens": 5000})])
    assert defaults.under({}, 2048)["max_tokens"] == 2048


def test_precedence_generation_config_then_override_then_flags(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.5, "max_new_tokens": 9, "do_sample": True,
         "eos_token_id": 2}))
    args = parse_args(["-m", "synthetic:tiny", "--generation-config", str(tmp_path),
                       "--override-generation-config", '{"temperature": 0, "max_new_tokens": 6}',
                       "-n", "3"], env={})
    defaults = defaults_for(args)
    assert dict(defaults.fields) == {"temperature": 0, "top_p": 0.5, "max_tokens": 3}
    assert defaults.sources["top_p"].startswith("generation config")
    assert defaults.sources["temperature"] == "--override-generation-config"
    assert defaults.sources["max_tokens"] == "flag"


def test_auto_reads_a_model_directorys_own_config_and_vllm_reads_none(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"top_k": 20}')
    assert config_file("auto", str(tmp_path)) == str(tmp_path / "generation_config.json")
    assert config_file("auto", "model.gguf") is None
    assert config_file("vllm", str(tmp_path)) is None
    assert from_generation_config(str(tmp_path / "missing.json")) == {}


def test_bad_generation_configs_are_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="no generation_config.json"):
        config_file(str(tmp_path), None)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        from_generation_config(str(tmp_path / "generation_config.json"))
    with pytest.raises(ValueError, match="unknown key.*bogus"):
        parse_override('{"bogus": 1}')
    with pytest.raises(ValueError, match="JSON object"):
        parse_override("[1]")
