"""Slot files without a server: the format round-trips tokens and page bytes, names the field
of a foreign model, stays inside its directory; a slot's state comes from the prefix cache and
goes back into it all or nothing; erase keeps what another slot remembers."""

import os
from dataclasses import replace

import pytest
import torch

from kvpark.pod.core.messages import Submission
from kvpark.pod.core.sequence import Sequence
from kvpark.pod.core.slot_memory import SlotMemory
from kvpark.pod.memory import slot_files
from kvpark.pod.memory.identity import ModelIdentity
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.memory.prefix_cache import PrefixCache
from kvpark.pod.memory.slot_files import SlotFileError, SlotState
from kvpark.pod.sampling.sampler import SamplingParams

PS = 4
IDENTITY = ModelIdentity("m", 123, "ab" * 32, "float32", "fp32", False, num_layers=2,
                         num_kv_heads=1, head_dim=2, page_size=PS)


def make_pool(num_pages: int = 8, split_kinds: bool = False) -> KVPool:
    return KVPool(num_layers=2, num_pages=num_pages, page_size=PS, num_kv_heads=1, head_dim=2,
                  cache=PrefixCache("model", PS, split_kinds=split_kinds))


def finished_seq(pool: KVPool, tokens: list[int], num_prompt: int, slot_id: int = 0) -> Sequence:
    """A sequence that ran `tokens` in slot `slot_id`, filled its pages (each K/V value names
    its token and position) and let go of them, as a finish does."""
    seq = Sequence(Submission("r", tuple(tokens[:num_prompt]), SamplingParams(temperature=0),
                              None, lambda *a: None), torch.Generator(), slot_id=slot_id)
    seq.tokens = list(tokens)
    seq.page_table = pool.allocate(pool.pages_for(len(tokens)))
    for pos, token in enumerate(tokens):
        for cache in pool.caches:
            cache[seq.page_table[pos // PS], :, pos % PS] = token * 1000 + pos
    seq.num_computed = len(tokens)
    seq.page_hashes = pool.cache.grow_hashes([], seq.tokens, seq.num_prompt, len(tokens) // PS)
    pool.register_complete(seq.page_table, seq.page_hashes, 0)
    pool.free(seq.page_table)
    return seq


def state_of(num_pages: int, dtype=torch.float32) -> SlotState:
    kv = torch.arange(2 * num_pages * 2 * PS * 2, dtype=torch.float32).to(dtype)
    tokens = tuple(range(100, 100 + num_pages * PS))
    return SlotState(tokens, min(5, len(tokens)), kv.reshape(2, num_pages, 2, PS, 1, 2))


# ---- the file ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_file_round_trips_tokens_and_page_bytes(tmp_path, dtype):
    identity = replace(IDENTITY, dtype=str(dtype).removeprefix("torch."))
    state = state_of(3, dtype)
    size = slot_files.write(tmp_path / "s.bin", identity, state)
    assert size == (tmp_path / "s.bin").stat().st_size
    back, read = slot_files.read(tmp_path / "s.bin", identity, dtype)
    assert read == size and back.tokens == state.tokens and back.num_prompt == 5
    assert back.kv.dtype == dtype and torch.equal(back.kv, state.kv)
    assert [p.name for p in tmp_path.iterdir()] == ["s.bin"]  # no temporary file left


def test_another_checkpoint_is_refused_naming_the_weights(tmp_path):
    slot_files.write(tmp_path / "s.bin", IDENTITY, state_of(1))
    other = replace(IDENTITY, weights_sha256="cd" * 32, num_kv_heads=2)
    with pytest.raises(SlotFileError) as refused:
        slot_files.read(tmp_path / "s.bin", other, torch.float32)
    assert "weights_sha256: file 'abab" in str(refused.value)
    assert "num_kv_heads: file 1, this server 2" in str(refused.value)


def test_a_saved_file_replaces_the_old_one_whole(tmp_path):
    slot_files.write(tmp_path / "s.bin", IDENTITY, state_of(3))
    slot_files.write(tmp_path / "s.bin", IDENTITY, state_of(1))
    assert slot_files.read(tmp_path / "s.bin", IDENTITY, torch.float32)[0].num_pages == 1


@pytest.mark.parametrize("name", ["", "..", ".", "../x", "/etc/passwd", "a/b", "a\\b", ".tmp",
                                  "x" * 256, "a\nb", None, 3, ["a"]])
def test_names_must_be_plain_file_names(tmp_path, name):
    with pytest.raises(SlotFileError):
        slot_files.resolve_name(str(tmp_path), name)


def test_a_symlink_may_not_lead_out_of_the_directory(tmp_path):
    inside = tmp_path / "slots"
    inside.mkdir()
    os.symlink(tmp_path / "elsewhere.bin", inside / "out")
    os.symlink(inside / "real.bin", inside / "alias")
    with pytest.raises(SlotFileError, match="outside"):
        slot_files.resolve_name(str(inside), "out")
    assert slot_files.resolve_name(str(inside), "alias") == (inside / "real.bin").resolve()
    assert slot_files.resolve_name(str(inside), "ok.bin") == inside.resolve() / "ok.bin"


# ---- a slot's state over the pool --------------------------------------------------------
def test_the_state_is_the_whole_pages_still_cached_and_comes_back_under_the_same_hashes():
    pool = make_pool(split_kinds=True)
    memory = SlotMemory(pool, num_slots=2)
    seq = finished_seq(pool, list(range(1, 12)), num_prompt=6)  # 2 whole pages + 3 tokens
    memory.remember(seq)
    state = memory.export(0)
    assert state.tokens == tuple(range(1, 9)) and state.num_prompt == 6
    assert torch.equal(state.kv, pool.read_pages(seq.page_table[:2]))
    assert memory.erase(0) == 8 and pool.num_cached_pages == 0
    assert memory.restore(1, state) is None
    pages = pool.cache.lookup(seq.page_hashes)
    assert len(pages) == 2 and pool.num_cached_pages == 2  # cached, held by nobody
    assert torch.equal(pool.read_pages(pages), state.kv)
    assert memory.export(1).tokens == state.tokens  # the restored slot remembers it


def test_a_restore_the_pool_cannot_hold_changes_nothing():
    pool = make_pool(num_pages=4)
    memory = SlotMemory(pool, num_slots=1)
    held = pool.allocate(3)  # a running sequence's pages
    assert "cannot take the file's 2 pages" in memory.restore(0, state_of(2))
    assert pool.num_free_pages == 1 and pool.num_cached_pages == 0
    assert memory.records[0] is None
    pool.free(held)
    assert memory.restore(0, state_of(2)) is None and pool.num_cached_pages == 2


def test_erase_keeps_the_pages_another_slot_remembers():
    pool = make_pool()
    memory = SlotMemory(pool, num_slots=2)
    shared = list(range(1, 5))  # one page both conversations start with
    memory.remember(finished_seq(pool, [*shared, 5, 6, 7, 8, 9], 9, slot_id=0))
    memory.remember(finished_seq(pool, [*shared, 15, 16, 17, 18, 19], 9, slot_id=1))
    assert pool.num_cached_pages == 3
    assert memory.erase(0) == 8
    assert pool.num_cached_pages == 2 and memory.export(1).num_pages == 2
    assert "nothing to save" in memory.export(0)


def test_a_file_from_before_draft_models_matches_a_server_without_one():
    from dataclasses import asdict, replace

    saved = asdict(IDENTITY)
    del saved["draft"]  # written before the field existed
    assert IDENTITY.differences(saved) == []
    with_draft = replace(IDENTITY, draft="tiny-draft|ab|fp32|blocks=False")
    assert with_draft.differences(saved) == [
        "draft: file '', this server 'tiny-draft|ab|fp32|blocks=False'"]
