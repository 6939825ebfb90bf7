"""How close the two step-time sources (the planner's profile and the estimator's roofline) came to the measured
steps of the uniform policies, and whether each ranks them as measured: the sentences bench.policies and
bench.planner put in docs/benchmarks.md's "how close" paragraphs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.common import environment_text, joined

WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}
SOURCES = (("profile", "the profile's prediction"), ("roofline", "the roofline"))


@dataclass(frozen=True)
class Point:
    """One uniform policy on one model: its measured median step (ms, spread as a fraction) and both predictions."""

    model: str
    policy: str
    ms: float
    spread: float
    profile: float | None
    roofline: float | None

    def predicted(self, source: str) -> float | None:
        return self.profile if source == "profile" else self.roofline

    def error(self, source: str) -> float | None:
        p = self.predicted(source)
        return None if p is None else p / self.ms - 1

    def noise(self) -> str:
        return f"{self.ms:,.0f} ms ±{100 * self.spread:.0f} %"


def _pct(x: float) -> str:
    return f"{100 * abs(x):.1f}"


def _span(errors: Sequence[float]) -> str:
    lo, hi = _pct(min(errors, key=abs)), _pct(max(errors, key=abs))
    return f"{lo} %" if lo == hi else f"{lo}–{hi} %"


def _side(errors: Sequence[float]) -> str:
    low, n = sum(e < 0 for e in errors), len(errors)
    # the first that applies wins: a later key of the literal replaces an earlier equal one
    words = {1: "high in all but one row", n - 1: "low in all but one row", 0: "high in every row"}
    return (words | {n: "low in every row"}).get(low, f"low in {low} of {n} rows")


def _models(points: Sequence[Point]) -> list[str]:
    return list(dict.fromkeys(p.model for p in points))


def sources_text(points: Sequence[Point], limits: dict[str, float] | None = None) -> str:
    """'the profile's prediction lies within 0.3–4.8 % of the measured step for every uniform policy on `tiny` and
    `llama-tiny`, high in 6 of 8 rows; the roofline within 7.6–12.5 % (except `op_sac` on `llama-tiny`, 18.3 % low),
    low in every row'. With `limits` (a source's target, a fraction), a row beyond it is named, not in the range."""
    parts = []
    for source, what in SOURCES:
        rows = [p for p in points if p.predicted(source) is not None]
        if not rows:
            continue
        limit = (limits or {}).get(source)
        errors = [p.error(source) for p in rows]
        inside = [e for e in errors if e is not None and (limit is None or abs(e) <= limit)]
        beyond = [
            f"`{p.policy}` on `{p.model}`, {_pct(e)} % {'low' if e < 0 else 'high'}"
            for p, e in zip(rows, errors, strict=True)
            if e is not None and limit is not None and abs(e) > limit
        ]
        every = "every uniform policy" if len(rows) == len(points) else f"{len(rows)} of {len(points)} uniform rows"
        span = f"within {_span(inside)}" if inside else f"beyond {100 * (limit or 0):g} % in every row"
        on = joined([f"`{m}`" for m in _models(rows)])
        # the first source says what the range is of; the second is read against it
        text = f"{what} {span}" if parts else f"{what} lies {span} of the measured step for {every} on {on}"
        if beyond and inside:
            text += f" (except {'; '.join(beyond)})"
        parts.append(f"{text}, {_side([e for e in errors if e is not None])}")
    return "; ".join(parts)


def _order(points: Sequence[Point], source: str | None) -> list[Point] | None:
    if source is not None and any(p.predicted(source) is None for p in points):
        return None
    return sorted(points, key=lambda p: p.ms if source is None else p.predicted(source))  # type: ignore[arg-type,return-value]


def _swaps(predicted: list[Point]) -> list[str]:
    """Each pair the prediction orders the other way round from the measured times, with their noise."""
    out = []
    for i, a in enumerate(predicted):
        for b in predicted[i + 1 :]:
            if a.ms > b.ms:  # predicted faster, measured slower
                noise = "within" if a.ms * (1 - a.spread) <= b.ms * (1 + b.spread) else "outside"
                out.append(
                    f"swaps `{a.policy}` and `{b.policy}` on `{a.model}`, whose measured times lie {noise} their "
                    f"noise ({a.noise()} vs {b.noise()})"
                )
    return out


def rankings_text(points: Sequence[Point]) -> str:
    """'The profile ranks the four uniform policies as measured on `tiny` and `llama-tiny`; the roofline ranks them
    as measured on `tiny` and swaps `op_sac` and `full` on `llama-tiny`, whose measured times lie within their noise
    (436 ms ±7 % vs 416 ms ±12 %)'."""
    by_model = {m: [p for p in points if p.model == m] for m in _models(points)}
    parts = []
    for source, _ in SOURCES:
        same, swaps = [], []
        for model, rows in by_model.items():
            predicted = _order(rows, source)
            if predicted is None or len(rows) < 2:
                continue
            if [p.policy for p in predicted] == [p.policy for p in _order(rows, None) or []]:
                same.append(f"`{model}`")
            else:
                swaps += _swaps(predicted)
        if not same and not swaps:
            continue
        counts = {len(rows) for rows in by_model.values()}
        n = counts.pop() if len(counts) == 1 else None  # "the four uniform policies" where every model has four
        them = "them" if parts else f"the {WORDS.get(n, n)} uniform policies" if n else "the uniform policies"
        text = f"the {source} " + " and ".join(
            ([f"ranks {them} as measured on {joined(same)}"] if same else []) + (["; ".join(swaps)] if swaps else [])
        )
        parts.append(text)
    if not parts:
        return ""
    text = "; ".join(parts)
    return text[0].upper() + text[1:]


def paragraph(
    command: str, env: dict[str, Any], points: Sequence[Point], limits: dict[str, float] | None = None
) -> str:
    """The paragraph's opening: where the figures come from, how close each source came and how each ranks."""
    ranks = rankings_text(points)
    return f"From `{command}` ({environment_text(env)}): {sources_text(points, limits)}." + (
        f" {ranks}." if ranks else ""
    )
