"""The preemption policy as pure functions (spec "Policy")."""

import torch

from kvpark.pod.core import preemption as policy
from kvpark.pod.core.messages import Submission
from kvpark.pod.core.sequence import Phase, PreemptMode, Sequence
from kvpark.pod.sampling.sampler import SamplingParams


def seq(name, n_tokens, arrival=0.0, priority=0, family_size=1, **state):
    s = Sequence(Submission(name, tuple(range(n_tokens)), SamplingParams(), None,
                            lambda *a: None, family_size=family_size, priority=priority),
                 torch.Generator(), arrival=arrival)
    s.phase = Phase.RUNNING
    for key, value in state.items():
        setattr(s.parking if hasattr(s.parking, key) else s, key, value)
    return s


def test_leader_is_never_the_victim():
    leader, other = seq("leader", 100), seq("other", 99)
    assert policy.choose_victim([leader, other]) is other
    assert policy.choose_victim([leader]) is None


def test_smallest_of_the_rest_is_chosen():
    a, b, c = seq("a", 300), seq("b", 50), seq("c", 120)
    assert policy.choose_victim([a, b, c]) is b


def test_starved_sequence_is_passed_over_while_another_exists():
    leader = seq("leader", 500)
    starved = seq("starved", 10, n_preempt=policy.PREEMPT_N_STARVED)
    fresh = seq("fresh", 200)
    assert policy.choose_victim([leader, starved, fresh]) is fresh
    assert policy.choose_victim([leader, starved]) is starved


def test_families_are_not_candidates():
    leader, sibling = seq("leader", 500), seq("sibling", 10, family_size=2)
    assert policy.choose_victim([leader, sibling]) is None
    single = seq("single", 400)
    assert policy.choose_victim([leader, sibling, single]) is single


def test_prompt_phase_sequences_are_candidates():
    leader, prompt = seq("leader", 500, num_computed=500), seq("prompt", 30, num_computed=0)
    assert prompt.in_prompt
    assert policy.choose_victim([leader, prompt]) is prompt


def test_recompute_in_progress_is_passed_over_while_another_exists():
    leader = seq("leader", 900)
    replaying = seq("replaying", 40, num_computed=16, replay_until=39)
    other = seq("other", 300)
    assert replaying.is_replaying
    assert policy.choose_victim([leader, replaying, other]) is other
    assert policy.choose_victim([leader, replaying]) is replaying


def test_mode_follows_the_remaining_budget():
    assert policy.choose_mode(100, budget_bytes=150, held_bytes=50) is PreemptMode.SWAP
    assert policy.choose_mode(101, budget_bytes=150, held_bytes=50) is PreemptMode.RECOMPUTE
    assert policy.choose_mode(0, budget_bytes=0, held_bytes=0) is PreemptMode.RECOMPUTE  # never
    assert policy.choose_mode(1 << 40, budget_bytes=-1, held_bytes=1 << 40) is PreemptMode.SWAP


def test_high_watermark_counts_pages_in_flight_as_given_back():
    assert policy.passes_high(used_pages=90, soon_free=0, step_pages=5, high_pages=94)
    assert not policy.passes_high(used_pages=90, soon_free=1, step_pages=5, high_pages=94)


def test_restore_must_fit_and_stay_below_low_while_anyone_runs():
    assert policy.may_restore(10, available=10, projected=70, low_pages=80,
                              anyone_running=True) == (True, True)
    assert policy.may_restore(10, available=10, projected=71, low_pages=80,
                              anyone_running=True) == (True, False)
    assert policy.may_restore(10, available=10, projected=71, low_pages=80,
                              anyone_running=False) == (True, True)
    assert policy.may_restore(11, available=10, projected=0, low_pages=80,
                              anyone_running=False) == (False, True)


def test_restore_order_most_preempted_then_longest_parked():
    a = seq("a", 10, n_preempt=1, parked_at=5.0)
    b = seq("b", 10, n_preempt=2, parked_at=9.0)
    c = seq("c", 10, n_preempt=1, parked_at=1.0)
    assert policy.restore_order([a, b, c]) == [b, c, a]


def test_restore_need_swap_is_pages_plus_next_step_recompute_is_whole_replay():
    swapped = seq("s", 50, num_computed=50, mode=PreemptMode.SWAP)
    swapped.tokens.append(7)  # one sampled token waits to be fed
    assert policy.restore_need_tokens(swapped, batch_size=512) == 51
    mid_prompt = seq("p", 2000, num_computed=100, mode=PreemptMode.SWAP)
    assert policy.restore_need_tokens(mid_prompt, batch_size=512) == 100 + 512
    recomputed = seq("r", 50, num_computed=0, replay_until=49,
                     mode=PreemptMode.RECOMPUTE)
    assert policy.restore_need_tokens(recomputed, batch_size=16) == 51


def test_reserve_charges_a_resuming_recompute_its_whole_replay():
    replaying = seq("r", 100, num_computed=32, replay_until=99, page_table=[0, 1])
    decoding = seq("d", 100, num_computed=99, page_table=list(range(2, 9)))
    # 101 tokens need 7 pages of 16; the replaying sequence holds 2 so far
    assert policy.preempt_kv_reserve([replaying, decoding], page_size=16) == 5


def test_parked_sequence_within_the_margin_of_the_pool_can_never_fit():
    capacity = 256
    assert policy.can_never_fit(seq("x", capacity - policy.PREEMPT_N_MARGIN), capacity)
    assert not policy.can_never_fit(seq("y", capacity - policy.PREEMPT_N_MARGIN - 1), capacity)


def test_priority_tiers_pick_the_low_tier_even_its_only_member():
    low = seq("low", 900, priority=-1)
    high = seq("high", 100, priority=5)
    assert policy.choose_victim([low, high]) is low
    big_low, small_low = seq("big", 500, priority=0), seq("small", 50, priority=0)
    top = seq("top", 10, priority=9)
    # inside the low tier its leader is spared while another member exists
    assert policy.choose_victim([big_low, small_low, top]) is small_low
    # one tier: exactly the spec (the leader of everything is never chosen)
    assert policy.choose_victim([seq("a", 10), seq("b", 20)]).request_id == "a"


def test_restore_order_priority_first_then_the_chosen_order():
    early = seq("early", 10, n_preempt=1, parked_at=1.0)
    starved = seq("starved", 10, n_preempt=3, parked_at=5.0)
    vip = seq("vip", 10, n_preempt=0, parked_at=9.0, priority=2)
    assert policy.restore_order([early, starved, vip], "spec") == [vip, starved, early]
    assert policy.restore_order([early, starved, vip], "fair") == [vip, early, starved]
