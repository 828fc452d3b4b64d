"""Decode rows from blocks (kernels/quant_linear.py + csrc/): a GGUF's own Q4_1 / Q8_0, and
Q8_0 made at load for a checkpoint stored without them (pod/model/blocks_at_load.py)."""

import concurrent.futures as cf
import logging
import re

import pytest
import torch
import torch.nn.functional as F
from cpu_isa import requires_amx
from reference_quant_linear import (
    dequantize,
    quantize_activations,
    random_blocks,
    reference_quant_linear,
)

from kvpark.kernels import quant_linear as ql
from kvpark.kernels import worker_pool
from kvpark.kernels.attention import StepLayout
from kvpark.kernels.cores import Cores
from kvpark.kernels.cpu_paged import CpuPagedAttention
from kvpark.pod.args import parse_args
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.model.blocks_at_load import decode_linear_names, q8_0_blocks
from kvpark.pod.model.linear import BlockRows, WeightFormat
from kvpark.pod.model.llama import LlamaModel
from kvpark.pod.model.loader import LoadedModel, load_model_files
from kvpark.pod.serving import stack as stack_module
from kvpark.pod.serving.choices import pick_blocks
from kvpark.pod.worker import autotune

pytestmark = pytest.mark.skipif(not ql.is_available(), reason="no working C compiler")
PAGE = 16


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(1)
    return load_model_files("builtin://smollm2-135m")


@pytest.mark.parametrize("name", [
    "model.layers.0.self_attn.q_proj.weight",  # rows un-permuted like the weight (RoPE pairs)
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.7.mlp.down_proj.weight",
    "model.embed_tokens.weight",  # Q8_0, the tied lm_head
])
def test_blocks_hold_exactly_the_loaded_weights(smollm2, name):
    blocks = smollm2.quantized[name]
    assert blocks.kind == ("Q8_0" if "embed" in name else "Q4_1")
    assert torch.equal(dequantize(blocks), smollm2.weights[name])


@pytest.mark.parametrize("name", ["model.layers.3.mlp.gate_proj.weight",
                                  "model.layers.3.mlp.down_proj.weight",  # 48 blocks a row
                                  "model.embed_tokens.weight"])
def test_rows_match_the_reference_arithmetic_and_do_not_depend_on_each_other(smollm2, name,
                                                                             isa):
    """8-bit activations, exact integer block sums: the kernel is the float64 reference of the
    same integers up to float rounding, and ~1% from the float32 linear (the activations'
    rounding, as llama.cpp's CPU path)."""
    blocks, dense = smollm2.quantized[name], smollm2.weights[name]
    x = torch.randn(19, dense.shape[1], generator=torch.Generator().manual_seed(1))
    x[5] *= 1e-3  # a row of small values: its own scales
    x[6] = 0.0  # an all-zero row: zero scales, no division by zero
    y = ql.quant_linear(x, blocks, isa)
    reference = reference_quant_linear(x, blocks)
    assert ((y - reference).norm() / reference.norm()).item() < 2e-6
    assert torch.equal(y[6], torch.zeros_like(y[6]))
    exact = F.linear(x.double(), dense.double()).float()
    assert ((y - exact).norm() / exact.norm()).item() < 3e-2
    for rows in (slice(0, 1), slice(3, 5), slice(8, 17), slice(18, 19)):  # across row tiles
        assert torch.equal(ql.quant_linear(x[rows].contiguous(), blocks, isa), y[rows])


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_a_rows_bits_do_not_depend_on_the_rows_called_with_it(kind, isa):
    """Calls of 1 to 19 rows at several offsets (every position in and past a row tile, full
    and partial tiles), 7 blocks a row (a pair and a group of 4 left over), 37 outputs: each
    row byte-identical to that row called alone."""
    blocks = random_blocks(kind, 37, 7, seed=3)
    x = torch.randn(24, blocks.in_features, generator=torch.Generator().manual_seed(5))
    x[5] *= 1e-3
    x[6] = 0.0
    alone = torch.cat([ql.quant_linear(x[i:i + 1], blocks, isa) for i in range(len(x))])
    for rows in range(1, 20):
        for first in (0, 1, 5, len(x) - rows):
            y = ql.quant_linear(x[first:first + rows], blocks, isa, num_threads=2)
            assert torch.equal(y.view(torch.int32), alone[first:first + rows].view(torch.int32))


def test_activations_round_to_nearest_even_within_each_block():
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, 0.5, 1.5  # block 0: scale 1, ties at 0.5 and 1.5
    x[0, 32:64] = torch.linspace(-2.0, 1.0, 32)  # block 1: its own scale, max|x| = 2
    q, d = quantize_activations(x)
    assert q[0, 0, :3].tolist() == [127, 0, 2] and d[0, 0].item() == 1.0
    assert q[0, 1, 0].item() == -127 and d[0, 1].item() == pytest.approx(2 / 127)


@pytest.mark.parametrize("name", ["model.layers.2.mlp.down_proj.weight",
                                  "model.embed_tokens.weight"])
def test_kernel_threads_split_outputs_and_keep_the_bits(smollm2, name, isa):
    """1, 2 and 3 threads of the worker pool: byte-identical outputs, for 1 to 7 rows."""
    blocks = smollm2.quantized[name]
    x = torch.randn(7, blocks.in_features, generator=torch.Generator().manual_seed(4))
    for rows in (1, 4, 7):
        outs = [ql.quant_linear(x[:rows], blocks, isa, num_threads=n) for n in (1, 2, 3)]
        for out in outs[1:]:
            assert torch.equal(out.view(torch.int32), outs[0].view(torch.int32))
    assert worker_pool.num_workers(isa) >= 2


def test_the_pool_serves_callers_from_several_threads(smollm2):
    """Two Python threads calling at once (the engine and, say, a start-up measurement): every
    call gets its own complete, exact result."""
    blocks = smollm2.quantized["model.layers.5.self_attn.q_proj.weight"]
    xs = [torch.randn(r, blocks.in_features, generator=torch.Generator().manual_seed(r))
          for r in (4, 7)]  # enough work to split (kvpark_quant_linear: 2^17 weight-rows a part)
    expected = [ql.quant_linear(x, blocks, num_threads=1) for x in xs]

    def calls(i):
        return all(torch.equal(ql.quant_linear(xs[i], blocks, num_threads=2 + i), expected[i])
                   for _ in range(300))

    with cf.ThreadPoolExecutor(2) as pool:
        assert list(pool.map(calls, [0, 1])) == [True, True]


def test_cat_and_take_rows_keep_rows_together(smollm2):
    q = smollm2.quantized["model.layers.1.self_attn.q_proj.weight"]
    k = smollm2.quantized["model.layers.1.self_attn.k_proj.weight"]
    fused = ql.QuantizedWeight.cat([q, k])
    assert torch.equal(dequantize(fused), torch.cat([dequantize(q), dequantize(k)]))
    order = torch.randperm(q.out_features, generator=torch.Generator().manual_seed(2))
    assert torch.equal(dequantize(q.take_rows(order)), dequantize(q)[order])
    embed = smollm2.quantized["model.embed_tokens.weight"]
    assert ql.QuantizedWeight.cat([q, embed]) is None  # mixed formats do not fuse


def run_steps(model, steps, prompt_lens):
    """Each step: (sequence, token ids) pairs; rows past a sequence's prompt read the blocks, as
    the runner marks them. Returns each step's last-row logits per sequence."""
    c = model.config
    pool = KVPool(c.num_layers, 32, PAGE, c.num_kv_heads, c.head_dim)
    num_seqs = len(prompt_lens)
    tables, lens, out = [[] for _ in range(num_seqs)], [0] * num_seqs, []
    backend = CpuPagedAttention()  # row-invariant across decode and prefill rows, like this path
    for step in steps:
        ids, positions, from_blocks, last = [], [], [], []
        for seq, tokens in step:
            lens[seq] += len(tokens)
            tables[seq] += pool.allocate(pool.pages_for(lens[seq]) - len(tables[seq]))
            ids += tokens
            new = range(lens[seq] - len(tokens), lens[seq])
            positions += new
            from_blocks += [p >= prompt_lens[seq] for p in new]
            last.append(new[-1] >= prompt_lens[seq])
        backend.plan(StepLayout([tables[s] for s, _ in step], [lens[s] for s, _ in step],
                                [len(t) for _, t in step], PAGE))
        rows = BlockRows.from_mask(from_blocks)
        hidden = model(torch.tensor(ids), torch.tensor(positions), backend, pool.caches, rows)
        ends = torch.tensor([len(t) for _, t in step]).cumsum(0) - 1
        logits = model.logits(hidden[ends], BlockRows.from_mask(last))
        out.append({seq: logits[i] for i, (seq, _) in enumerate(step)})
    return out


PROMPT = [1, 504, 3458, 314, 253, 1345, 30, 2]
GENERATED = [[28], [6353], [30]]


@pytest.fixture(scope="module")
def models(smollm2):
    return (LlamaModel(smollm2.config, smollm2.weights, quantized=smollm2.quantized),
            LlamaModel(smollm2.config, smollm2.weights))


def test_decode_from_blocks_is_independent_of_neighbours_and_close_to_float32(models):
    model, dense = models
    assert model.has_blocks and not dense.has_blocks
    check_row_invariant_and_close_to_float32(model, dense)  # KL measured 0.004-0.007


def check_row_invariant_and_close_to_float32(model: LlamaModel, dense: LlamaModel) -> None:
    """A sequence's decode logits are the same bits alone and beside other sequences (prompt
    and decode rows), and close to float32's: KL under 0.02 nats, the same greedy token."""
    alone = run_steps(model, [[(0, PROMPT)], *[[(0, t)] for t in GENERATED]], [8])
    neighbours = run_steps(model, [
        [(1, list(range(40, 90))), (0, PROMPT)],
        [(0, GENERATED[0]), (2, [3])],  # a one-token prompt beside it
        [(2, [6, 7]), (0, GENERATED[1]), (1, [7])],
        [(1, [8]), (0, GENERATED[2])],
    ], [8, 50, 2])
    for step, (a, b) in enumerate(zip(alone, neighbours)):
        assert torch.equal(a[0], b[0]), f"step {step}: logits changed with batch neighbours"
    reference = run_steps(dense, [[(0, PROMPT)], *[[(0, t)] for t in GENERATED]], [8])
    for a, r in zip(alone, reference):
        p, q = r[0].log_softmax(-1), a[0].log_softmax(-1)
        assert (p.exp() * (p - q)).sum().item() < 0.02
        assert a[0].argmax() == r[0].argmax()


def test_a_recompute_replay_reproduces_the_decoded_bits(models):
    check_a_replay_reproduces_the_decoded_bits(models[0])


@requires_amx
def test_amx_prompt_rows_keep_every_promise_of_the_float32_ones(smollm2, models):
    """The default where AMX runs: prompt rows on the tile kernel (bf16 products), decode rows
    from the GGUF's blocks. A row's bits still do not depend on its neighbours, a replay still
    reproduces them, and the output stays close to float32's (the same greedy tokens)."""
    amx = LlamaModel(smollm2.config, smollm2.weights, quantized=smollm2.quantized,
                     weight_format=WeightFormat.AMX_BF16)
    assert amx.layers[0].qkv.amx is not None and amx.has_blocks
    # decode rows on the AMX int8 tiles kernel: the Q4_1 layers and the Q8_0 lm_head
    assert amx.head.blocks.layout == "tiles" and amx.layers[0].qkv.blocks.layout == "tiles"
    check_row_invariant_and_close_to_float32(amx, models[1])
    check_a_replay_reproduces_the_decoded_bits(amx)
    fp32 = run_steps(models[0], [[(0, PROMPT)]], [8])
    assert not torch.equal(run_steps(amx, [[(0, PROMPT)]], [8])[0][0], fp32[0][0])
    # -np sized for a batch the tiles serve cheaper (`choose_decode_weights`): every row dense
    amx.drop_blocks()
    check_row_invariant_and_close_to_float32(amx, models[1])
    check_a_replay_reproduces_the_decoded_bits(amx)


def check_a_replay_reproduces_the_decoded_bits(model: LlamaModel) -> None:
    decoded = run_steps(model, [[(0, PROMPT)], *[[(0, t)] for t in GENERATED]], [8])
    # the pages were dropped: prompt and generated tokens fed again, in chunks of any size
    replay = [token for chunk in GENERATED for token in chunk]
    whole = run_steps(model, [[(0, PROMPT + replay)]], [8])
    chunked = run_steps(model, [[(0, PROMPT[:5])], [(0, PROMPT[5:] + replay[:1])],
                                [(0, replay[1:])]], [8])
    assert torch.equal(whole[0][0], decoded[-1][0])
    assert torch.equal(chunked[-1][0], decoded[-1][0])


def test_auto_measures_then_logs_and_keeps_the_faster(smollm2, caplog, monkeypatch):
    """--weights auto and --kernel-threads 0 (the defaults): one start-up measurement picks
    blocks vs float32 and the thread count, and the log shows the timings."""
    model = LlamaModel(smollm2.config, smollm2.weights, quantized=smollm2.quantized)
    auto = parse_args([], env={})
    monkeypatch.setattr(worker_pool, "_num_threads", 2)  # what pick_kernel_threads set: try 2
    with caplog.at_level(logging.INFO, logger="kvpark.autotune"):
        autotune.choose_decode_weights(auto, model)
    [line] = [r.getMessage() for r in caplog.records if "--weights auto" in r.getMessage()]
    found = re.search(r"blocks (\d+\.\d+) ms at 1 thread, (\d+\.\d+) ms at 2 threads, "
                      r"fp32 onednn (\d+\.\d+) ms", line)
    assert found, line
    one, two, dense = map(float, found.groups())
    busy = "the machine was busy while measuring" in line  # the defaults stay: 2, blocks
    threads = 2 if busy or two < 0.95 * one else 1
    assert worker_pool.get_num_threads() == threads and f"kernel threads {threads}" in line
    assert model.has_blocks == (busy or (two if threads == 2 else one) <= dense), line
    assert model.has_blocks == ("decode rows from blocks" in line), line

    caplog.clear()  # float32 measured faster: every row dense from then on
    model = LlamaModel(smollm2.config, smollm2.weights, quantized=smollm2.quantized)
    monkeypatch.setattr(autotune, "measure_decode_linears",
                        lambda m, counts: autotune.DecodeTimings({1: 0.004, 2: 0.003}, 0.001, IDLE))
    monkeypatch.setattr(worker_pool, "_num_threads", 2)
    with caplog.at_level(logging.INFO, logger="kvpark.autotune"):
        autotune.choose_decode_weights(auto, model)
    assert not model.has_blocks and all(layer.qkv.blocks is None for layer in model.layers)
    assert "fp32 onednn (faster here)" in caplog.text and "4.00 ms at 1 thread" in caplog.text
    assert worker_pool.get_num_threads() == 2  # 25% faster than 1: worth the second thread

    model = LlamaModel(smollm2.config, smollm2.weights, quantized=smollm2.quantized)
    autotune.choose_decode_weights(parse_args(["--weights", "gguf", "--kernel-threads", "1"],
                                            env={}), model)
    assert model.has_blocks  # gguf insists: no measurement overrules it



# ---- Q8_0 blocks made at load (a safetensors checkpoint) ---------------------------------------


def llama_cpp_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml-quants.c's quantize_row_q8_0_ref, written out: per 32 inputs d = max|w| / 127 in
    float32, q = roundf(w * (1 / d)) (halves away from zero), d stored as fp16."""
    blocks = w.double().reshape(w.shape[0], -1, 32).float()
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inv
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return d[..., 0].half().float(), q.to(torch.int8)


def test_blocks_made_at_load_are_llama_cpps_q8_0():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 96, generator=gen)
    w[1, :32] = 0.0  # an all-zero block: scale 0, no division by zero
    w[2, :32] = torch.arange(32) - 15.5  # halves: w / d lands on x.5
    w[3] *= 1e-6
    blocks = q8_0_blocks(w.bfloat16().float())
    scale, quants = llama_cpp_q8_0(w.bfloat16().float())
    assert blocks.kind == "Q8_0" and blocks.mins is None
    assert torch.equal(blocks.scale, scale) and torch.equal(blocks.quants, quants)


def test_q8_0_made_from_the_ggufs_own_q8_0_weights_gives_back_its_bytes(smollm2):
    """The builtin GGUF stores the embedding as Q8_0: quantising its dequantised values again
    must give the checkpoint's own blocks, byte for byte."""
    name = "model.embed_tokens.weight"
    made, own = q8_0_blocks(smollm2.weights[name]), smollm2.quantized[name]
    assert torch.equal(made.scale, own.scale) and torch.equal(made.quants, own.quants)


@pytest.fixture(scope="module")
def safetensors_like(smollm2):
    """SmolLM2 as a bf16 safetensors directory loads: bf16 values in float32, no blocks."""
    weights = {n: w.bfloat16().float() for n, w in smollm2.weights.items()}
    return LoadedModel(smollm2.config, weights, smollm2.tokenizer, "hf", "hf", quantized={})


def test_a_checkpoint_without_blocks_gets_q8_0_for_every_decode_linear(safetensors_like,
                                                                       smollm2):
    cpu = torch.device("cpu")
    made = pick_blocks(parse_args([], env={}), safetensors_like, cpu, torch.float32)
    names = decode_linear_names(smollm2.config, safetensors_like.weights)
    assert len(names) == 7 * smollm2.config.num_layers + 1
    assert sorted(made) == sorted(names) and {b.kind for b in made.values()} == {"Q8_0"}
    for name in (names[0], names[-1]):
        assert torch.equal(dequantize(made[name]),
                           dequantize(q8_0_blocks(safetensors_like.weights[name])))
    # a GGUF whose linears are all blocks keeps its own, and nothing is made
    own = pick_blocks(parse_args([], env={}), smollm2, cpu, torch.float32)
    assert own.keys() == smollm2.quantized.keys()
    assert all(own[n] is smollm2.quantized[n] for n in own)
    # blocks are a float32 CPU path: other weights or dtypes make none
    assert pick_blocks(parse_args(["--weights", "fp32"], env={}), safetensors_like, cpu,
                       torch.float32) is None
    assert pick_blocks(parse_args([], env={}), safetensors_like, cpu, torch.bfloat16) is None


def test_decode_from_blocks_made_at_load_is_row_invariant_and_close_to_float32(safetensors_like):
    cpu = torch.device("cpu")
    blocks = pick_blocks(parse_args([], env={}), safetensors_like, cpu, torch.float32)
    model = LlamaModel(safetensors_like.config, safetensors_like.weights, quantized=blocks)
    dense = LlamaModel(safetensors_like.config, safetensors_like.weights)
    assert model.has_blocks
    check_row_invariant_and_close_to_float32(model, dense)  # KL measured 0.004-0.013


IDLE = autotune.Conditions(load_average=0.1, cores=2, spread=0.02, rounds=8)


@pytest.mark.parametrize("load,spread,busy", [(0.1, 0.02, False), (2.5, 0.02, True),
                                              (0.5, 0.4, True)])
def test_a_busy_machine_during_the_measurement_is_said_in_the_log(load, spread, busy):
    """A loaded machine measures thread counts wrong (a chosen 1 thread where an idle machine
    picks 2): the start-up line shows the load average and the rounds' spread, and says so."""
    conditions = autotune.Conditions(load_average=load, cores=2, spread=spread, rounds=8)
    text = conditions.describe()
    assert conditions.busy == busy
    assert f"load average {load:.2f} on 2 cores" in text and f"{spread:.0%}" in text
    assert ("the machine was busy" in text) == busy


def test_the_measured_choice_logs_the_machines_load(smollm2, caplog, monkeypatch):
    model = LlamaModel(smollm2.config, smollm2.weights, quantized=smollm2.quantized)
    monkeypatch.setattr(autotune, "usable_cores", lambda: Cores(2, "a test"))
    monkeypatch.setattr(autotune.os, "getloadavg", lambda: (3.5, 1.0, 0.5))
    try:
        with caplog.at_level(logging.INFO, logger="kvpark.autotune"):
            autotune.choose_torch_threads(parse_args([], env={}), model)
    finally:
        torch.set_num_threads(1)
    assert "load average 3.50 on 2 cores" in caplog.text
    assert "the machine was busy while measuring" in caplog.text


BUSY = autotune.Conditions(load_average=2.6, cores=2, spread=0.45, rounds=8)


@pytest.mark.parametrize("others,machine_cores,busy", [
    (0.03, 2, False), (2.0, 2, True), (0.4, 2, True), (30.0, 64, False), (62.5, 64, True)])
def test_other_processes_taking_a_core_mark_the_measurement_busy(others, machine_cores, busy):
    """The load average lags by a minute (0.72 with two burners ten seconds in, where the
    measurement found one thread faster than two): the CPU time other processes took while it
    ran says it at once. On a big node, others busy beside this pod's cores are no contention."""
    conditions = autotune.Conditions(load_average=0.7, cores=2, spread=0.02, rounds=8,
                                     others=others, machine_cores=machine_cores)
    assert conditions.busy == busy
    assert f"other processes kept {others:.2f}" in conditions.describe()


def test_other_cores_are_the_machines_busy_time_less_this_processs():
    before = autotune.CpuSample(at=10.0, machine=100.0, own=5.0)
    after = autotune.CpuSample(at=12.0, machine=106.0, own=7.0)  # 6 s busy, 2 of them ours
    assert autotune.other_cores(before, after) == 2.0
    assert autotune.other_cores(before, autotune.CpuSample(12.0, None, 7.0)) is None
# what a busy start measures: a second thread waits for a core, so one looks faster, and blocks
# look slower than float32
ONE_LOOKS_FASTER = autotune.DecodeTimings({1: 0.003, 2: 0.005}, 0.002, BUSY)


@pytest.mark.parametrize("conditions", [BUSY, IDLE], ids=["busy", "quiet"])
def test_a_busy_start_keeps_every_kernel_thread_and_the_blocks(smollm2, caplog, monkeypatch,
                                                                conditions):
    """Issue 41: a server started beside others measured 1 thread (and would have dropped the
    blocks) for its whole life. The same timings lower the count and drop the blocks only when
    taken on a quiet machine; on a busy one the defaults stay and the log says why."""
    model = LlamaModel(smollm2.config, smollm2.weights, quantized=smollm2.quantized)
    monkeypatch.setattr(autotune, "measure_decode_linears", lambda m, counts: (
        autotune.DecodeTimings(ONE_LOOKS_FASTER.blocks, ONE_LOOKS_FASTER.dense, conditions)))
    monkeypatch.setattr(worker_pool, "_num_threads", 2)  # every core, as pick_kernel_threads
    with caplog.at_level(logging.INFO, logger="kvpark.autotune"):
        autotune.choose_decode_weights(parse_args([], env={}), model)
    busy = conditions is BUSY
    assert worker_pool.get_num_threads() == (2 if busy else 1)
    assert model.has_blocks == busy
    assert ("the defaults stay" in caplog.text) == busy


# one row: the blocks lead (as measured on an AMX CPU); 32 rows: the dense GEMM on AMX tiles
BLOCKS_LEAD_ALONE = autotune.DecodeTimings({1: 0.011, 2: 0.011}, 0.017, IDLE)


@pytest.mark.parametrize("parallel,conditions,batch_dense,dense", [
    (32, IDLE, 0.023, True), (4, IDLE, 0.023, False), (32, BUSY, 0.023, True),
    (32, IDLE, 0.035, False)], ids=["np32", "np4", "np32-busy", "np32-within-margin"])
def test_a_full_batch_that_the_dense_gemm_computes_cheaper_takes_decode_rows_off_blocks(
        smollm2, caplog, monkeypatch, parallel, conditions, batch_dense, dense):
    """-np 32: the blocks win at one row (11 vs 17 ms) but 32 rows cost them 50 ms against
    23 ms for AMX tiles (measured here): one row plus the batch -np makes cost the dense GEMM
    40 ms against 61, so every decode row goes dense for the server's life. -np 4 measures no
    batch (one row decides).
    Both kernels share the worker threads and alternate rounds, so a busy machine does not
    stop the choice; a dense GEMM less than 20% cheaper does not take the rows."""
    model = LlamaModel(smollm2.config, smollm2.weights, quantized=smollm2.quantized)
    monkeypatch.setattr(autotune, "measure_decode_linears", lambda m, counts: BLOCKS_LEAD_ALONE)
    asked = []

    def full(m, rows):
        asked.append(rows)
        return autotune.FullBatchTimings(rows, 0.050, batch_dense, conditions)

    monkeypatch.setattr(autotune, "measure_full_batch", full)
    monkeypatch.setattr(worker_pool, "_num_threads", 2)
    with caplog.at_level(logging.INFO, logger="kvpark.autotune"):
        autotune.choose_decode_weights(parse_args(["-np", str(parallel)], env={}), model)
    assert asked == ([32] if parallel == 32 else [])
    assert model.has_blocks == (not dense)
    assert ("32 rows (-np): blocks 50.00 ms" in caplog.text) == (parallel == 32)
    assert ("(faster here)" in caplog.text) == dense


def test_the_full_batch_measurement_times_both_kernels(smollm2):
    model = LlamaModel(smollm2.config, smollm2.weights, quantized=smollm2.quantized)
    found = autotune.measure_full_batch(model, 8)
    assert found.rows == 8 and found.blocks > 0 and found.dense > 0


def torch_threads_chosen(model: LlamaModel, caplog) -> int:
    """What `--threads auto` sets on `model` (the count is put back to 1 afterwards)."""
    try:
        with caplog.at_level(logging.INFO, logger="kvpark.autotune"):
            autotune.choose_torch_threads(parse_args([], env={}), model)
        return torch.get_num_threads()
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("conditions", [BUSY, IDLE], ids=["busy", "quiet"])
def test_a_busy_start_keeps_every_torch_thread(smollm2, caplog, monkeypatch, conditions):
    model = LlamaModel(smollm2.config, smollm2.weights, quantized=smollm2.quantized)
    monkeypatch.setattr(autotune, "usable_cores", lambda: Cores(2, "a test"))
    monkeypatch.setattr(autotune, "measure_prompt_gemms", lambda m, counts: (
        autotune.PromptTimings({1: 0.010, 2: 0.012}, conditions)))
    assert torch_threads_chosen(model, caplog) == (2 if conditions is BUSY else 1)
    assert ("the defaults stay" in caplog.text) == (conditions is BUSY)


@pytest.mark.parametrize("conditions,every,threads", [
    (BUSY, 0.012, 1), (IDLE, 0.012, 1), (IDLE, 0.005, 2), (BUSY, 0.005, 1)],
    ids=["busy", "quiet-slower", "quiet-faster", "busy-faster"])
def test_with_amx_gemms_one_torch_thread_unless_a_quiet_measurement_finds_more_faster(
        smollm2, caplog, monkeypatch, conditions, every, threads):
    """The AMX tile kernel runs the prompt GEMMs on its own threads: torch's only compute the
    norms and activations beside them, and compete for the cores, so one stays, on a busy
    start too (unlike the float32 GEMMs, whose default is every core)."""
    model = LlamaModel(smollm2.config, smollm2.weights, quantized=smollm2.quantized)
    monkeypatch.setattr(autotune, "gemm_engine", lambda fmt, device: "amx")
    monkeypatch.setattr(autotune, "usable_cores", lambda: Cores(2, "a test"))
    monkeypatch.setattr(autotune, "measure_prompt_gemms", lambda m, counts: (
        autotune.PromptTimings({1: 0.010, 2: every}, conditions)))
    assert torch_threads_chosen(model, caplog) == threads
    assert "beside the AMX tile kernel's threads" in caplog.text


@requires_amx
def test_the_amx_prompt_measurement_runs_the_mlp_with_its_torch_ops(smollm2):
    model = LlamaModel(smollm2.config, smollm2.weights, quantized=smollm2.quantized,
                       weight_format=WeightFormat.AMX_BF16)
    timings = autotune.measure_prompt_gemms(model, [1, 2])
    assert set(timings.by_threads) == {1, 2} and min(timings.by_threads.values()) > 0


class SlowClock:
    """A perf_counter that moves a whole start-up budget each time it is read."""

    def __init__(self) -> None:
        self.reads = 0

    def perf_counter(self) -> float:
        self.reads += 1
        return self.reads * autotune.AUTO_BUDGET_S


@pytest.mark.parametrize("measure", ["decode", "prompt"])
def test_start_up_measurements_stop_at_their_budget(smollm2, monkeypatch, measure):
    """However slow the machine, each start-up measurement stops after the round that crosses
    AUTO_BUDGET_S: warm-up + one timed round of each variant (2 clock reads a run, one to set
    the deadline, one to check it), not AUTO_ROUNDS rounds."""
    model = LlamaModel(smollm2.config, smollm2.weights, quantized=smollm2.quantized)
    clock = SlowClock()
    monkeypatch.setattr(autotune, "time", clock)
    if measure == "decode":
        timings = autotune.measure_decode_linears(model, [1, 2])
        variants = 3  # 1 thread, 2 threads, float32
        assert set(timings.blocks) == {1, 2} and timings.dense > 0
    else:
        timings = autotune.measure_prompt_gemms(model, [1, 2])
        variants = 2
        assert set(timings.by_threads) == {1, 2}
    assert timings.conditions.rounds == 1
    assert clock.reads == 2 * variants + 1 + 2 * variants + 1, clock.reads


def test_threads_auto_takes_every_core_only_where_prompt_gemms_gain(smollm2, caplog,
                                                                    monkeypatch):
    """--threads 0 (the default): the start-up measurement of a prompt chunk's GEMMs picks every
    core only when they are 30% faster, and only where decode rows run in the C kernels."""
    model = LlamaModel(smollm2.config, smollm2.weights, quantized=smollm2.quantized)
    auto = parse_args([], env={})
    monkeypatch.setattr(autotune, "usable_cores", lambda: Cores(2, "a test"))
    try:
        with caplog.at_level(logging.INFO, logger="kvpark.autotune"):
            autotune.choose_torch_threads(auto, model)  # measured for real
        found = re.search(r"--threads auto: (\d) torch threads? .* (\d+\.\d+) ms at 1 thread, "
                          r"(\d+\.\d+) ms at 2", caplog.text)
        assert found, caplog.text
        chosen, one, two = int(found[1]), float(found[2]), float(found[3])
        busy = "the machine was busy while measuring" in caplog.text  # the defaults stay
        assert chosen == (2 if busy or two * 1.3 < one else 1) == torch.get_num_threads()

        for timings, expected in (({1: 0.010, 2: 0.005}, 2), ({1: 0.010, 2: 0.009}, 1)):
            measured = autotune.PromptTimings(timings, IDLE)
            monkeypatch.setattr(autotune, "measure_prompt_gemms", lambda m, c, t=measured: t)
            autotune.choose_torch_threads(auto, model)
            assert torch.get_num_threads() == expected

        torch.set_num_threads(1)
        autotune.choose_torch_threads(parse_args(["--threads", "1"], env={}), model)
        dense = LlamaModel(smollm2.config, smollm2.weights)  # float32 decode in torch ops
        autotune.choose_torch_threads(auto, dense)
        assert torch.get_num_threads() == 1  # neither measured nor changed
    finally:
        torch.set_num_threads(1)


def test_the_server_keeps_one_copy_of_the_blocks():
    """Once the model holds the blocks it reads (laid out anew where AMX tiles take them), the
    file's own copies are let go: a big GGUF's blocks would otherwise sit twice in RAM."""
    args = parse_args(["--weights", "gguf", "-t", "1", "--kernel-threads", "1"], env={})
    target = stack_module.load_target(args, torch.device("cpu"), torch.float32,
                                      stack_module.Stages())
    assert target.model.has_blocks and target.loaded.quantized == {}
