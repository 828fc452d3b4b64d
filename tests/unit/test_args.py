"""Flags, their KVPARK_* environment twins and the llama.cpp aliases."""

import pytest

from kvpark.pod.args import parse_args


def test_defaults():
    args = parse_args([], env={})
    assert (args.parallel, args.page_size, args.batch_size) == (4, 16, 512)
    assert args.preempt and args.preempt_ram == "8192" and args.preempt_every == 0


def test_environment_and_aliases_and_flags_win():
    env = {"KVPARK_PARALLEL": "6", "LLAMA_ARG_PREEMPT_RAM": "0", "LLAMA_ARG_PREEMPT": "false",
           "LLAMA_SERVER_PREEMPT_EVERY": "9", "KVPARK_API_KEY": "hunter2-secret"}
    args = parse_args([], env=env)
    assert (args.parallel, args.preempt_ram, args.preempt, args.preempt_every) == (6, "0", False, 9)
    assert parse_args(["-np", "2", "--preempt"], env=env).parallel == 2
    assert parse_args(["--preempt"], env=env).preempt is True
    assert args.api_key == "hunter2-secret"
    assert "hunter2" not in repr(args)  # the API key never reaches a log


def test_service_link_variables_are_ignored():
    assert parse_args([], env={"KVPARK_PORT": "tcp://10.0.0.7:8080"}).port == 8080


def test_bad_preempt_ram_is_refused():
    with pytest.raises(SystemExit):
        parse_args(["--preempt-ram", "-2"], env={})
    with pytest.raises(SystemExit):
        parse_args(["--preempt-ram", "lots"], env={})
    assert parse_args(["--preempt-ram", "auto"], env={}).preempt_ram == "auto"


def test_weights_flag_and_its_reach():
    import torch

    from kvpark.pod.model.llama import WeightFormat
    from kvpark.pod.server import pick_weight_format

    assert parse_args([], env={}).weights == "auto"
    assert parse_args([], env={"KVPARK_WEIGHTS": "bf16"}).weights == "bf16"
    with pytest.raises(SystemExit):
        parse_args([], env={"KVPARK_WEIGHTS": "int4"})
    with pytest.raises(SystemExit):
        parse_args(["--weights", "int4"], env={})
    bf16 = parse_args(["--weights", "bf16"], env={})
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pick_weight_format(bf16, cpu, torch.float32) is WeightFormat.BF16
    # a bf16 model, or CUDA, already computes in its dtype: nothing to reformat
    assert pick_weight_format(bf16, cpu, torch.bfloat16) is WeightFormat.FP32
    assert pick_weight_format(bf16, cuda, torch.bfloat16) is WeightFormat.FP32
    assert pick_weight_format(parse_args([], env={}), cpu, torch.float32) is WeightFormat.FP32


def test_input_limits_from_flags_and_environment():
    from kvpark.pod.protocol import CHARS_PER_TOKEN, InputLimits

    args = parse_args([], env={})
    assert (args.max_messages, args.max_prompt_chars) == (4096, 0)
    env = {"KVPARK_MAX_MESSAGES": "10", "KVPARK_MAX_PROMPT_CHARS": "5000"}
    args = parse_args([], env=env)
    assert (args.max_messages, args.max_prompt_chars) == (10, 5000)
    assert parse_args(["--max-messages", "3"], env=env).max_messages == 3
    for argv, bad_env in ((["--max-messages", "0"], {}), (["--max-prompt-chars", "-1"], {}),
                          ([], {"KVPARK_MAX_PROMPT_CHARS": "-1"})):
        with pytest.raises(SystemExit):
            parse_args(argv, env=bad_env)
    assert InputLimits.of(1024, 4096).max_prompt_chars == CHARS_PER_TOKEN * 1024
    assert InputLimits.of(1024, 4096, 5000).max_prompt_chars == 5000
