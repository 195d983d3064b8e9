"""Study storage: every launch and every per-batch Optuna study in one Optuna storage.

- `<name>:launches` holds one trial per server launch, its full `LaunchResult` as a user
  attribute (COMPLETE when measured, FAIL when the server could not start or crashed);
- `<name>:batch-<B>` is the Optuna study the search optimizes for batch size B: one
  trial per launched config, value = mean speedup over the datasets, one constraint per
  dataset (feasible when every dataset is at or above 1 - tolerance).

optuna-dashboard opens the storage as it is; rerunning a study resumes from it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sqlite3
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

import optuna
import sqlalchemy as sa
from optuna.distributions import BaseDistribution
from optuna.trial import TrialState

from treetune import __version__
from treetune.config import ServerConfig
from treetune.errors import TreetuneError, clip, first_line
from treetune.results import LaunchResult, config_key
from treetune.study.claims import CREATE_TRIES, created_racing
from treetune.study.evidence import StudyNoise, judge
from treetune.study.recommend import Recommendation
from treetune.study.spec import StudySpec, files_next_to, load_study, password_of, shown_url

RESULT_ATTR = "launch_result"
RECOMMENDATIONS_ATTR = "recommendations"  # what the search decided, as recommendations.json
STRATEGY_ATTR = "strategy"
CONFIG_ATTR = "config"
FINGERPRINT_ATTR = "spec_fingerprint"
# Set on studies whose servers run without a prefix cache (LaunchSpec.prefix_cache), as
# every study made since; an older study's launches ran with the engine's cache on.
NO_PREFIX_CACHE_ATTR = "no_prefix_cache"
SPEC_ATTR = "spec"
INDEX_ATTR = "launch_index"  # launches of a config before this one
DRIVER_ATTR = "driver"  # the search that runs a launch or asked a proposal
GPU_TYPE_ATTR = "gpu_type"  # the GPU type a study's launches run on
STALE_REASON = "stale: the search that ran this launch stopped before it finished"


def default_sampler(seed: int) -> optuna.samplers.BaseSampler:
    """TPE over the three knobs jointly (they interact: draft_tokens only matters within
    the pool steps and topk make). Every launch informs every batch size's study, so the
    random start-up can be short; pending launches are lied about so workers spread out."""
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=6,
                                      constant_liar=True)


LOCK_WAIT_S = 5.0  # how long a locked SQLite storage is waited for before giving up

# What a study's storage raises when its database stops answering mid-study (its server
# stopped, the network lost): Optuna's wrapper of a failed commit, and SQLAlchemy's own
# (Optuna's reads and treetune's claims).
STORAGE_ERRORS: tuple[type[Exception], ...] = (optuna.exceptions.StorageInternalError,
                                               sa.exc.DBAPIError)


def storage_lost(url: str, exc: BaseException) -> TreetuneError:
    """The error for a storage that stopped answering: the database's own first line (not
    Optuna's "invalid data in the commit" guess), never the URL's password."""
    root, seen = exc, set()
    while (root.__cause__ or root.__context__) is not None and id(root) not in seen:
        seen.add(id(root))
        root = root.__cause__ or root.__context__  # type: ignore[assignment]
    cause = first_line(root)
    if password := password_of(url):
        cause = cause.replace(str(password), "***")
    return TreetuneError(
        f"the study storage {shown_url(url)} stopped answering ({cause}): the launches "
        "finished before are stored; rerun the same command once it answers again (the "
        "launches left running are redone)")


def check_writable(folder: Path) -> None:
    """Raise OSError unless a file can be created in `folder` (permission bits, read-only
    mounts and immutable folders alike: root passes an access() check regardless)."""
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".treetune-probe-"):
        pass


def check_sqlite(url: str) -> None:
    """Fail early and clearly when a SQLite storage cannot be written: its folder is
    read-only, or another process holds the database locked."""
    path = Path(url.removeprefix("sqlite:///"))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        check_writable(path.parent)
    except OSError as exc:
        raise TreetuneError(f"cannot write the study storage {path}: its folder "
                            f"{path.parent} is not writable ({exc.strerror}); choose another "
                            "--storage or --output, or fix the folder's permissions") from None
    if path.is_dir():
        raise TreetuneError(f"the study storage {path} is a folder: give a database file's "
                            "path (sqlite:///path/to/study.db)")
    if not path.exists():
        return
    connection = sqlite3.connect(path, timeout=LOCK_WAIT_S)
    try:
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("SELECT count(*) FROM sqlite_master")  # reads the file's header
        connection.rollback()
    except sqlite3.DatabaseError as exc:
        if not isinstance(exc, sqlite3.OperationalError):  # "file is not a database"
            raise TreetuneError(f"the study storage {path} is not an SQLite database "
                                f"({exc}): give another --storage, or move that file "
                                "away") from None
        if "locked" in str(exc) or "busy" in str(exc):
            raise TreetuneError(
                f"the study storage {path} is locked by another process (still locked after "
                f"{LOCK_WAIT_S:g} s); close whatever holds it (another treetune search, a "
                "notebook or a sqlite3 shell writing to it) and rerun") from None
        raise TreetuneError(f"cannot write the study storage {path}: {exc}") from None
    finally:
        connection.close()


def _open_rdb(url: str) -> optuna.storages.RDBStorage:
    """Optuna's storage at `url`, its tables created if new (by the first of several
    searches starting at once: `created_racing`)."""
    sqlite = url.startswith("sqlite")

    def create() -> optuna.storages.RDBStorage:
        try:
            return optuna.storages.RDBStorage(
                url, engine_kwargs={"connect_args": {"timeout": 30}} if sqlite else None)
        except ModuleNotFoundError as exc:  # the database's driver
            raise TreetuneError(
                f"cannot open study storage {shown_url(url)}: its database driver is not "
                f"installed "
                f"({exc}); for PostgreSQL: pip install 'treetune[postgres]'") from None

    # SQLAlchemy raises many kinds; SQLite's file is the study's alone (its folder's lock).
    return created_racing(create, f"cannot open study storage {shown_url(url)}",
                          tries=1 if sqlite else CREATE_TRIES)


class StoredLaunch(NamedTuple):
    trial_id: int
    result: LaunchResult
    index: int | None  # launches of its config before it (None: stored by an older treetune)


def _changes(stored: Any, spec: StudySpec) -> str:
    """What differs between a stored study's spec and `spec`, field by field, as "batch:
    stored [1, 4], now [1, 8]" ("" when the stored spec cannot be read back)."""
    try:
        stored_spec = load_study(None, dict(stored))
    except Exception:  # an older or hand-edited spec: fall back to the general words
        return ""
    before, now = stored_spec.fingerprinted(), spec.fingerprinted()
    # What each side holds, defaults too: a fingerprint leaves some out at their default.
    held, holds = _every_field(stored_spec), _every_field(spec)
    parts = []
    for key in sorted(set(before) | set(now)):
        old, new = before.get(key), now.get(key)
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            for sub in sorted(set(old) | set(new)):
                if old.get(sub) != new.get(sub):
                    parts.append(f"{key}.{sub}: stored {held[key].get(sub)!r}, now "
                                 f"{holds[key].get(sub)!r}")
        else:
            parts.append(f"{key}: stored {held[key]!r}, now {holds[key]!r}")
    return "; ".join(parts)


def _files_found_next_to_the_study(stored: Any, fingerprint: str, spec: StudySpec) -> bool:
    """Whether the stored study is `spec` but for the profile, world or prior file it names
    relative to its study file: an older treetune stored them as written (a study resumed
    from the study file's folder found them there); now they are found next to the study
    file and stored as its paths (`files_next_to`)."""
    try:
        written = load_study(None, dict(stored))
        if written.fingerprint() != fingerprint:
            return False  # the stored spec is not what was fingerprinted
        found = load_study(None, files_next_to(dict(stored), Path(spec.base_dir)))
    except Exception:  # an older or hand-edited spec: not this case
        return False
    return found.fingerprint() == spec.fingerprint()


def _every_field(spec: StudySpec) -> dict[str, Any]:
    """The fingerprinted fields of `spec` with their defaults (`fingerprinted` leaves
    those out of older studies' fingerprints)."""
    return {**spec.fingerprinted(), "objective": spec.objective.value,
            "rates": sorted(spec.rates), "slo": dataclasses.asdict(spec.slo),
            "methods": {n: spec.method_draft(n) for n in spec.method_names},
            "measurement": dataclasses.asdict(spec.measurement),
            "backend": spec.backend_dict()}


class StudyStore:
    def __init__(self, spec: StudySpec,
                 sampler_factory: Callable[[int], optuna.samplers.BaseSampler] | None = None,
                 storage: optuna.storages.BaseStorage | None = None) -> None:
        """Open (or create) the study's storage; `storage` overrides the spec's URL (the
        search-efficiency benchmark keeps its studies in memory)."""
        self.spec = spec
        # The search running launches and asking proposals here (`begin_launch`, `tag`):
        # None for one that names none (offline, in-process).
        self.driver: str | None = None
        url = spec.storage_url
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        if storage is not None:
            self.storage = storage
        else:
            if url.startswith("sqlite:///"):
                check_sqlite(url)
            self.storage = _open_rdb(url)
        self.launches = optuna.create_study(
            study_name=f"{spec.name}:launches", storage=self.storage, load_if_exists=True)
        self._launches_id = self.storage.get_study_id_from_name(self.launches.study_name)
        stored = self.launches.user_attrs.get(FINGERPRINT_ATTR)
        if stored is None:
            self.launches.set_user_attr(SPEC_ATTR, spec.to_dict())  # readable from the URL
            self.launches.set_user_attr("datasets", spec.dataset_names)
            self.launches.set_user_attr("batch", list(spec.batch))
            self.launches.set_user_attr(NO_PREFIX_CACHE_ATTR, True)
            # Last: a study whose first run lost its database midway is written whole by
            # the next (with the fingerprint first, it kept the fingerprint alone).
            self.launches.set_user_attr(FINGERPRINT_ATTR, spec.fingerprint())
        elif stored != spec.fingerprint() and not _files_found_next_to_the_study(
                self.launches.user_attrs.get(SPEC_ATTR), stored, spec):
            changed = _changes(self.launches.user_attrs.get(SPEC_ATTR), spec) or (
                "no field reads back as changed: it was stored by another treetune version, "
                "or its stored spec no longer loads")
            raise TreetuneError(
                f"study '{spec.name}' in {shown_url(url)} was created with a different spec "
                f"({changed}"
                "); refusing to mix results. Start a new study with another --name or "
                "--output, or delete the old storage."
            )
        self.batch_studies = {
            b: optuna.create_study(
                study_name=f"{spec.name}:batch-{b}", storage=self.storage,
                direction="maximize", load_if_exists=True,
                sampler=(sampler_factory or default_sampler)(spec.seed + b))
            for b in spec.batch
        }
        # Each other draft method of the study searches its own trees in its own per-batch
        # studies (`<name>:batch-<B>:<METHOD>`): TPE must not learn one method's speed from
        # another's launches of the same tree.
        self.method_studies = {
            method: {b: optuna.create_study(
                study_name=f"{spec.name}:batch-{b}:{method}", storage=self.storage,
                direction="maximize", load_if_exists=True,
                sampler=(sampler_factory or default_sampler)(spec.seed + b))
                for b in spec.batch}
            for method in spec.method_names if method != spec.algorithm
        }

    def for_method(self, method: str) -> StudyStore:
        """This store with the per-batch studies of draft method `method` (a
        TreeConfig's; "": the study's own algorithm)."""
        if not method:
            return self
        view = copy.copy(self)
        view.batch_studies = self.method_studies[method]
        return view

    @property
    def cached_prefixes(self) -> bool:
        """Whether this study was made before its servers ran without a prefix cache."""
        return not self.launches.user_attrs.get(NO_PREFIX_CACHE_ATTR, False)

    def told(self) -> dict[int, set[str]]:
        """The configs (keys) each of this store's batch studies holds a measurement of,
        by batch size."""
        return {batch: {str(t.user_attrs[CONFIG_ATTR]) for t in study.get_trials(
                    deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                        if CONFIG_ATTR in t.user_attrs}
                for batch, study in self.batch_studies.items()}

    # ---- launches ---------------------------------------------------------------------
    def results(self) -> list[LaunchResult]:
        """Every finished launch, measured or failed, oldest first."""
        return _launch_results(self.launches)

    def measured_by(self) -> dict[str, set[str | None]]:
        """The searches (their driver names; None: a launch naming none) that finished a
        launch of each config, by config key."""
        out: dict[str, set[str | None]] = {}
        for trial in _finished(self.launches):
            key = config_key(_result_of(trial).config)
            out.setdefault(key, set()).add(trial.user_attrs.get(DRIVER_ATTR))
        return out

    def finished_launches(self) -> list[StoredLaunch]:
        """Every finished launch with its trial, oldest first (several searches of one
        study read each other's launches from here)."""
        return [StoredLaunch(t._trial_id, _result_of(t), t.user_attrs.get(INDEX_ATTR))
                for t in _finished(self.launches)]

    def mark_stale(self, driver: str | None = None) -> list[tuple[str, int]]:
        """Launches (and proposals) left RUNNING by a search that died: failed without a
        result, so they are redone (a launch that holds its result is ended from it,
        `fail_stale`); only those of search `driver` when given (others may be running
        them). Returns the stale launches as (config key, launch index), the key "" for
        one whose config was never written."""
        stale = []
        for study in (self.launches, *self._proposal_studies()):
            for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                if driver is not None and trial.user_attrs.get(DRIVER_ATTR) != driver:
                    continue
                if self.fail_stale(trial._trial_id) and study is self.launches:
                    stale.append((str(trial.user_attrs.get(CONFIG_ATTR) or ""),
                                  int(trial.user_attrs.get(INDEX_ATTR) or 0)))
        return stale

    def untagged_proposals(self) -> list[int]:
        """Proposals RUNNING in the batch (and method) studies that name no search. In a
        study several searches share, a proposal is asked, then tagged (Optuna's `ask`
        takes no attributes): one naming no search is one whose search died, or lost its
        database, between the two writes, if it stays untagged (`_Others.follow`)."""
        return [trial._trial_id for study in self._proposal_studies()
                for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                if DRIVER_ATTR not in trial.user_attrs]

    def _proposal_studies(self) -> list[optuna.Study]:
        """The studies proposals are asked in: per batch size, and per draft method's."""
        return [*self.batch_studies.values(),
                *(study for per in self.method_studies.values() for study in per.values())]

    def fail_stale(self, trial_id: int) -> bool:
        """One trial of a search that died, failed as stale (False: it had finished). A
        launch whose result was stored but not its end (`finish_launch` writes twice: the
        search died, or lost its database, between the two) was measured: it is ended
        from that result instead, not redone (False too)."""
        try:
            trial = self.storage.get_trial(trial_id)
            if RESULT_ATTR in trial.user_attrs:
                ok = _result_of(trial).ok
                self.storage.set_trial_state_values(
                    trial_id, TrialState.COMPLETE if ok else TrialState.FAIL,
                    [0.0] if ok else None)  # as `finish_launch` tells it
                return False
            self.storage.set_trial_user_attr(trial_id, "reason", STALE_REASON)
            self.storage.set_trial_state_values(trial_id, TrialState.FAIL)
        except RuntimeError:  # optuna's UpdateFinishedTrialError
            return False  # finished meanwhile, or failed by another search first
        return True

    def check_gpu_type(self, gpu_type: str | None) -> None:
        """A study's launches all run on one GPU type: stored with the study by its first
        run on a cluster that names it, and every later run must use the same."""
        if gpu_type is None:
            return
        stored = self.launches.user_attrs.get(GPU_TYPE_ATTR)
        if stored is None:
            self.launches.set_user_attr(GPU_TYPE_ATTR, gpu_type)
        elif stored != gpu_type:
            raise TreetuneError(
                f"study '{self.spec.name}' was measured on {stored} GPUs, and this run would "
                f"launch on {gpu_type}: speedups of two GPU types must not mix. Pin the "
                f"study with --gpu-type {stored}, or start a new study (another --name) for "
                f"{gpu_type}")

    def tag(self, trial: optuna.trial.Trial) -> None:
        """Mark a proposal's trial as asked by this store's search (`driver`): if that
        search dies, its trials are found and failed as stale while other searches of the
        study go on. Tagged when asked, not when launched: a proposal still queued when
        its search died was left RUNNING, naming no search, for good."""
        if self.driver is not None:
            trial.set_user_attr(DRIVER_ATTR, self.driver)

    def save_recommendations(self, recs: list[Recommendation], strategy: str) -> None:
        """What the search decided from the launches so far, kept with the study."""
        self.launches.set_user_attr(RECOMMENDATIONS_ATTR, [r.record() for r in recs])
        self.launches.set_user_attr(STRATEGY_ATTR, strategy)

    def begin_launch(self, config: ServerConfig, flags: tuple[tuple[str, str], ...],
                     **attrs: str | int | None) -> optuna.trial.Trial:
        """A launch's trial, RUNNING until its result is stored, naming this store's
        search (`driver`); `attrs`: where it runs (launch_index, node, gpu_type; a driver
        given here names another search), kept as user attributes.

        The trial is written with its attributes in one transaction: asked, then tagged
        one attribute at a time, a database lost between the writes left a RUNNING launch
        that named no search, which no rerun failed as stale (CI, stop 94)."""
        attrs = {DRIVER_ATTR: self.driver, **attrs}
        user_attrs = {CONFIG_ATTR: config_key(config), "flags": [list(f) for f in flags],
                      **{name: value for name, value in attrs.items() if value is not None}}
        template = optuna.trial.create_trial(state=TrialState.RUNNING, user_attrs=user_attrs)
        trial_id = self.storage.create_new_trial(self._launches_id, template)
        return optuna.trial.Trial(self.launches, trial_id)

    def finish_launch(self, trial: optuna.trial.Trial, result: LaunchResult) -> None:
        """The launch's result, then its end: two writes, so a launch that holds a result
        but still runs was measured (`fail_stale` ends it from its result)."""
        trial.set_user_attr(RESULT_ATTR, json.dumps(result.to_dict()))
        self.launches.tell(trial, 0.0 if result.ok else None,
                           state=TrialState.COMPLETE if result.ok else TrialState.FAIL)

    def abandon(self, trial: optuna.trial.Trial, study: optuna.Study, reason: str) -> None:
        """A launch or proposal that will not finish in this run: failed, no result, so a
        resumed search proposes it again."""
        trial.set_user_attr("reason", reason)
        study.tell(trial, state=TrialState.FAIL)

    # ---- per-batch optimisation -------------------------------------------------------
    def record(self, batch: int, trial: optuna.trial.Trial | None,
               params: dict[str, int], distributions: dict[str, BaseDistribution],
               result: LaunchResult, baseline: LaunchResult) -> None:
        """Tell batch B's study what a launch measured, via the trial that proposed it or a
        new trial with the same parameters."""
        value, constraints = self.objective(batch, result, baseline)
        attrs = {CONFIG_ATTR: config_key(result.config)}
        study = self.batch_studies[batch]
        if trial is None:
            study.add_trial(optuna.trial.create_trial(
                params=params, distributions=distributions, value=value,
                constraints=constraints, user_attrs=attrs))
            return
        for key, slack in constraints.items():
            trial.set_constraint(key, slack)
        for key, val in attrs.items():
            trial.set_user_attr(key, val)
        study.tell(trial, value)

    def objective(self, batch: int, result: LaunchResult,
                  baseline: LaunchResult) -> tuple[float, dict[str, float]]:
        """Mean speedup of the study's objective, and per judged cell (each dataset; with
        another objective than throughput, rate cells too at the largest batch size) how
        far it falls short of 1 - tolerance (<= 0 is feasible). A failed launch is
        infeasible everywhere."""
        names = self.spec.dataset_names
        criterion = self.spec.criterion
        if not result.ok:
            return 0.0, {f"regression:{k.name}": 1.0 for k in criterion.cells(names, batch)}
        # Only the measured means feed the sampler: noise does not change them.
        verdict = judge(result, baseline, batch, names, self.spec.tolerance,
                        StudyNoise(self.spec.search.launch_cv, objective=criterion.objective),
                        criterion=criterion)
        return verdict.mean, {f"regression:{d}": s for d, s in verdict.shortfalls().items()}


@dataclass
class StoredStudy:
    """A study as stored, read without writing anything: its launches and what the search
    decided from them (for the report and the notebooks, also while the search runs)."""

    results: list[LaunchResult]
    recommendations: list[Recommendation] | None  # None before any decision was stored
    strategy: str


def read_only_storage(url: str) -> optuna.storages.BaseStorage:
    """An Optuna storage that cannot write: SQLite opened in read-only mode (so a reader
    never takes the write lock a running search needs); other databases without creating
    tables."""
    engine_kwargs, given = None, url
    if url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///"))
        if not path.is_file():
            raise TreetuneError(f"no study storage at {path}")
        url = f"sqlite:///file:{quote(str(path.resolve()))}?mode=ro&uri=true"
        engine_kwargs = {"connect_args": {"timeout": 30}}
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs,
                                          skip_compatibility_check=True,
                                          skip_table_creation=True)
    except Exception as exc:  # SQLAlchemy raises many kinds
        raise TreetuneError(f"cannot open study storage {shown_url(given)}: {first_line(exc)}"
                            f"{_PASSWORD_HINT if not url.startswith('sqlite') else ''}"
                            ) from None


# A study folder's copy of the spec keeps no password of its storage.
_PASSWORD_HINT = ("; a storage password is never written to the study folder: give it by "
                  "the database's own means (PostgreSQL: PGPASSWORD or ~/.pgpass), or open "
                  "the storage URL itself")


def read_study(spec: StudySpec) -> StoredStudy:
    storage = read_only_storage(spec.storage_url)
    try:
        launches = optuna.load_study(study_name=f"{spec.name}:launches", storage=storage)
    except KeyError:
        raise TreetuneError(f"study '{spec.name}' is not in {shown_url(spec.storage_url)}"
                            ) from None
    results = _launch_results(launches)
    attrs = launches.user_attrs
    stored = attrs.get(RECOMMENDATIONS_ATTR)
    recs = ([Recommendation.from_record(r, spec.algorithm) for r in stored]
            if stored is not None else None)
    return StoredStudy(results, recs, attrs.get(STRATEGY_ATTR, ""))


def _launch_results(launches: optuna.Study) -> list[LaunchResult]:
    """Every finished launch of a launches study, measured or failed, oldest first."""
    return [_result_of(t) for t in _finished(launches)]


def _finished(launches: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in launches.get_trials(deepcopy=False,
                                           states=(TrialState.COMPLETE, TrialState.FAIL))
            if RESULT_ATTR in t.user_attrs]


def _result_of(trial: optuna.trial.FrozenTrial) -> LaunchResult:
    try:
        return LaunchResult.from_dict(json.loads(trial.user_attrs[RESULT_ATTR]))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        # Else an internal error, with the study's every other launch unread.
        raise TreetuneError(
            f"a stored launch (trial {trial.number} of the launches study) cannot be read "
            f"({type(exc).__name__}: {clip(str(exc), 200)}): the storage was written by "
            f"another treetune version (this is {__version__}) or changed by hand; read it "
            "with the version that wrote it, or start a new study") from None
