"""Constrained decoding inside CUDA graphs.

A grammar constrains output through `constraint.TokenConstraint`: the runner masks a row's
logits after the forward (for a decode-only step, a graph replay), on the host, before the draw;
the engine feeds the sampled token back. Nothing of the constraint is captured in the graph, so
what holds is what holds for decoding in graphs at all (test_decode_graphs.py): greedy tokens
equal to the same graph-mode kernels run without a graph, token for token, and logits close to
the plain eager path. Asserted here with constrained and unconstrained rows sharing each replay:
every output is valid under its grammar and ends when the grammar is complete.

The GPU machine has no llguidance (nor the tokenizer the server's grammars need), so the first
tests constrain through a small grammar over token ids written here, the hook llguidance's
`GrammarConstraint` plugs into; the llguidance test runs where it is installed and skips where
it is not, saying so.
"""

import json
import re

import pytest
import torch
from gpu_stack import (
    LogitsRecorder,
    Stack,
    greedy_agreement,
    logits_rel_err,
    make_seq,
    random_tokens,
)

pytestmark = pytest.mark.gpu

MAX_LOGITS_REL_ERR = 3e-2  # graph replays vs eager decode, as in test_decode_graphs.py
OPEN, CLOSE, COMMA = ord("["), ord("]"), ord(",")
DIGITS = tuple(range(ord("0"), ord("9") + 1))


class DigitList:
    """`[` digit (`,` digit){0,max_items-1} `]` over the token ids of those characters: a
    `TokenConstraint` as `grammar.GrammarConstraint` is one. Complete (the sequence stops) once
    `]` is accepted."""

    def __init__(self, max_items: int) -> None:
        self.max_items = max_items
        self.state, self.items = "start", 0
        self.rejected: list[int] = []  # tokens accepted that the grammar did not allow

    def allowed(self) -> tuple[int, ...]:
        if self.state == "start":
            return (OPEN,)
        if self.state in ("open", "comma"):
            return DIGITS
        if self.state == "digit":
            return (CLOSE,) if self.items == self.max_items else (COMMA, CLOSE)
        return ()

    def mask(self, logits: torch.Tensor) -> None:
        allowed = torch.zeros(logits.shape[0], dtype=torch.bool)
        allowed[list(self.allowed())] = True
        with torch.inference_mode():  # the model's logits are inference tensors
            logits.masked_fill_(~allowed, float("-inf"))

    def accept(self, token: int) -> None:
        if token not in self.allowed():
            self.rejected.append(token)
            return
        if token in DIGITS:
            self.state, self.items = "digit", self.items + 1
        else:
            self.state = {OPEN: "open", COMMA: "comma", CLOSE: "done"}[token]

    def is_done(self) -> bool:
        return self.state == "done"

    @staticmethod
    def is_valid(tokens: list[int], max_items: int) -> bool:
        text = "".join(chr(t) for t in tokens)
        return re.fullmatch(rf"\[\d(,\d){{0,{max_items - 1}}}\]", text) is not None


# (prompt length, max list items or None for an unconstrained row); four rows, bucket 4 first
ROWS = [(5, 5), (17, 2), (33, None), (64, 6)]
PLAIN_TOKENS = 12


def constrained_run(model, graphs: str | None, forced_from=None):
    """The four rows at once; returns (stack, sequences, their recorders)."""
    stack = Stack(model, graphs=graphs)
    seqs, recorders = [], []
    for i, (prompt_len, max_items) in enumerate(ROWS):
        forced = None if forced_from is None else forced_from[i].generated_ids
        recorder = LogitsRecorder(inner=None if max_items is None else DigitList(max_items),
                                  forced=forced)
        max_tokens = PLAIN_TOKENS if max_items is None else 4 * max_items
        seqs.append(make_seq(f"row{i}", random_tokens(prompt_len, seed=20 + i), max_tokens,
                             constraint=recorder))
        recorders.append(recorder)
    stack.run(*seqs)
    return stack, seqs, recorders


def check_outputs(seqs, recorders) -> None:
    for seq, recorder, (_, max_items) in zip(seqs, recorders, ROWS):
        if max_items is None:
            assert seq.finish_reason == "length" and seq.num_generated == PLAIN_TOKENS
            continue
        assert recorder.inner.rejected == []
        assert DigitList.is_valid(seq.generated_ids, max_items), seq.generated_ids
        assert seq.finish_reason == "stop"  # the grammar completed, not max_tokens


def test_a_constrained_decode_in_cuda_graphs_equals_the_same_kernels_without_a_graph(
        smollm2, flashinfer):
    graph, graph_seqs, graph_recorders = constrained_run(smollm2, "graph")
    check_outputs(graph_seqs, graph_recorders)
    # every step after the prefill was a decode step, and each ran as a graph replay
    assert graph.graphs.replays == graph.decode_steps > 0
    plain, plain_seqs, plain_recorders = constrained_run(smollm2, "no-graph")
    check_outputs(plain_seqs, plain_recorders)
    assert [s.generated_ids for s in graph_seqs] == [s.generated_ids for s in plain_seqs]


def test_a_constrained_decode_in_cuda_graphs_stays_close_to_eager_decode(smollm2, flashinfer):
    """Teacher-forced: the eager run is fed the graph run's tokens (which its grammars allow),
    so both sample from the same contexts; the logits must stay close."""
    _, graph_seqs, graph_recorders = constrained_run(smollm2, "graph")
    eager, eager_seqs, eager_recorders = constrained_run(smollm2, None, forced_from=graph_seqs)
    assert eager.graphs is None
    check_outputs(eager_seqs, eager_recorders)
    for g, e in zip(graph_recorders, eager_recorders):
        assert max(logits_rel_err(g.logits, e.logits)) < MAX_LOGITS_REL_ERR
    agree = [greedy_agreement(g.logits, e.logits) for g, e in zip(graph_recorders,
                                                                  eager_recorders)]
    print(f"graph vs eager, unmasked greedy agreement per row: {agree}")


# ---- llguidance (the server's grammars), where it is installed ----------------------------------
class ByteTokens:
    """A byte-level vocabulary for llguidance: ids 0-255 are the bytes, 256 is EOS; the model's
    other ids are outside the grammar's vocabulary and always masked."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"\xff<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


GBNF = 'root ::= "[" [0-9] ("," [0-9]){0,4} "]"'
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
          "properties": {"ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}


def matches_schema(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"ok", "n"} and isinstance(value["ok"], bool)
            and type(value["n"]) is int and 0 <= value["n"] <= 99)


@pytest.mark.parametrize("kind", ["gbnf", "json_schema"])
def test_llguidance_grammars_in_cuda_graphs_equal_the_same_kernels_without_a_graph(
        smollm2, flashinfer, kind):
    llguidance = pytest.importorskip(
        "llguidance", reason="llguidance is not installed here (the server's grammars use it)")
    pytest.importorskip("numpy", reason="numpy is not installed here (grammar.py needs it)")
    grammar_module = pytest.importorskip(
        "kvpark.pod.sampling.grammar",
        reason="kvpark.pod.sampling.grammar does not import here (it needs the tokenizer's "
               "packages)")
    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteTokens()))
    grammar = (grammar_module.Grammar.from_gbnf(GBNF) if kind == "gbnf"
               else grammar_module.Grammar.from_json_schema(SCHEMA))
    eos = frozenset({ByteTokens.eos_token_id})

    def run(graphs: str) -> tuple[Stack, list]:
        stack = Stack(smollm2, graphs=graphs, eos_ids=eos)
        seqs = []
        for i in range(3):
            constraint = grammar_module.GrammarConstraint(
                llguidance.LLMatcher(lltok, grammar.text, log_level=0), len(ByteTokens.tokens),
                eos)
            seqs.append(make_seq(f"{kind}{i}", random_tokens(9 + 20 * i, seed=40 + i), 160,
                                 constraint=constraint, ignore_eos=False))
        seqs.append(make_seq("plain", random_tokens(30, seed=39), PLAIN_TOKENS))
        stack.run(*seqs)
        return stack, seqs

    graph, graph_seqs = run("graph")
    assert graph.graphs.replays == graph.decode_steps > 0
    for seq in graph_seqs[:3]:
        assert seq.finish_reason == "stop", "the grammar completed before max_tokens"
        text = bytes(t for t in seq.generated_ids if t < 256).decode()
        assert all(t <= 256 for t in seq.generated_ids)
        if kind == "gbnf":
            assert re.fullmatch(r"\[\d(,\d){0,4}\]", text), text
        else:
            assert matches_schema(text), text
    _, plain_seqs = run("no-graph")
    assert [s.generated_ids for s in graph_seqs] == [s.generated_ids for s in plain_seqs]
