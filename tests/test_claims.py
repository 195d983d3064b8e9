"""Claims decide which search runs a launch when several share a study's storage: a launch
is claimed once, the budget's slots are never exceeded, an abandoned launch is free again,
and a search that stops beating loses its unfinished claims; the planner counts other
searches' launches as its own. Against SQLite here; on a real PostgreSQL server with real
concurrent searches in test_shared_storage.py."""

from __future__ import annotations

import functools
import json

import numpy as np
import optuna
import pytest
import sqlalchemy as sa
from optuna.trial import TrialState
from studykit import small_study
from synthetic import launch as synthetic_launch

from treetune.config import BASELINE, TreeConfig
from treetune.errors import TreetuneError
from treetune.perfmodel import PerfModel
from treetune.results import LaunchResult, config_key
from treetune.space import load_space
from treetune.study.claims import Claim, Claims, created_racing
from treetune.study.offline import Noise, simulate_launch
from treetune.study.planner import Planner
from treetune.study.spec import load_study
from treetune.study.storage import RESULT_ATTR, StudyStore


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
    assert alive.unfinished(gone.driver) == [("3,4,8", 0, 7)]
    # Read, not released: a reaper that dies before failing the trials leaves the dead
    # search for the next one to find.
    assert claims_of(engine).unfinished(gone.driver) == [("3,4,8", 0, 7)]
    assert alive.dead(stale_after_s=0.0) == [gone.driver]
    alive.reap(gone.driver)
    assert alive.unfinished(gone.driver) == []
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


# ---- the planner's view of other searches' launches -------------------------------------

def planner_of(tmp_path):
    spec = load_study(None, small_study(tmp_path, search={"strategy": "grid",
                                                          "max_launches_per_config": 1}))
    store = StudyStore(spec, storage=optuna.storages.InMemoryStorage())
    return spec, Planner(spec, store, load_space(spec.space), [])


def measured(spec, config):
    truth = PerfModel(spec.backend.facts(spec.launch_spec(), {}), spec.tp)
    return simulate_launch(truth, config, spec, np.random.default_rng(0), Noise(0, 0, 0))


def test_a_launch_another_search_runs_is_known_and_its_result_counts_as_ours(tmp_path):
    spec, planner = planner_of(tmp_path)
    planner.expect(BASELINE, 0)  # the other search runs the baseline: not queued here
    assert planner.is_known("baseline") and [t.key for t in planner.elsewhere] == ["baseline"]
    assert planner.next().key == "3,4,8"  # the compared tree
    planner.expect(TreeConfig(1, 1, 2), 0)
    # Proposals need not wait for the baseline another search runs (a free worker would
    # idle), and the grid skips what runs elsewhere.
    assert planner.next().key == "1,2,2"
    planner.absorb(measured(spec, BASELINE), 0)
    assert planner.baseline is not None and planner.launches == 1
    assert [t.key for t in planner.elsewhere] == ["1,1,2"]


def test_a_baseline_given_up_by_another_search_is_queued_again_first(tmp_path):
    _, planner = planner_of(tmp_path)
    planner.expect(BASELINE, 0)
    planner.expect(TreeConfig(1, 1, 2), 0)
    planner.given_up("baseline", 0)
    planner.given_up("1,1,2", 0)  # a proposed tree is the strategy's to propose again
    assert [t.key for t in planner.queue] == ["baseline", "3,4,8"] and not planner.elsewhere
    assert not planner.is_known("1,1,2")


def test_a_launch_handed_over_counts_as_running_elsewhere(tmp_path):
    _, planner = planner_of(tmp_path)
    task = planner.next()
    planner.hand_over(task)
    assert task.elsewhere and planner.elsewhere == [task] and planner.is_known(task.key)


def test_a_lost_race_to_create_tables_is_tried_again_and_a_lasting_failure_is_named():
    attempts = []

    def create_after_a_race():
        attempts.append(1)
        if len(attempts) == 1:
            raise sa.exc.OperationalError("CREATE TABLE", {}, Exception("already exists"))
        return "made"

    assert created_racing(create_after_a_race, "cannot create", sa.exc.SQLAlchemyError) == "made"
    assert len(attempts) == 2

    def never():
        attempts.append(1)
        raise sa.exc.OperationalError("CREATE TABLE", {}, Exception("disk full"))

    attempts.clear()
    with pytest.raises(TreetuneError) as lasting:
        created_racing(never, "cannot create the tables", sa.exc.SQLAlchemyError, tries=2)
    assert len(attempts) == 2
    # The database's words on one line, not SQLAlchemy's SQL dump and link after them (a
    # helper's audit: a read-only study.db gave ten lines).
    assert str(lasting.value) == "cannot create the tables: (builtins.Exception) disk full"

    def told():  # an error already explained is not tried again
        attempts.append(1)
        raise TreetuneError("its database driver is not installed")

    attempts.clear()
    with pytest.raises(TreetuneError, match="driver is not installed"):
        created_racing(told, "cannot open")
    assert len(attempts) == 1


def test_a_stale_launchs_logs_are_set_aside_at_once_whether_or_not_it_is_redone(tmp_path):
    """A launch its killed search never stored kept its log under the launch's own name
    until the same launch was done again: when the resumed search did not redo it, the
    logs under launch names and the stored launches differed by one."""
    from treetune.study.worker import log_name, set_aside

    spec = load_study(None, small_study(tmp_path))
    store = StudyStore(spec)
    tree = TreeConfig(3, 4, 8)
    store.finish_launch(store.begin_launch(tree, (), launch_index=0),
                        LaunchResult(tree, reason="measured"))
    store.begin_launch(tree, (), launch_index=1)  # killed while it ran, and its retry
    logs = spec.output_dir / "logs"
    logs.mkdir(parents=True)
    for index, attempt in ((0, 0), (1, 0), (1, 1)):
        (logs / log_name("3,4,8", index, attempt)).write_text(f"{index}-{attempt}")
    stale = StudyStore(spec).mark_stale()
    assert stale == [("3,4,8", 1)]
    for key, index in stale:
        set_aside(logs, key, index)
    assert sorted(p.name for p in logs.iterdir()) == [
        "3-4-8.launch2-1.earlier.log", "3-4-8.launch2.earlier.log", "3-4-8.log"]
    assert (logs / "3-4-8.launch2-1.earlier.log").read_text() == "1-1"


def test_a_launch_whose_result_was_stored_but_not_its_end_is_kept_not_failed_as_stale(
        tmp_path):
    """`finish_launch` writes the result, then the trial's end. A search that died between
    the two (or lost its database) left a running trial holding its result; failing it as
    stale made it count as finished all the same (a finished trial with a result), so the
    launch was neither kept as measured nor redone: a rerun of a study on a PostgreSQL
    server stopped mid-study stored 3 of its 4 launches (a helper's finding)."""
    spec = load_study(None, small_study(tmp_path))
    store = StudyStore(spec)
    measured, failed, cut = TreeConfig(3, 4, 8), TreeConfig(1, 1, 2), TreeConfig(2, 2, 4)
    for config, result in ((measured, LaunchResult(config=measured, ok=True)),
                           (failed, LaunchResult(config=failed, reason="out of memory"))):
        trial = store.begin_launch(config, (), launch_index=0)
        store.storage.set_trial_user_attr(trial._trial_id, RESULT_ATTR,
                                          json.dumps(result.to_dict()))  # the first write
    store.begin_launch(cut, (), launch_index=0)  # killed while it ran
    assert StudyStore(spec).mark_stale() == [("2,2,4", 0)]
    finished = {config_key(s.result.config): s for s in store.finished_launches()}
    assert set(finished) == {"3,4,8", "1,1,2"}
    states = {t.user_attrs["config"]: t.state for t in store.launches.get_trials()}
    assert states == {"3,4,8": TrialState.COMPLETE, "1,1,2": TrialState.FAIL,
                      "2,2,4": TrialState.FAIL}
    assert finished["1,1,2"].result.reason == "out of memory"


def test_a_launchs_trial_is_written_naming_its_search_so_a_database_lost_after_is_stale(
        tmp_path):
    """A launch's trial was asked, then given its config, flags and search one write at a
    time: a PostgreSQL server stopped between the writes left a RUNNING launch naming no
    search, which the rerun (failing the dead search's launches by its name) never failed
    (CI, stop 94). Each write after the trial's own now fails, as a lost database's would:
    the trial is born whole, and failed as the dead search's."""
    spec = load_study(None, small_study(tmp_path))
    store = StudyStore(spec)

    def lost(*args, **kwargs):
        raise optuna.exceptions.StorageInternalError("the database stopped answering")

    for write in ("set_trial_user_attr", "set_trial_system_attr", "set_trial_param",
                  "set_trial_state_values"):
        setattr(store.storage, write, lost)
    store.begin_launch(TreeConfig(1, 2, 2), (("--speculative-eagle-topk", "2"),),
                       driver="dead", launch_index=0, node="n1")
    rerun = StudyStore(spec)
    (trial,) = rerun.launches.get_trials(states=(TrialState.RUNNING,))
    assert trial.user_attrs == {"config": "1,2,2", "flags": [["--speculative-eagle-topk", "2"]],
                                "driver": "dead", "launch_index": 0, "node": "n1"}
    assert rerun.mark_stale("alive") == []  # another search's launch is left alone
    assert rerun.mark_stale("dead") == [("1,2,2", 0)]
    assert not rerun.launches.get_trials(states=(TrialState.RUNNING,))


def test_a_search_that_loses_the_database_while_reaping_a_dead_one_leaves_it_to_the_next(
        tmp_path):
    """A search reaping a dead one released its claims and heartbeat row first, then
    failed its trials: a reaper that died (or lost the database) between the two left the
    dead search's launch running for good, since nothing named that search again (a
    helper's audit). Its trials now go first, its claims last."""
    from treetune.study.claims import Claims
    from treetune.study.runner import _Others

    spec = load_study(None, small_study(tmp_path))
    store = StudyStore(spec)
    gone = Claims.of(store.storage, spec.name)
    gone.start_beating()
    gone.take("3,4,8", 0, budget=None)
    store.driver = gone.driver
    trial = store.begin_launch(TreeConfig(3, 4, 8), (), driver=gone.driver, launch_index=0)
    gone.attach("3,4,8", 0, trial._trial_id)
    gone._beating.set()  # its process died
    reaper = StudyStore(spec)

    def lost(driver=None):
        raise optuna.exceptions.StorageInternalError("the database stopped answering")

    reaper.mark_stale = lost
    claims = Claims.of(reaper.storage, spec.name)
    assert claims.dead(stale_after_s=0.0) == []  # seen once: standing still since now
    claims.dead = functools.partial(claims.dead, stale_after_s=0.0)
    with pytest.raises(optuna.exceptions.StorageInternalError):
        _Others(reaper, claims, set()).follow(None, None, force=True)  # type: ignore[arg-type]
    later = Claims.of(reaper.storage, spec.name)
    later.dead(stale_after_s=0.0)
    assert later.dead(stale_after_s=0.0) == [gone.driver]  # still found dead
    assert later.unfinished(gone.driver) == [("3,4,8", 0, trial._trial_id)]


def test_a_search_ending_whose_trials_the_storage_would_not_fail_leaves_its_heartbeat(
        tmp_path):
    """Ending, a search failed its running launches' trials, then released its claims and
    deleted its heartbeat's row, each write on its own: a brief outage that lost the first
    but not the others left its launch RUNNING under a search no one would find dead (a
    helper's audit). Its row now stays unless every trial was failed."""
    from treetune.study.claims import Claims
    from treetune.study.runner import _give_up

    spec = load_study(None, small_study(tmp_path))
    for outage in (False, True):
        store = StudyStore(spec)
        claims = Claims.of(store.storage, spec.name)
        claims.start_beating()
        claims.take("3,4,8", int(outage), budget=None)
        trial = store.begin_launch(TreeConfig(3, 4, 8), (), driver=claims.driver,
                                   launch_index=int(outage))
        if outage:
            def lost(*args):
                raise optuna.exceptions.StorageInternalError("the database stopped answering")
            store.abandon = lost
        _give_up(store, None, claims, True, [trial], "interrupted")
        watcher = Claims.of(store.storage, spec.name)
        watcher.dead(stale_after_s=0.0)
        assert watcher.dead(stale_after_s=0.0) == ([claims.driver] if outage else [])
        assert watcher.unfinished(claims.driver) == []  # its claims released all the same
        state = store.storage.get_trial(trial._trial_id).state
        assert state == (TrialState.RUNNING if outage else TrialState.FAIL)
        if outage:  # found dead: failed as its search's
            assert StudyStore(spec).mark_stale(claims.driver) == [("3,4,8", 1)]


def test_a_study_whose_first_run_lost_its_database_while_writing_it_is_written_whole_next(
        tmp_path, monkeypatch):
    """A new study's attributes were written fingerprint first: a first run that lost its
    database after that write left the fingerprint alone, and every later run took the
    study as written (a resume warned of a prefix cache it never ran with, `treetune
    report` on the URL found no spec; a helper's audit)."""
    spec = load_study(None, small_study(tmp_path))
    written = []
    real = optuna.Study.set_user_attr

    def lost_after_one(study, key, value):
        if written:
            raise optuna.exceptions.StorageInternalError("the database stopped answering")
        written.append(key)
        real(study, key, value)

    monkeypatch.setattr(optuna.Study, "set_user_attr", lost_after_one)
    with pytest.raises(optuna.exceptions.StorageInternalError):
        StudyStore(spec)
    monkeypatch.setattr(optuna.Study, "set_user_attr", real)
    store = StudyStore(spec)
    attrs = store.launches.user_attrs
    assert {"spec", "datasets", "batch", "spec_fingerprint"} <= set(attrs), sorted(attrs)
    assert not store.cached_prefixes


def test_a_proposal_is_tagged_with_its_search_when_asked_so_a_queued_one_is_stale_too(
        tmp_path):
    """Proposals were tagged with their search only when launched: one still queued when
    its search died (killed, or its database lost) stayed RUNNING in its batch study for
    good, naming no search to fail it by. Asked by a search sharing the study, a proposal
    names it at once; asked alone, it names none (nothing else runs the study)."""
    from treetune.strategies._trials import BatchStudies

    spec = load_study(None, small_study(tmp_path))
    space = load_space(spec.space)
    alone = StudyStore(spec)
    BatchStudies(alone, space).ask(1)
    (untagged,) = alone.batch_studies[1].get_trials(states=(TrialState.RUNNING,))
    assert "driver" not in untagged.user_attrs
    assert alone.mark_stale() == []  # a proposal is failed, not counted as a launch
    shared = StudyStore(spec)
    shared.driver = "dead"
    studies = BatchStudies(shared, space)
    for batch in spec.batch:
        studies.ask(batch)
    queued = [t for study in shared.batch_studies.values()
              for t in study.get_trials(states=(TrialState.RUNNING,))]
    assert [t.user_attrs["driver"] for t in queued] == ["dead"] * len(spec.batch)
    rerun = StudyStore(spec)
    rerun.mark_stale("alive")
    assert len([t for study in rerun.batch_studies.values()
                for t in study.get_trials(states=(TrialState.RUNNING,))]) == len(spec.batch)
    rerun.mark_stale("dead")
    for study in rerun.batch_studies.values():
        assert not study.get_trials(states=(TrialState.RUNNING,))
        assert all(t.user_attrs.get("reason") for t in study.get_trials(
            states=(TrialState.FAIL,)))


def test_a_proposal_left_naming_no_search_is_failed_once_it_stays_untagged(tmp_path):
    """A search sharing a study asks a proposal, then tags it (Optuna's `ask` takes no
    attributes): one that died between the two writes left a proposal naming no search,
    RUNNING for good, which TPE's constant liar counts as running. A proposal seen
    untagged for the stale time is failed; one tagged meanwhile, or tagged from the start,
    is left to its search."""
    from treetune.strategies._trials import BatchStudies
    from treetune.study.runner import Progress, _Others

    spec = load_study(None, small_study(tmp_path))
    space = load_space(spec.space)
    store = StudyStore(spec)
    store.driver = "live"
    studies = BatchStudies(store, space)
    tagged, _ = studies.ask(1)
    orphan = store.batch_studies[1].ask(studies.distributions)  # its search died here
    late = store.batch_studies[1].ask(studies.distributions)  # its search tags it soon
    others = _Others(store, Claims(store.storage.engine, spec.name), set())
    others.fail_orphans(stale_after_s=3600.0)
    assert set(others.untagged) == {orphan._trial_id, late._trial_id}

    def state(trial):
        return store.storage.get_trial(trial._trial_id).state

    assert {state(t) for t in (tagged, orphan, late)} == {TrialState.RUNNING}
    store.tag(late)
    with pytest.MonkeyPatch.context() as patch:  # as a search's own look does it
        patch.setattr("treetune.study.runner.ORPHAN_AFTER", 0)
        others.follow(Planner(spec, store, space, []), Progress(budget=None), force=True)
    assert (state(tagged), state(orphan), state(late)) == (
        TrialState.RUNNING, TrialState.FAIL, TrialState.RUNNING)
    assert store.storage.get_trial(orphan._trial_id).user_attrs["reason"]
    assert others.untagged == {}
    # A live search whose proposal was failed before its tag (a sampler slower than the
    # wait) asks again, rather than failing on the tag.
    tag = store.tag

    def failed_first(trial):
        store.tag = tag
        store.fail_stale(trial._trial_id)
        tag(trial)

    store.tag = failed_first
    again, _ = studies.ask(1)
    assert state(again) == TrialState.RUNNING
    assert store.storage.get_trial(again._trial_id).user_attrs["driver"] == "live"


def test_a_shared_study_tells_the_batch_studies_what_ended_searches_left_untold(tmp_path):
    """A search tells each batch study its trees once its baseline is in, each write on its
    own: one that ended (or died) between the writes, or before its baseline, left trees
    some or all batch studies lack. With a shared database a resumed search told none,
    since another search may still hold its own in wait (a helper's audit). Now a
    search's trees are told by others once it has ended, or by the one search that reaped
    it; never those of a search still running."""
    from treetune.strategies._trials import BatchStudies
    from treetune.study.runner import Progress, _Others

    data = small_study(tmp_path, batch=[1, 32], datasets=["humaneval"])
    spec = load_study(None, {**data, "storage": "postgresql://nobody@127.0.0.1:1/none"})
    assert spec.shared_storage
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'shared.db'}")
    store = StudyStore(spec, storage=storage)

    def measured(config, tput, driver):
        result = synthetic_launch(config, {1: {"humaneval": tput}, 32: {"humaneval": 9 * tput}})
        trial = store.begin_launch(config, (), driver=driver, launch_index=0)
        store.finish_launch(trial, result)
        return result

    base = measured(BASELINE, 100.0, "ended")
    ended, live, dead = TreeConfig(3, 1, 4), TreeConfig(1, 1, 2), TreeConfig(3, 2, 4)
    results = [base, measured(ended, 110.0, "ended"), measured(live, 105.0, "live"),
               measured(dead, 108.0, "dead")]
    studies = BatchStudies(store, load_space(spec.space))
    store.record(1, None, {"steps": 3, "topk": 1, "draft_tokens": 4},
                 studies.distributions, results[1], base)  # batch 32's write was lost
    for name in ("live", "dead"):
        other = Claims(storage.engine, spec.name)
        other.driver = name
        other.beat()  # its heartbeat row
    planner = Planner(spec, store, load_space(spec.space), results)
    assert store.told() == {1: {"3,1,4"}, 32: set()}, "a shared study tells nothing alone"
    claims = Claims(storage.engine, spec.name)
    claims.start_beating()
    try:
        others = _Others(store, claims, {s.trial_id for s in store.finished_launches()})
        claims.dead = functools.partial(claims.dead, stale_after_s=0.0)
        others.follow(planner, Progress(budget=None), force=True)
        # The ended search's tree, told to the batch study that lacked it; not the others.
        assert store.told() == {1: {"3,1,4"}, 32: {"3,1,4"}}
        live_claims = Claims(storage.engine, spec.name)
        live_claims.driver = "live"
        live_claims.beat()  # "live" beats on, "dead" not
        others.follow(planner, Progress(budget=None), force=True)  # "dead" found dead
        assert store.told() == {1: {"3,1,4", "3,2,4"}, 32: {"3,1,4", "3,2,4"}}
        live_claims.beat()
        others.follow(planner, Progress(budget=None), force=True)
        assert len(store.batch_studies[32].get_trials()) == 2, "each told once"
        others.follow(planner, Progress(budget=None), force=True)  # "live" found dead too
        assert store.told()[32] == {"3,1,4", "3,2,4", "1,1,2"}
    finally:
        claims.stop_beating()

