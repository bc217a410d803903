"""A forecast of a deployment's arrival rate, trusted only while its recent error is small.

Owns `ArrivalForecaster`: arrival rates observed (requests/s, every decision) reduced into bins
of ``spec.binSeconds`` (``spec.statistic``: their peak, the busiest signal window of the bin, or
their mean); every ``spec.refitSeconds`` a Holt-Winters model (additive damped trend,
additive season of ``spec.seasonBins`` bins: a day by default; statsmodels
`ExponentialSmoothing`, Hyndman & Athanasopoulos, "Forecasting: Principles and Practice", 3rd
ed., ch. 8.3) is refitted on the bins kept (at most `HISTORY_SEASONS` seasons) and forecasts the
bins ahead. Read by `autoscaler.standby.StandbyPolicy` (``spec.forecast``), which scales ahead on
`peak_ahead` when `trusted`; the trace simulator primes it with a trace's earlier days
(`prime`), as a controller would with the rates it kept.

The error check: every forecast bin is remembered as first forecast, out of sample (fitted on
bins before it), and scored once the bin is observed; a start with history enough (two seasons
and a validation window, `prime`) is scored at once on a backtest: fitted without the history's
last ``spec.validationBins`` bins, scored on them. `mape` is the mean absolute percentage
error of the last ``spec.validationBins`` scored bins (bins whose rate is under
`MIN_RATE_PER_S` are skipped: a percentage of nothing is noise); the forecast is `trusted` only
once that many bins were scored and their MAPE is at most ``spec.maxMape``. A fit needs two whole
seasons (statsmodels' heuristic initialisation), so a new deployment scales without it for two
days, then for one validation window more.

Pure and clock-injected: every method takes the caller's time; statsmodels is deterministic.
Cost: one fit per refit (0.2-0.3 s for three days of 30-minute bins on one busy core),
nothing per decision but a dict lookup. A caller with an event loop sets ``defer_fits``: a due
refit then waits as a self-contained `FitJob` (`take_fit`) that the caller runs in a worker
thread and `install`s when done, the last installed model forecasting meanwhile
(`fleet.controller.autoscaling` does; the trace simulator fits inline, deterministic). statsmodels is imported when the first fit is due; when
it is missing the forecast is never trusted and `status` says why (extra ``forecast`` in
pyproject.toml).
"""

from __future__ import annotations

import warnings
from collections import deque
from dataclasses import dataclass
from collections.abc import Iterable

from autoscaler.spec import ForecastSpec

HISTORY_SEASONS = 3
"""Seasons of bins kept and fitted on (older bins are dropped): enough for a damped trend."""

MAX_UPPER_FACTOR = 2.0
"""`ArrivalForecaster.upper_factor` never exceeds this (a bin forecast at a tenth of what came must
not ask for ten times the replicas; such a forecast is not trusted anyway, its MAPE is too large)."""

MIN_RATE_PER_S = 0.05
"""Bins observed under this rate (requests/s) are not scored (their percentage error is noise)."""


class ArrivalForecaster:
    """Arrival-rate forecast with its own error check (module docstring)."""

    def __init__(self, spec: ForecastSpec) -> None:
        self.spec = spec
        self.bin_s = spec.bin_seconds
        self._bins: dict[int, list[float]] = {}      # bin index -> [sum of rates, samples]
        self._forecast: dict[int, float] = {}        # bin index -> rate forecast (latest fit)
        self._first_forecast: dict[int, float] = {}  # bin index -> the first forecast made for it
        self._errors: deque[float] = deque(maxlen=spec.validation_bins)
        self._scored_through = -1
        self._next_fit_s: float | None = None
        self.fits = 0
        self.status = "no fit yet"
        self.defer_fits = False
        """True: `observe` leaves a due refit in `pending` (`take_fit`) instead of fitting."""
        self.pending: FitJob | None = None

    # ----- observations -------------------------------------------------------------------

    def observe(self, now_s: float, rate_per_s: float) -> None:
        """One arrival-rate sample (requests/s) at ``now_s``; refits when one is due."""
        b = int(now_s // self.bin_s)
        acc = self._bins.setdefault(b, [0.0, 0.0])
        if self.spec.statistic == "peak":
            acc[0] = max(acc[0], rate_per_s)
            acc[1] = 1.0
        else:
            acc[0] += rate_per_s
            acc[1] += 1
        self._score(b)
        if self._next_fit_s is None or now_s >= self._next_fit_s:
            self._next_fit_s = now_s + self.spec.refit_seconds
            self._fit(b)

    def prime(self, history: Iterable[tuple[float, float]]) -> None:
        """Rates observed before the first decision: (start of a bin in seconds on the caller's
        clock, typically negative; mean rate over it in requests/s), oldest first; bins shorter
        than ``spec.binSeconds`` are averaged into it."""
        peak = self.spec.statistic == "peak"
        for t_s, rate in history:
            acc = self._bins.setdefault(int(t_s // self.bin_s), [0.0, 0.0])
            acc[0] = max(acc[0], rate) if peak else acc[0] + rate
            acc[1] = 1.0 if peak else acc[1] + 1

    def history(self) -> list[tuple[float, float]]:
        """The bins kept, for a caller to save and `prime` a later forecaster with: (start of the
        bin in seconds on the caller's clock, its rate in requests/s: the statistic so far for
        the bin in progress), oldest first; at most `HISTORY_SEASONS` seasons and the bin in
        progress."""
        return [(b * self.bin_s, acc[0] / acc[1]) for b, acc in sorted(self._bins.items()) if acc[1] > 0]

    def _score(self, current: int) -> None:
        """Score every complete bin not scored yet against its first forecast."""
        for b in range(self._scored_through + 1, current):
            acc = self._bins.get(b)
            predicted = self._first_forecast.pop(b, None)
            if acc is None or predicted is None or acc[1] == 0:
                continue
            actual = acc[0] / acc[1]
            if actual >= MIN_RATE_PER_S:
                self._errors.append((actual - predicted) / actual)
        self._scored_through = max(self._scored_through, current - 1)

    # ----- the model ----------------------------------------------------------------------

    def _series(self, current: int) -> list[float]:
        """Mean rate per complete bin before ``current``, the oldest kept first; a bin without
        samples takes the one before it (none are missing when decisions come every few s)."""
        keep = HISTORY_SEASONS * self.spec.season_bins
        for b in [b for b in self._bins if b < current - keep]:
            del self._bins[b]
        if not self._bins:
            return []
        series, last = [], 0.0
        for b in range(min(self._bins), current):
            acc = self._bins.get(b)
            if acc is not None and acc[1] > 0:
                last = acc[0] / acc[1]
            series.append(last)
        return series

    def _fit(self, current: int) -> None:
        season = self.spec.season_bins
        series = self._series(current)
        if len(series) < 2 * season:
            self.status = f"{len(series)} bins of history, a fit needs {2 * season} (two seasons)"
            return
        job = FitJob(current, tuple(series), season, self.spec.validation_bins, self.spec.horizon_bins,
                     backtest=not self._errors and len(series) >= 2 * season + self.spec.validation_bins)  # fmt: skip
        if self.defer_fits:
            self.pending = job   # a newer job replaces one not taken yet
        else:
            self.install(job.run())

    def take_fit(self) -> FitJob | None:
        """The fit deferred by `observe` (``defer_fits``), once: the caller runs `FitJob.run`
        where it likes (a worker thread) and hands the result to `install`; until then the
        last installed model forecasts. None when none is due."""
        job, self.pending = self.pending, None
        return job

    def install(self, result: FitResult) -> None:
        """Take a fit's forecast (and its backtest's errors, when nothing was scored yet)."""
        if result.error is not None:
            self.status = result.error
            return
        if result.backtest_errors is not None and not self._errors:
            self._errors.extend(result.backtest_errors)
            self.fits += 1
        self.fits += 1
        self._forecast = {result.current + i: v for i, v in enumerate(result.ahead)}
        for b, v in self._forecast.items():
            if b > self._scored_through:   # a late install forecasts no bin already scored
                self._first_forecast.setdefault(b, v)
        mape = self.mape
        self.status = (f"fitted on {result.bins} bins; MAPE {'n/a' if mape is None else f'{mape:.0%}'} over "
                       f"{len(self._errors)} of {self.spec.validation_bins} validation bins")  # fmt: skip

    # ----- what a policy reads ------------------------------------------------------------

    @property
    def mape(self) -> float | None:
        """Mean absolute percentage error of the last scored bins (0.1: 10 %), or None."""
        return sum(abs(e) for e in self._errors) / len(self._errors) if self._errors else None

    @property
    def upper_factor(self) -> float:
        """How far above its point forecast the rate may come, from the scored bins: the largest
        ratio actual / forecast among them (at least 1, at most `MAX_UPPER_FACTOR`). An empirical
        upper bound (split conformal prediction, Angelopoulos & Bates 2021, "A Gentle Introduction
        to Conformal Prediction", sec. 1: the ceil((n + 1)(1 - a))-th smallest of n scores; the
        largest of the default 4 bins is the 80 % bound)."""
        worst = max(self._errors, default=0.0)   # signed: > 0 where the forecast fell short
        return min(MAX_UPPER_FACTOR, 1.0 / (1.0 - max(0.0, worst))) if worst < 1.0 else MAX_UPPER_FACTOR

    @property
    def trusted(self) -> bool:
        """A whole validation window scored, with a MAPE of at most ``spec.maxMape``."""
        mape = self.mape
        return len(self._errors) >= self.spec.validation_bins and mape is not None and mape <= self.spec.max_mape

    def peak_ahead(self, now_s: float, ahead_s: float, upper: bool = False) -> float | None:
        """The highest forecast rate (requests/s) of the bins from ``now_s`` to ``now_s +
        ahead_s`` (``upper``: times `upper_factor`, the forecast's upper bound); None when not
        `trusted` or beyond the forecast's horizon."""
        if not self.trusted:
            return None
        first, last = int(now_s // self.bin_s), int((now_s + ahead_s) // self.bin_s)
        values = [self._forecast.get(b) for b in range(first, last + 1)]
        if any(v is None for v in values):
            return None
        peak = max(v for v in values if v is not None)
        return peak * self.upper_factor if upper else peak


@dataclass(frozen=True)
class FitResult:
    """What `FitJob.run` computed: the rate forecast (requests/s, >= 0) of the bins from
    ``current`` on, the backtest's signed relative errors ((actual - forecast) / actual; None: no backtest), the number of
    bins fitted on, or ``error`` (why nothing was fitted)."""

    current: int
    ahead: tuple[float, ...] = ()
    backtest_errors: tuple[float, ...] | None = None
    bins: int = 0
    error: str | None = None


@dataclass(frozen=True)
class FitJob:
    """One Holt-Winters refit, self-contained (a snapshot of the series): `run` touches no
    forecaster state, so a worker thread may run it while the caller goes on."""

    current: int
    series: tuple[float, ...]
    season: int
    validation: int
    horizon: int
    backtest: bool

    def run(self) -> FitResult:
        """Fit (0.2-0.3 s for three days of 30-minute bins on one busy core) and forecast."""
        try:
            from statsmodels.tsa.holtwinters import ExponentialSmoothing
        except ImportError:
            return FitResult(self.current, error="statsmodels is not installed (pip install 'inference-fleet[forecast]')")
        series, errors = list(self.series), None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # convergence chatter of the optimiser
            if self.backtest:  # nothing scored yet but history enough (a primed start): backtest on its last bins
                held_out = series[-self.validation:]
                past = _holt_winters(ExponentialSmoothing, series[:-self.validation], self.season).forecast(self.validation)
                errors = tuple((a - float(p)) / a for p, a in zip(past, held_out) if a >= MIN_RATE_PER_S)
            ahead = _holt_winters(ExponentialSmoothing, series, self.season).forecast(self.horizon)
        return FitResult(self.current, tuple(max(0.0, float(v)) for v in ahead), errors, len(series))


def _holt_winters(model_class, series: list[float], season: int):  # type: ignore[no-untyped-def]
    """Fit Holt-Winters (additive damped trend, additive season) on ``series``."""
    return model_class(series, trend="add", damped_trend=True, seasonal="add", seasonal_periods=season,
                       initialization_method="heuristic").fit()  # fmt: skip


def rate_bins(arrivals_s: Iterable[float], bin_s: float, offset_s: float) -> list[tuple[float, float]]:
    """(bin start + ``offset_s``, requests/s) per ``bin_s`` bin of ``arrivals_s`` (seconds), from
    the first bin to the last, empty bins included: what `ArrivalForecaster.prime` takes."""
    counts: dict[int, int] = {}
    for a in arrivals_s:
        counts[int(a // bin_s)] = counts.get(int(a // bin_s), 0) + 1
    if not counts:
        return []
    return [(b * bin_s + offset_s, counts.get(b, 0) / bin_s) for b in range(min(counts), max(counts) + 1)]

