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

    from kvpark.kernels.cpu_features import CpuFeatures
    from kvpark.pod.model.linear import WeightFormat
    from kvpark.pod.serving.choices import pick_weight_format

    assert parse_args([], env={}).weights == "auto"
    assert parse_args([], env={"KVPARK_WEIGHTS": "bf16"}).weights == "bf16"
    with pytest.raises(SystemExit):
        parse_args([], env={"KVPARK_WEIGHTS": "int4"})
    with pytest.raises(SystemExit):
        parse_args(["--weights", "int4"], env={})
    bf16 = parse_args(["--weights", "bf16"], env={})
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # a CPU with oneDNN's bf16 GEMMs (test_cpu_features.py: one without them keeps fp32)
    avx512 = CpuFeatures("x86_64", frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                                              "avx512dq"}), torch_bf16_gemm=True)
    assert pick_weight_format(bf16, cpu, torch.float32, avx512) is WeightFormat.BF16
    # a bf16 model, or CUDA, already computes in its dtype: nothing to reformat
    assert pick_weight_format(bf16, cpu, torch.bfloat16) is WeightFormat.FP32
    assert pick_weight_format(bf16, cuda, torch.bfloat16) is WeightFormat.FP32
    assert pick_weight_format(parse_args(["--weights", "fp32"], env={}), cpu,
                              torch.float32) is WeightFormat.FP32


def test_amx_picks_tile_linears_for_prompt_rows_only_where_they_run(monkeypatch):
    """The defaults take amx-bf16 linears where AMX runs, float32 elsewhere; `--amx off` keeps
    float32 there, `--amx on` refuses a machine without it; `--weights fp32` stays exact."""
    import torch

    from kvpark.kernels import amx_gemm
    from kvpark.pod.model.linear import WeightFormat
    from kvpark.pod.serving.choices import pick_weight_format

    cpu = torch.device("cpu")

    def pick(*argv: str) -> WeightFormat:
        return pick_weight_format(parse_args(list(argv), env={}), cpu, torch.float32)

    for runs in (True, False):
        monkeypatch.setattr(amx_gemm, "usable", lambda runs=runs: runs)
        amx = WeightFormat.AMX_BF16 if runs else WeightFormat.FP32
        assert pick() is amx and pick("--weights", "gguf") is amx
        assert pick("--amx", "off") is WeightFormat.FP32
        assert pick("--weights", "fp32", "--amx", "on") is WeightFormat.FP32
        assert pick_weight_format(parse_args([], env={}), cpu, torch.bfloat16) is WeightFormat.FP32
    assert parse_args([], env={"KVPARK_AMX": "off"}).amx == "off"
    monkeypatch.setattr(amx_gemm, "usable", lambda: True)
    assert pick("--amx", "on") is WeightFormat.AMX_BF16
    monkeypatch.setattr(amx_gemm, "usable", lambda: False)
    with pytest.raises(ValueError, match="--amx on"):
        pick("--amx", "on")


def refused(capsys, argv, env):
    """parse_args exits 2 with one line on stderr; that line."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, env=env)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(("env", "words"), [
    ({"KVPARK_PARALLEL": "0"}, ["KVPARK_PARALLEL", "positive"]),
    ({"KVPARK_PORT": "abc"}, ["KVPARK_PORT", "integer", "'abc'"]),
    ({"KVPARK_PORT": "70000"}, ["KVPARK_PORT", "65535"]),
    ({"KVPARK_PREEMPT_HIGH": "150"}, ["KVPARK_PREEMPT_HIGH", "percentage"]),
    ({"KVPARK_CTX_SIZE": "-5"}, ["KVPARK_CTX_SIZE", "positive"]),
    ({"KVPARK_WEIGHTS": "int4"}, ["KVPARK_WEIGHTS", "'int4'"]),
    ({"KVPARK_PREEMPT": "maybe"}, ["KVPARK_PREEMPT", "'maybe'"]),
    ({"LLAMA_ARG_PREEMPT_RAM": "-7"}, ["LLAMA_ARG_PREEMPT_RAM", ">= -1"]),
    ({"KVPARK_SHUTDOWN_TIMEOUT": "soon"}, ["KVPARK_SHUTDOWN_TIMEOUT", "'soon'"]),
    ({"KVPARK_PREEMPT_LOW": "99"}, ["--preempt-low", "--preempt-high"]),
])
def test_environment_values_pass_the_flag_checks(capsys, env, words):
    line = refused(capsys, [], env)
    assert line.startswith("kvpark-server: error: ")
    assert all(word in line for word in words), line


def test_flags_and_environment_share_one_range_check(capsys):
    assert "positive" in refused(capsys, ["-np", "0"], {})
    assert "percentage" in refused(capsys, ["--preempt-high", "150"], {})
    assert "65535" in refused(capsys, ["--port", "70000"], {})
    assert parse_args([], env={"KVPARK_PREEMPT_HIGH": "90", "KVPARK_PORT": "9000"}).port == 9000


def test_environment_booleans_and_empty_values():
    assert parse_args([], env={"KVPARK_PREEMPT": "off"}).preempt is False
    assert parse_args([], env={"KVPARK_CUDA_GRAPH": "Yes"}).cuda_graph is True
    assert parse_args([], env={"KVPARK_PARALLEL": ""}).parallel == 4  # empty: unset


def test_abbreviated_flags_are_refused(capsys):
    assert "--ctx" in refused(capsys, ["--ctx", "262144"], {})
    assert parse_args(["--ctx-size", "262144"], env={}).ctx_size == 262144


def test_admin_key_never_reaches_a_log():
    args = parse_args([], env={"KVPARK_ADMIN_KEY": "adm1n-secret"})
    assert args.admin_key == "adm1n-secret" and "adm1n" not in repr(args)


def test_input_limits_from_flags_and_environment():
    from kvpark.pod.requests.input_limits import CHARS_PER_TOKEN, InputLimits

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


def test_a_model_path_that_cannot_load_is_refused_before_start(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "empty").mkdir()
    for model, why in ((tmp_path / "missing.gguf", "no such file"),
                       (tmp_path / "notes.txt", "expected a .gguf file"),
                       (tmp_path / "empty", "without config.json")):
        with pytest.raises(SystemExit) as exited:
            parse_args(["-m", str(model)], env={})
        err = capsys.readouterr().err
        assert exited.value.code == 2 and why in err and len(err.strip().splitlines()) == 1
    assert parse_args(["-m", "synthetic:tiny"], env={}).model == "synthetic:tiny"


def test_served_names_and_cors_origins_are_repeatable_or_comma_lists():
    args = parse_args(["--served-model-name", "a, b", "--served-model-name", "c",
                       "--cors-origin", "https://x.example"], env={})
    assert args.served_model_name == ("a", "b", "c")
    assert args.cors_origin == ("https://x.example",)
    env = {"KVPARK_SERVED_MODEL_NAME": "e1,e2"}
    assert parse_args([], env=env).served_model_name == ("e1", "e2")
    assert parse_args(["--served-model-name", "f"], env=env).served_model_name == ("f",)
    assert parse_args([], env={}).served_model_name == ()


@pytest.mark.parametrize("flag, most", [("--threads", 512), ("--kernel-threads", 64)])
def test_thread_counts_past_the_limit_are_refused_with_the_range(flag, most, capsys):
    """--threads 99999 hung the start-up in OpenMP; the C pool has 64 threads at most."""
    dest = flag.lstrip("-").replace("-", "_")
    assert getattr(parse_args([flag, str(most)], env={}), dest) == most
    with pytest.raises(SystemExit) as exc:
        parse_args([flag, str(most + 1)], env={})
    assert exc.value.code == 2
    assert f"must be 0..{most}, got {most + 1}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([], env={f"KVPARK_{dest.upper()}": "99999"})


def test_more_threads_than_cores_is_warned(monkeypatch, caplog):
    import logging

    from kvpark.kernels.cores import Cores
    from kvpark.pod.worker import autotune

    monkeypatch.setattr(autotune, "usable_cores", lambda: Cores(2, "CPU quota 1.5 in cpu.max"))
    with caplog.at_level(logging.WARNING, logger="kvpark.autotune"):
        autotune.warn_if_oversubscribed(2, 2)
        assert not caplog.records
        autotune.warn_if_oversubscribed(1, 8)
    [record] = caplog.records
    assert "1 torch and 8 C kernel threads on 2 cores this process may keep busy (CPU quota 1.5" \
        in record.getMessage()


def test_kernel_threads_flag_env_and_default():
    from kvpark.kernels import worker_pool
    from kvpark.pod.worker.autotune import pick_kernel_threads

    assert parse_args([], env={}).kernel_threads == 0
    assert parse_args(["--kernel-threads", "2"], env={}).kernel_threads == 2
    assert parse_args([], env={"KVPARK_KERNEL_THREADS": "3"}).kernel_threads == 3
    with pytest.raises(SystemExit):
        parse_args(["--kernel-threads", "-1"], env={})
    with pytest.raises(SystemExit):
        parse_args([], env={"KVPARK_KERNEL_THREADS": "two"})
    assert pick_kernel_threads(parse_args(["--kernel-threads", "3"], env={})) == 3
    assert pick_kernel_threads(parse_args([], env={})) == worker_pool.default_num_threads() >= 1


def test_slot_save_path_from_flag_or_environment_and_checked_before_start(tmp_path, capsys):
    env = {"KVPARK_SLOT_SAVE_PATH": str(tmp_path / "env")}
    assert parse_args([], env=env).slot_save_path == str(tmp_path / "env")
    given = parse_args(["--slot-save-path", str(tmp_path / "flag")], env=env)
    assert given.slot_save_path == str(tmp_path / "flag")
    assert parse_args([], env={}).slot_save_path is None
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--slot-save-path", str(tmp_path / "file")], env={})
    assert stopped.value.code == 2 and "not a directory" in capsys.readouterr().err


def test_a_draft_model_turns_on_drafting_by_it_and_refuses_other_drafting(capsys, tmp_path):
    args = parse_args(["-md", "synthetic:tiny-draft"], env={})
    assert (args.model_draft, args.spec_type) == ("synthetic:tiny-draft", "draft-simple")
    env = {"LLAMA_ARG_MODEL_DRAFT": "builtin://smollm2-135m"}
    assert parse_args([], env=env).spec_type == "draft-simple"
    assert parse_args(["--spec-type", "draft-simple"], env=env).spec_type == "draft-simple"
    assert "needs a draft model (--model-draft PATH)" in refused(
        capsys, ["--spec-type", "draft-simple"], {})
    assert "not ngram-simple" in refused(capsys, ["--spec-type", "ngram-simple"], env)
    missing = tmp_path / "draft.gguf"
    assert f"--model-draft {missing}: no such file or directory" in refused(
        capsys, ["--model-draft", str(missing)], {})


def test_the_pools_type_by_llama_cpp_and_vllm_names(capsys):
    """-ctk/-ctv (and llama-server's LLAMA_ARG_CACHE_TYPE_K/V) or --kv-cache-dtype name the one
    type K and V share; two names that disagree are refused before start."""
    from kvpark.pod.args import kv_cache_type

    assert kv_cache_type(parse_args([], env={})) == "auto"
    assert kv_cache_type(parse_args(["-ctk", "bf16", "-ctv", "bf16"], env={})) == "bfloat16"
    assert kv_cache_type(parse_args(["-ctk", "bf16"], env={})) == "bfloat16"
    env = {"LLAMA_ARG_CACHE_TYPE_K": "f32", "LLAMA_ARG_CACHE_TYPE_V": "f32"}
    assert kv_cache_type(parse_args([], env=env)) == "float32"
    assert kv_cache_type(parse_args(["--kv-cache-dtype", "bfloat16"], env={})) == "bfloat16"
    with pytest.raises(SystemExit):
        parse_args(["-ctk", "bf16", "-ctv", "f32"], env={})
    assert "K and V share one pool type" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["-ctk", "q8_0"], env={})


@pytest.mark.parametrize("flags,device,dtype,amx,want", [
    ([], "cpu", "float32", False, "float32"),
    ([], "cpu", "float32", True, "bfloat16"),  # AMX prompt rows read K/V as bf16 already
    (["-ctk", "f32", "-ctv", "f32"], "cpu", "float32", True, "float32"),
    (["--kv-cache-dtype", "bfloat16"], "cpu", "float32", False, "bfloat16"),
    (["-ctk", "bf16", "-ctv", "bf16"], "cpu", "bfloat16", False, "bfloat16"),
    ([], "cpu", "bfloat16", True, "bfloat16"),
    ([], "cuda", "bfloat16", False, "bfloat16"),
    (["-ctk", "f16", "-ctv", "f16"], "cpu", "float32", False, "the KV pool cannot hold float16"),
    (["-ctk", "f32", "-ctv", "f32"], "cuda", "bfloat16", False,
     "the KV pool cannot hold float32: here it holds the compute type (bfloat16)"),
    (["-ctk", "f32", "-ctv", "f32"], "cpu", "bfloat16", False, "the KV pool cannot hold"),
])
def test_the_pools_type_on_each_device(flags, device, dtype, amx, want):
    import torch

    from kvpark.pod.serving.choices import pick_kv_dtype

    args = parse_args(flags, env={})
    if want.startswith("the KV pool"):
        with pytest.raises(ValueError, match=want.replace("(", r"\(").replace(")", r"\)")):
            pick_kv_dtype(args, torch.device(device), getattr(torch, dtype), amx)
    else:
        assert pick_kv_dtype(args, torch.device(device), getattr(torch, dtype), amx) == \
            getattr(torch, want)
