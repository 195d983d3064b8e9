"""Claims decide which search runs a launch when several share a study's storage: a launch
is claimed once, the budget's slots are never exceeded, an abandoned launch is free again,
and a search that stops beating loses its unfinished claims. Against SQLite here; the same
rows on a real PostgreSQL server with real concurrent searches in test_shared_storage.py."""

from __future__ import annotations

import sqlalchemy as sa

from treetune.study.claims import Claim, Claims


def claims_of(engine, study="s"):
    return Claims(engine, study)


def engine_at(tmp_path):
    return sa.create_engine(f"sqlite:///{tmp_path / 'claims.db'}")


def test_a_launch_is_claimed_by_one_search_only(tmp_path):
    engine = engine_at(tmp_path)
    first, second = claims_of(engine), claims_of(engine)
    assert first.take("3,4,8", 0, budget=10) == (Claim.MINE, 0)
    assert second.take("3,4,8", 0, budget=10) == (Claim.TAKEN, 0)
    assert first.take("3,4,8", 0, budget=10) == (Claim.MINE, 0)  # its own, rescheduled
    assert second.take("3,4,8", 1, budget=10) == (Claim.MINE, 1)  # a re-measurement
    running, claimed = first.others()
    assert [(r.key, r.index) for r in running] == [("3,4,8", 1)]
    assert claimed == {("3,4,8", 0), ("3,4,8", 1)}


def test_the_searches_together_never_take_more_slots_than_the_budget(tmp_path):
    engine = engine_at(tmp_path)
    searches = [claims_of(engine) for _ in range(3)]
    taken = [s.take(f"1,1,{n}", 0, budget=4)[0] for n, s in
             zip(range(2, 8), searches * 2, strict=False)]
    assert taken == [Claim.MINE] * 4 + [Claim.SPENT] * 2


def test_an_abandoned_launch_frees_its_config_and_its_slot_and_a_done_one_keeps_both(tmp_path):
    engine = engine_at(tmp_path)
    first, second = claims_of(engine), claims_of(engine)
    assert first.take("baseline", 0, budget=2)[0] is Claim.MINE
    assert first.take("3,4,8", 0, budget=2)[0] is Claim.MINE
    first.finish("baseline", 0)
    first.release("3,4,8", 0)
    assert second.take("3,4,8", 0, budget=2)[0] is Claim.MINE
    assert second.take("5,1,6", 0, budget=2)[0] is Claim.SPENT
    assert second.take("baseline", 0, budget=3)[0] is Claim.TAKEN


def test_a_done_launch_the_search_already_counts_moves_its_next_claim_to_a_free_index(
        tmp_path):
    """A re-measurement given up between two done ones leaves its index free: a search
    counting the two done launches asks for index 2, which is done; it gets index 1."""
    engine = engine_at(tmp_path)
    first, second = claims_of(engine), claims_of(engine)
    first.take("3,4,8", 0, budget=None)
    first.attach("3,4,8", 0, 100)
    first.finish("3,4,8", 0)
    first.take("3,4,8", 1, budget=None)
    second.take("3,4,8", 2, budget=None)
    second.attach("3,4,8", 2, 102)
    second.finish("3,4,8", 2)
    first.release("3,4,8", 1)
    assert first.take("3,4,8", 2, budget=None, known={100, 102}) == (Claim.MINE, 1)
    assert second.take("3,4,8", 2, budget=None) == (Claim.TAKEN, 2)  # not counted yet


def test_finished_launches_stored_before_claims_get_done_claims_once(tmp_path):
    engine = engine_at(tmp_path)
    first, second = claims_of(engine), claims_of(engine)
    finished = [(1, "baseline"), (2, "3,4,8"), (3, "3,4,8")]
    first.sync(finished)
    second.sync(finished)  # a second search syncing the same launches adds nothing
    _, claimed = first.others()
    assert claimed == {("baseline", 0), ("3,4,8", 0), ("3,4,8", 1)}
    assert first.take("5,1,6", 0, budget=3)[0] is Claim.SPENT


def test_a_search_that_stops_beating_is_dead_and_its_unfinished_claims_are_released(tmp_path):
    engine = engine_at(tmp_path)
    alive, gone = claims_of(engine), claims_of(engine)
    gone.start_beating()
    gone.take("3,4,8", 0, budget=None)
    gone.attach("3,4,8", 0, 7)
    gone.take("baseline", 0, budget=None)
    gone.finish("baseline", 0)
    gone._beating.set()  # its process died: nothing beats any more (its row stays)
    assert alive.dead(stale_after_s=0.0) == []  # seen once: standing still since now
    assert alive.dead(stale_after_s=0.0) == [gone.driver]
    assert alive.reap(gone.driver) == [("3,4,8", 0, 7)]
    running, claimed = alive.others()
    assert running == [] and claimed == {("baseline", 0)}
    assert alive.take("3,4,8", 0, budget=None)[0] is Claim.MINE


def test_a_beating_search_is_never_dead(tmp_path):
    engine = engine_at(tmp_path)
    watcher, busy = claims_of(engine), claims_of(engine)
    busy.start_beating()
    try:
        busy.take("3,4,8", 0, budget=None)
        assert watcher.dead(stale_after_s=0.0) == []
        busy.beat()
        assert watcher.dead(stale_after_s=0.0) == []
    finally:
        busy.stop_beating()
