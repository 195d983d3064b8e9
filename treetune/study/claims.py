"""Launches claimed in the study's storage, so that several `treetune search` processes can
share one study (a PostgreSQL server, or any Optuna RDB URL).

Before a launch starts, its search claims it: a row keyed by the study and the launch
(`<config key>#<index>`: the index-th launch of that config), holding one of the budget's
numbered slots. The database's uniqueness constraints decide every race: a launch is
claimed by one search only, and no more slots than the launch budget are ever taken, so the
searches together launch what one would, each launch once. A claim is released when its
launch is abandoned (interrupted, or its worker died and it was not redone), and marked
done when its result is stored.

Each search sharing the storage beats a heartbeat (a counter it increments); a search whose
heartbeat stands still for STALE_AFTER_S is taken for dead, and its unfinished launches are
stale: released, to be redone. With SQLite, one search runs a study at a time (its output
folder lock), and nothing beats.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

import sqlalchemy as sa

from treetune.errors import TreetuneError, first_line

# A heartbeat standing still this long: its search is taken for dead (TREETUNE_STALE_AFTER_S
# overrides it: a slow link to the database wants more, the tests less).
STALE_AFTER_S = float(os.environ.get("TREETUNE_STALE_AFTER_S", 30.0))
BEAT_S = STALE_AFTER_S / 6  # how often a search sharing the storage beats: a few lost beats
# (a database hiccup) do not make it look dead
CREATE_TRIES = 3  # searches starting at once on a new database race to create the tables
MAX_TRIES = 50  # claim attempts lost to other searches' claims before giving up

_METADATA = sa.MetaData()
CLAIMS = sa.Table(
    "treetune_claims", _METADATA,
    sa.Column("study", sa.String(512), primary_key=True),
    sa.Column("launch", sa.String(512), primary_key=True),  # "<config key>#<index>"
    sa.Column("slot", sa.Integer, nullable=False),  # its place in the launch budget
    sa.Column("driver", sa.String(64), nullable=False),  # the search that runs it
    sa.Column("trial_id", sa.Integer, nullable=True, unique=True),  # its launches trial
    sa.Column("done", sa.Boolean, nullable=False),  # its result is stored
    sa.UniqueConstraint("study", "slot", name="treetune_claims_slot"),
)
DRIVERS = sa.Table(
    "treetune_drivers", _METADATA,
    sa.Column("study", sa.String(512), primary_key=True),
    sa.Column("driver", sa.String(64), primary_key=True),
    sa.Column("beat", sa.Integer, nullable=False),
    sa.Column("host", sa.String(256), nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
)


class Claim(Enum):
    MINE = "mine"  # this search runs the launch
    TAKEN = "taken"  # another search claimed it first (or it is done)
    SPENT = "spent"  # the launch budget's slots are all taken


T = TypeVar("T")


def created_racing(create: Callable[[], T], failure: str,
                   retry: type[Exception] | tuple[type[Exception], ...] = Exception,
                   tries: int = CREATE_TRIES) -> T:
    """`create()` of a database's tables, tried again on a `retry` error: searches starting
    at once on a new database race to create them, one wins and the other's CREATE fails,
    and a second try finds them made. The last failure is a TreetuneError, `failure`: the
    error."""
    for attempt in range(tries):
        try:
            return create()
        except TreetuneError:
            raise
        except retry as exc:
            if attempt + 1 == tries:  # the database's words, not SQLAlchemy's SQL dump
                raise TreetuneError(f"{failure}: {first_line(exc)}") from None
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Running:
    """A launch another search of the study has claimed and not finished."""

    key: str
    index: int
    driver: str


def launch_name(key: str, index: int) -> str:
    return f"{key}#{index}"


def _split(launch: str) -> tuple[str, int]:
    key, _, index = launch.rpartition("#")
    return key, int(index)


class Claims:
    """The claims of one study, as one search (`driver`) makes them."""

    def __init__(self, engine: sa.engine.Engine, study: str) -> None:
        self.engine = engine
        self.study = study
        self.driver = uuid.uuid4().hex[:16]
        self._seen: dict[str, tuple[int, float]] = {}  # driver -> (beat, since when, here)
        self._beating: threading.Event | None = None
        created_racing(lambda: _METADATA.create_all(engine),  # checks first: made ones stay
                       "cannot create treetune's claims tables in the study storage",
                       sa.exc.SQLAlchemyError)

    @classmethod
    def of(cls, storage: Any, study: str) -> Claims | None:
        """The claims of a study kept in `storage`, None when it is no database (the
        search-efficiency benchmark's in-memory storage)."""
        engine = getattr(storage, "engine", None)
        return cls(engine, study) if isinstance(engine, sa.engine.Engine) else None

    # ---- claiming ----------------------------------------------------------------------
    def take(self, key: str, index: int, budget: int | None,
             known: Collection[int] = ()) -> tuple[Claim, int]:
        """Claim the index-th launch of config `key` with a free slot of the budget; with
        the index it was claimed under. `known`: the trial ids of the launches the caller
        counts, so that a launch given up between two done ones (its index free again)
        does not make it ask for a done launch forever: it gets the lowest free index."""
        for _ in range(MAX_TRIES):
            with self.engine.connect() as conn:
                rows = conn.execute(sa.select(CLAIMS.c.launch, CLAIMS.c.slot, CLAIMS.c.driver,
                                              CLAIMS.c.trial_id, CLAIMS.c.done)
                                    .where(CLAIMS.c.study == self.study)).all()
            claimed = {r.launch: r for r in rows}
            held = claimed.get(launch_name(key, index))
            if held is not None and held.done and held.trial_id in known:
                index = _lowest_free({i for k, i in map(_split, claimed) if k == key})
                held = None
            if held is not None:  # mine: a launch rescheduled after its worker died
                mine = held.driver == self.driver and not held.done
                return (Claim.MINE if mine else Claim.TAKEN), index
            slot = _lowest_free({r.slot for r in rows})
            if budget is not None and slot >= budget:
                return Claim.SPENT, index
            if self._insert(launch_name(key, index), slot, None, done=False):
                return Claim.MINE, index
        raise TreetuneError(f"could not claim a launch of {key} in {MAX_TRIES} tries: other "
                            "searches of the study kept claiming first")

    def _insert(self, launch: str, slot: int, trial_id: int | None, done: bool) -> bool:
        """One claim row, or False when another search's row holds its launch, slot or
        trial (the database decides, whoever inserts first)."""
        try:
            with self.engine.begin() as conn:
                conn.execute(CLAIMS.insert().values(
                    study=self.study, launch=launch, slot=slot, driver=self.driver,
                    trial_id=trial_id, done=done))
        except sa.exc.IntegrityError:
            return False
        return True

    def attach(self, key: str, index: int, trial_id: int) -> None:
        """The launches trial that records a claimed launch (a rescheduled launch gets a
        new one)."""
        self._update(key, index, trial_id=trial_id)

    def finish(self, key: str, index: int) -> None:
        """The launch's result is stored: its claim holds its slot for good."""
        self._update(key, index, done=True)

    def release(self, key: str, index: int) -> None:
        """The launch was abandoned: its config and slot are free to claim again."""
        with self.engine.begin() as conn:
            conn.execute(CLAIMS.delete().where(
                CLAIMS.c.study == self.study, CLAIMS.c.launch == launch_name(key, index),
                CLAIMS.c.driver == self.driver, CLAIMS.c.done.is_(False)))

    def release_all(self) -> None:
        """Every unfinished claim of this search: the search ends."""
        with self.engine.begin() as conn:
            conn.execute(CLAIMS.delete().where(*self._open_claims(self.driver)))

    def _update(self, key: str, index: int, **values: Any) -> None:
        with self.engine.begin() as conn:
            conn.execute(CLAIMS.update().where(
                CLAIMS.c.study == self.study, CLAIMS.c.launch == launch_name(key, index),
                CLAIMS.c.driver == self.driver).values(**values))

    # ---- what the other searches do -----------------------------------------------------
    def others(self) -> tuple[list[Running], set[tuple[str, int]]]:
        """The launches other searches run now, and every claimed launch of the study
        (running or done, anyone's)."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(CLAIMS.c.launch, CLAIMS.c.driver, CLAIMS.c.done)
                                .where(CLAIMS.c.study == self.study)).all()
        running = [Running(*_split(r.launch), r.driver) for r in rows
                   if not r.done and r.driver != self.driver]
        return running, {_split(r.launch) for r in rows}

    def sync(self, finished: list[tuple[int, str]]) -> None:
        """Give every finished launch (trial id, config key) a done claim: launches stored
        before the study's searches claimed them, or whose search died between storing the
        result and marking its claim done."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(CLAIMS.c.launch, CLAIMS.c.trial_id)
                                .where(CLAIMS.c.study == self.study)).all()
        claimed = {r.trial_id for r in rows}
        for trial_id, key in finished:
            if trial_id in claimed:
                continue
            for _ in range(MAX_TRIES):
                with self.engine.connect() as conn:
                    rows = conn.execute(sa.select(CLAIMS.c.launch, CLAIMS.c.slot,
                                                  CLAIMS.c.trial_id)
                                        .where(CLAIMS.c.study == self.study)).all()
                if any(r.trial_id == trial_id for r in rows):
                    break  # another search gave it one meanwhile
                index = _lowest_free({i for k, i in (_split(r.launch) for r in rows)
                                      if k == key})
                if self._insert(launch_name(key, index), _lowest_free({r.slot for r in rows}),
                                trial_id, done=True):
                    break

    def forget_unfinished(self) -> None:
        """Every unfinished claim and heartbeat of the study but this search's: with SQLite
        the output folder's lock proves that no other search runs, so they are stale."""
        with self.engine.begin() as conn:
            conn.execute(CLAIMS.delete().where(CLAIMS.c.study == self.study,
                                               CLAIMS.c.done.is_(False),
                                               CLAIMS.c.driver != self.driver))
            conn.execute(DRIVERS.delete().where(DRIVERS.c.study == self.study,
                                                DRIVERS.c.driver != self.driver))

    # ---- heartbeats ---------------------------------------------------------------------
    def start_beating(self) -> None:
        """Beat every BEAT_S from a thread of its own, until `stop_beating`: the search's
        main loop may wait minutes on Ray, and must not look dead meanwhile."""
        with self.engine.begin() as conn:
            conn.execute(DRIVERS.insert().values(study=self.study, driver=self.driver, beat=0,
                                                 host=socket.gethostname(), pid=os.getpid()))
        stop = self._beating = threading.Event()

        def beat() -> None:
            while not stop.wait(BEAT_S):
                with contextlib.suppress(sa.exc.SQLAlchemyError):  # a hiccup: beat again
                    self.beat()

        threading.Thread(target=beat, name="treetune-heartbeat", daemon=True).start()

    def beat(self) -> None:
        with self.engine.begin() as conn:
            beaten = conn.execute(DRIVERS.update().where(
                DRIVERS.c.study == self.study, DRIVERS.c.driver == self.driver)
                .values(beat=DRIVERS.c.beat + 1)).rowcount
            if not beaten:  # taken for dead by another search: alive after all
                conn.execute(DRIVERS.insert().values(
                    study=self.study, driver=self.driver, beat=0,
                    host=socket.gethostname(), pid=os.getpid()))

    def stop_beating(self, forget: bool = True) -> None:
        """No more beats; with `forget`, this search's row goes too (else others find it
        dead, and fail what it left running)."""
        if self._beating is not None:
            self._beating.set()
            self._beating = None
        if not forget:
            return
        with self.engine.begin() as conn:
            conn.execute(DRIVERS.delete().where(DRIVERS.c.study == self.study,
                                                DRIVERS.c.driver == self.driver))

    def dead(self, stale_after_s: float = STALE_AFTER_S) -> list[str]:
        """Searches whose heartbeat stood still for `stale_after_s` as seen from here (no
        clock is compared across machines), and searches with unfinished claims that never
        beat at all once that long has passed here."""
        now = time.monotonic()
        with self.engine.connect() as conn:
            beats = dict(conn.execute(sa.select(DRIVERS.c.driver, DRIVERS.c.beat)
                                      .where(DRIVERS.c.study == self.study)).all())
            claimants = set(conn.execute(sa.select(CLAIMS.c.driver).distinct().where(
                CLAIMS.c.study == self.study, CLAIMS.c.done.is_(False))).scalars())
        dead = []
        for driver in (set(beats) | claimants) - {self.driver}:
            beat = beats.get(driver, -1)
            last, since = self._seen.get(driver, (None, now))
            if beat != last:
                self._seen[driver] = (beat, now)
            elif now - since > stale_after_s:
                dead.append(driver)
        return sorted(dead)

    def unfinished(self, driver: str) -> list[tuple[str, int, int | None]]:
        """A dead search's unfinished claims: (config key, index, trial id) each, for its
        trials to be failed as stale before the claims are released (`reap`)."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(CLAIMS.c.launch, CLAIMS.c.trial_id).where(
                *self._open_claims(driver))).all()
        return [(*_split(r.launch), r.trial_id) for r in rows]

    def reap(self, driver: str) -> bool:
        """A dead search's unfinished claims released, and its heartbeat row gone: the
        last step, once its trials are failed. Released first, a search that died (or
        lost the database) before failing them left them running for good: nothing
        named the dead search again. True for the one search that reaped it (several
        find a search dead at about the same time; the database lets one delete its rows):
        that one tells the batch studies what the dead search left untold."""
        with self.engine.begin() as conn:
            released = conn.execute(CLAIMS.delete().where(*self._open_claims(driver)))
            gone = conn.execute(DRIVERS.delete().where(DRIVERS.c.study == self.study,
                                                       DRIVERS.c.driver == driver))
        self._seen.pop(driver, None)
        return bool(released.rowcount or gone.rowcount)

    def beating(self) -> set[str]:
        """The searches of this study with a heartbeat row, this one's among them: running,
        or dead and not yet found so (a search that ended whole deleted its row)."""
        with self.engine.connect() as conn:
            return set(conn.execute(sa.select(DRIVERS.c.driver).where(
                DRIVERS.c.study == self.study)).scalars())

    def _open_claims(self, driver: str) -> tuple[Any, ...]:
        """The conditions of search `driver`'s unfinished claims in this study."""
        return (CLAIMS.c.study == self.study, CLAIMS.c.driver == driver,
                CLAIMS.c.done.is_(False))


def _lowest_free(taken: set[int]) -> int:
    return next(i for i in range(len(taken) + 1) if i not in taken)
