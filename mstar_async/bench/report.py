"""The one shape of every benchmark's JSON report, and the helpers that build and check it.

A report is a JSON object with exactly these keys (``docs/benchmarks.md`` describes them):

- ``benchmark``: the benchmark's name, as ``mstar bench`` spells it;
- ``workload``: an object saying what was measured (model, sizes, concurrencies, repetitions);
- ``machine``: an object of facts about the machine and software (``machine_info()``);
- ``systems``: a list of the systems compared, each ``{"name", "description", ...}``;
- ``results``: a list of objects, the benchmark's rows of figures;
- ``aims``: a list of ``{"name", "target", "measured", "met", ...}``: ``measured`` is a number,
  or ``null`` when this run did not measure it (then ``met`` is ``null`` too); ``met`` says
  whether ``measured`` compares to ``target`` as ``compare`` says (``>=``, ``<=``, ``>``, ``<``);
- ``seconds``: the run's wall time.

Objects in ``systems``, ``results`` and ``aims`` may carry more keys of their own.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["COMPARISONS", "REPORT_KEYS", "aim_entry", "check_report", "make_report", "system_entry"]

#: The keys of a report, in the order reports print them.
REPORT_KEYS = ("benchmark", "workload", "machine", "systems", "results", "aims", "seconds")

#: How an aim's ``measured`` is compared to its ``target``.
COMPARISONS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
}

_AIM_KEYS = ("name", "target", "measured", "met")


def system_entry(name: str, description: str, **details: Any) -> dict[str, Any]:
    """One entry of a report's ``systems``: its name, what it runs, and any other facts."""
    return {"name": name, "description": description, **details}


def aim_entry(
    name: str, target: float, measured: float | None, *, compare: str = ">=", **details: Any
) -> dict[str, Any]:
    """One entry of a report's ``aims``; ``met`` is ``measured <compare> target``, or ``None``
    when ``measured`` is ``None`` (the run did not measure it).

    Raises:
        ValueError: ``compare`` is not one of ``COMPARISONS``.
    """
    if compare not in COMPARISONS:
        raise ValueError(f"compare must be one of {sorted(COMPARISONS)}, got {compare!r}")
    met = None if measured is None else bool(COMPARISONS[compare](measured, target))
    return {
        "name": name,
        "target": target,
        "measured": measured,
        "met": met,
        "compare": compare,
        **details,
    }


def make_report(
    benchmark: str,
    *,
    workload: Mapping[str, Any],
    machine: Mapping[str, Any],
    systems: Sequence[Mapping[str, Any]],
    results: Sequence[Mapping[str, Any]],
    aims: Sequence[Mapping[str, Any]],
    seconds: float,
) -> dict[str, Any]:
    """A report of the one shape, checked.

    Raises:
        ValueError: a part breaks the shape (the message names which, as ``check_report``).
    """
    report: dict[str, Any] = {
        "benchmark": benchmark,
        "workload": dict(workload),
        "machine": dict(machine),
        "systems": [dict(s) for s in systems],
        "results": [dict(r) for r in results],
        "aims": [dict(a) for a in aims],
        "seconds": round(seconds, 2),
    }
    check_report(report)
    return report


def check_report(report: Any) -> None:
    """Check that ``report`` (a parsed or built report) has the one shape.

    Raises:
        ValueError: it does not; the message names the first part that breaks it.
    """
    if not isinstance(report, Mapping):
        raise ValueError(f"a report is a JSON object, got {type(report).__name__}")
    keys = list(report)
    if sorted(keys) != sorted(REPORT_KEYS):
        missing = [k for k in REPORT_KEYS if k not in report]
        extra = [k for k in keys if k not in REPORT_KEYS]
        raise ValueError(f"report keys: missing {missing}, unexpected {extra}")
    if not isinstance(report["benchmark"], str) or not report["benchmark"]:
        raise ValueError(f"benchmark must be a name, got {report['benchmark']!r}")
    for key in ("workload", "machine"):
        if not isinstance(report[key], Mapping):
            raise ValueError(f"{key} must be an object, got {type(report[key]).__name__}")
    _check_objects(report, "systems", ("name", "description"))
    _check_objects(report, "results", ())
    _check_objects(report, "aims", _AIM_KEYS)
    for index, entry in enumerate(report["aims"]):
        _check_aim(entry, f"aims[{index}]")
    seconds = report["seconds"]
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
        raise ValueError(f"seconds must be a number >= 0, got {seconds!r}")
    try:
        json.dumps(report)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the report is not JSON: {exc}") from None


def _check_objects(report: Mapping[str, Any], key: str, required: Sequence[str]) -> None:
    entries = report[key]
    if not isinstance(entries, list):
        raise ValueError(f"{key} must be a list, got {type(entries).__name__}")
    for index, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise ValueError(f"{key}[{index}] must be an object, got {type(entry).__name__}")
        missing = [k for k in required if k not in entry]
        if missing:
            raise ValueError(f"{key}[{index}] lacks {missing}")
        for name in ("name", "description"):
            if name in required and not isinstance(entry[name], str):
                raise ValueError(f"{key}[{index}].{name} must be a string")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_aim(entry: Mapping[str, Any], where: str) -> None:
    if not _number(entry["target"]):
        raise ValueError(f"{where}.target must be a number, got {entry['target']!r}")
    measured, met = entry["measured"], entry["met"]
    if measured is None:
        if met is not None:
            raise ValueError(f"{where}: met must be null when measured is null, got {met!r}")
        return
    if not _number(measured):
        raise ValueError(f"{where}.measured must be a number or null, got {measured!r}")
    if not isinstance(met, bool):
        raise ValueError(f"{where}.met must be true or false when measured, got {met!r}")
    compare = entry.get("compare")
    if compare is None:
        return
    if compare not in COMPARISONS:
        raise ValueError(f"{where}.compare must be one of {sorted(COMPARISONS)}, got {compare!r}")
    if met != COMPARISONS[compare](measured, entry["target"]):
        raise ValueError(f"{where}: met is {met} but {measured} {compare} {entry['target']} is not")
