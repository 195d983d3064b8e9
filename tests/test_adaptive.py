"""SGLang's adaptive step controller (treetune.backends.sglang_adaptive) against step
sequences computed by hand from its rules (domain.md section 7)."""

from __future__ import annotations

import json

import pytest

from treetune.backends import sglang_adaptive as adaptive
from treetune.backends.sglang_adaptive import AdaptiveConfigError, Schedule, Slot


def run(slot: Slot, stream: list[int]) -> list[int]:
    """The slot's steps after each verify of a stream of (one request's) accepted drafts."""
    out = []
    for accepted in stream:
        slot.verified([accepted])
        out.append(slot.steps)
    return out


def test_warm_up_then_every_update_interval_it_steps_up_one_candidate_at_a_time():
    # [1,3,5,7] from 3: the average starts at 2 and moves 20% toward 4 per verify:
    # 4 - 2 * 0.8**n. Nothing changes during the 10 warm-up verifies nor until the 5th
    # after them; at verify 15 the average is 3.93: above 3 - 0.5, not above 5 - 0.5.
    slot = Slot([1, 3, 5, 7], steps=3)
    steps = run(slot, [4] * 20)
    assert steps[:14] == [3] * 14 and steps[14:] == [5] * 6
    assert slot.ema == pytest.approx(4 - 2 * 0.8 ** 20)


def test_down_hysteresis_delays_the_step_down():
    # After 15 verifies at 4 (steps 5), zeros: the average falls by 0.8 per verify.
    # Verify 20: 3.93 * 0.8**5 = 1.29 <= 3 - 0.5 - 0.25, > 1 - 0.5 - 0.25: down to 3.
    # Verify 25: 0.42, above 0.25, so it stays at 3; verify 30: 0.14: down to 1.
    slot = Slot([1, 3, 5, 7], steps=3)
    steps = run(slot, [4] * 15 + [0] * 15)
    assert steps[14] == 5 and steps[15:19] == [5] * 4
    assert steps[19:29] == [3] * 10 and steps[29] == 1
    # Without the hysteresis the average of 0.42 at verify 25 is low enough already.
    eager = Slot([1, 3, 5, 7], steps=3, down_hysteresis=0.0)
    steps = run(eager, [4] * 15 + [0] * 15)
    assert steps[19] == 3 and steps[24] == 1


def test_step_zero_stops_drafting_then_probes_the_next_candidate():
    # [0,1,3] from 1: the average starts at 0; zeros keep it there (0 <= 0 + 0.5): no
    # drafting from verify 15. At 0 the average is not fed; at verify 20 it probes 1.
    # Then 2 accepted drafts per verify: 2 * (1 - 0.8**5) = 1.34 at verify 25, above
    # 1 - 0.5 and not above 3 - 0.5: up to 3.
    slot = Slot([0, 1, 3], steps=1, down_hysteresis=0.0)
    steps = run(slot, [0] * 15 + [5] * 5 + [2] * 5)
    assert steps[13] == 1 and steps[14:19] == [0] * 5 and steps[19] == 1
    assert steps[24] == 3
    assert slot.ema == pytest.approx(2 * (1 - 0.8 ** 5))


def test_the_ceiling_caps_a_step_that_did_not_rise():
    # [1,3,5,7] from 7: the average starts at 6 and falls toward 3: 3.11 at verify 15.
    # The down rule stops at 5 (3.11 > 3 - 0.5 - 0.25); a ceiling of ceil(3.11 x 1) = 4
    # takes it to 3.
    assert run(Slot([1, 3, 5, 7], steps=7), [3] * 15)[-1] == 5
    assert run(Slot([1, 3, 5, 7], steps=7, ceiling_coeff=1.0), [3] * 15)[-1] == 3


def test_settings_come_from_the_slot_then_the_top_level_then_sglang_defaults():
    config = {"warmup_batches": 2, "update_interval": 1,
              "1": {"candidate_steps": [1, 3], "ema_alpha": 1.0}, "8": {"candidate_steps": [1]}}
    schedule = Schedule(config, steps=1)
    one, eight = schedule.slots[1], schedule.slots[8]
    assert (one.ema_alpha, one.warmup_batches, one.update_interval) == (1.0, 2, 1)
    assert (eight.ema_alpha, eight.down_hysteresis, eight.up_hysteresis) == (0.2, -0.25, 0.0)
    # alpha 1: the average is the last verify's; the third verify is the first update.
    assert [schedule.verified(1, [5]) for _ in range(3)] == [False, False, True]
    assert schedule.current() == {"1": 3, "8": 1}


def test_routing_pads_to_the_cuda_graph_batch_size_then_takes_the_largest_key_not_above():
    graphs = adaptive.graph_batch_sizes(64)
    assert graphs[:10] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12] and graphs[-1] == 64
    schedule = Schedule(adaptive.DEFAULT_CONFIG, steps=3, graph_sizes=graphs)
    assert [schedule.slot_key(b) for b in (1, 7, 8, 9, 31, 33, 64, 100)] == [
        1, 1, 8, 8, 32, 32, 64, 64]
    # 31 runs in the 32 slot only because its graph is 32 wide; without padding it is 8's.
    assert Schedule(adaptive.DEFAULT_CONFIG, steps=3).slot_key(31) == 8
    # Below the smallest key: the smallest slot.
    assert Schedule({"4": {"candidate_steps": [1]}}, steps=1).slot_key(1) == 4


def test_above_256_the_cuda_graphs_step_by_16_as_sglangs_do():
    # A batch of 260 runs in the 272 graph, not one as wide as the largest batch.
    graphs = adaptive.graph_batch_sizes(512)
    assert graphs[graphs.index(256):] == [256, *range(272, 513, 16)]
    assert adaptive.graph_batch_sizes(300)[-3:] == [272, 288, 300]


def test_default_config_and_initial_steps():
    assert adaptive.candidate_steps(adaptive.DEFAULT_CONFIG) == [0, 1, 3, 5, 7]
    assert adaptive.initial_steps(adaptive.DEFAULT_CONFIG, None) == 3  # the middle one
    assert adaptive.initial_steps(adaptive.DEFAULT_CONFIG, 5) == 5
    with pytest.raises(AdaptiveConfigError, match=r"--speculative-num-steps=4 is not in the "
                       r"adaptive config candidate_steps \[0, 1, 3, 5, 7\]"):
        adaptive.initial_steps(adaptive.DEFAULT_CONFIG, 4)
    # Each slot starts at the initial steps when it is its candidate, else its middle one.
    schedule = Schedule(adaptive.DEFAULT_CONFIG, steps=3)
    assert schedule.current() == {"1": 3, "8": 3, "32": 1, "64": 0}


@pytest.mark.parametrize(("config", "message"), [
    ({"1": {"candidate_steps": []}}, "BS 1: candidate_steps must be a list of non-negative"),
    ({"1": {"candidate_steps": [1, -1]}}, "BS 1: candidate_steps"),
    ({"8": {"candidate_steps": "1,3"}}, "BS 8: candidate_steps"),
    ({"8": {}}, "BS 8: candidate_steps"),
    ({"ema_alpha": 0.3, "x1": {"candidate_steps": [1]}}, "at least one integer-string BS key"),
    ([1, 3], "must be a JSON object"),
])
def test_configs_sglang_refuses_are_refused_with_its_message(config, message):
    with pytest.raises(AdaptiveConfigError, match=message):
        adaptive.validate(config)


def test_a_config_file_is_loaded_and_checked(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"1": {"candidate_steps": [2, 4]}, "update_interval": 3}))
    assert adaptive.candidate_steps(adaptive.load(good)) == [2, 4]
    bad = tmp_path / "bad.json"
    bad.write_text("{1: [2]}")
    with pytest.raises(AdaptiveConfigError, match=r"bad\.json is not JSON"):
        adaptive.load(bad)
    with pytest.raises(AdaptiveConfigError, match="cannot read"):
        adaptive.load(tmp_path / "missing.json")
    assert adaptive.load(None) == adaptive.DEFAULT_CONFIG


def test_when_adaptive_cannot_run_sglang_says_so_and_serves_static_trees():
    assert adaptive.unsupported_reason("EAGLE3", None) is None
    assert adaptive.unsupported_reason("eagle", 1) is None
    reason = adaptive.unsupported_reason("EAGLE3", 4)
    assert reason == "speculative_eagle_topk=4 (only topk=1 is supported)"
    assert "only EAGLE/EAGLE3" in (adaptive.unsupported_reason("NGRAM", None) or "")
    assert adaptive.unsupported_reason("NEXTN", 1) is None  # resolved to EAGLE first
    assert adaptive.fallback_warning(reason) == (
        "speculative_adaptive disabled: speculative_eagle_topk=4 (only topk=1 is supported). "
        "Falling back to static speculative params.")


def test_an_average_exactly_at_the_threshold_steps_down_and_does_not_step_up():
    # alpha 1 and no warm-up: the average is the last verify's mean over its requests.
    slot = Slot([0, 1, 3], steps=1, ema_alpha=1.0, warmup_batches=0, update_interval=1,
                down_hysteresis=0.0)
    assert slot.verified([0, 1]) and slot.steps == 0  # 0.5 <= 0 + 0.5: no drafting
    rising = Slot([1, 3], steps=1, ema_alpha=1.0, warmup_batches=0, update_interval=1)
    assert not rising.verified([0, 1]) and rising.steps == 1  # 0.5 is not above 1 - 0.5
    assert rising.verified([1, 1]) and rising.steps == 3


def test_the_fall_back_reason_is_read_back_from_a_server_log():
    reason = "speculative_eagle_topk=4 (only topk=1 is supported)"
    log = (f"[2026-01-01 10:00:00] {adaptive.fallback_warning(reason)}\n"
           "[2026-01-01 10:00:01] server_args=ServerArgs(speculative_adaptive=False)\n")
    assert adaptive.fallback_reason(log) == reason
    assert adaptive.fallback_reason("[2026-01-01 10:00:01] ready\n") is None
