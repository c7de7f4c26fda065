"""What a table row stands for: the settings that key rows, the filters that pick records, and the refusal
of a layout that would print two different configurations under one key.

A record's settings are the axes its method declares (``eval.axes``: nodes, ttt_length, block_size, ...), the
temperature, the evaluation settings of :data:`analysis.results.EVAL_SETTINGS` (max_new_tokens, timing, the
question set, ...), the method and the row label; bench and target are one per table (:func:`select` refuses a
mix). Records whose settings are all equal are repeats of one configuration (another seed, another draft
trained under the same settings, the same config evaluated twice) and share a row that counts them. Records
whose settings differ never share a row: when a layout would print the same key for two configurations, the
table is refused with the setting that tells them apart, its values and the layout or filter that shows it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from analysis.results import EVAL_SETTINGS, Record, sort_key
from analysis.table_model import TableError

LAYOUTS = ("table1", "table4", "table6", "methods")
EVAL_SETTING_NAMES = tuple(name for name, _ in EVAL_SETTINGS)


def _hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


def settings_of(r: Record) -> dict[str, Any]:
    """Every setting of ``r`` that keys rows, unset ones left out: the method's axes (declaration order), the
    temperature, the evaluation settings, the method and the label. The first name wins a clash."""
    out: dict[str, Any] = {}
    named = [*r.axes.items(), ("temperature", r.temperature), *r.eval_settings.items(),
             ("method", r.method), ("label", r.label)]
    for name, value in named:
        if value is not None and name not in out:
            out[name] = _hashable(value)
    return out


def config_key(r: Record) -> tuple:
    """Equal for two records exactly when all their settings are: the records are repeats of one configuration."""
    return tuple(sorted(settings_of(r).items(), key=lambda kv: kv[0]))


def value_text(value: Any) -> str:
    """A setting's value as a table cell or message prints it (``None``: ``unset``; a list: comma-joined)."""
    if value is None:
        return "unset"
    if isinstance(value, tuple):
        return ",".join(value_text(v) for v in value)
    return str(value)


def _matches(value: Any, wanted: str) -> bool:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return abs(float(wanted) - value) < 1e-9
        except ValueError:
            return False
    return value_text(value) == wanted


def parse_setting_filters(specs: Sequence[str] | None) -> dict[str, list[str]]:
    """``["max_new_tokens=64", "timing=wall"]`` -> ``{name: [values]}`` (a name given twice keeps either)."""
    out: dict[str, list[str]] = {}
    for spec in specs or ():
        name, sep, value = spec.partition("=")
        if not sep or not name.strip():
            raise TableError(f"--setting takes NAME=VALUE (e.g. max_new_tokens=128), got {spec!r}")
        out.setdefault(name.strip(), []).append(value.strip())
    return out


def select(records: Sequence[Record], *, bench=None, target=None, labels=None, nodes=None, temperatures=None,
           ttt_lengths=None, settings: dict[str, list[str]] | None = None) -> list[Record]:
    """The eval records the filters keep; refuses records that mix bench/target setups."""
    rs = [r for r in records if r.has_eval]
    if bench is not None:
        rs = [r for r in rs if r.bench == bench]
    if target is not None:
        rs = [r for r in rs if r.target == target]
    if labels:
        rs = [r for r in rs if r.label in labels]
    if nodes:
        rs = [r for r in rs if r.nodes in nodes]
    if ttt_lengths:
        rs = [r for r in rs if r.ttt_length in ttt_lengths]
    if temperatures:
        rs = [r for r in rs if r.temperature is not None and any(abs(r.temperature - t) < 1e-9 for t in temperatures)]
    for name, wanted in (settings or {}).items():
        known = sorted({n for r in rs for n in settings_of(r)})
        if rs and name not in known:
            raise TableError(f"--setting {name}: no record has that setting (they have {', '.join(known)})")
        rs = [r for r in rs if any(_matches(settings_of(r).get(name), w) for w in wanted)]
    setups = sorted({(r.bench, r.target) for r in rs}, key=lambda s: (sort_key(s[0]), sort_key(s[1])))
    if len(setups) > 1:
        shown = ", ".join(f"bench={b} target={t}" for b, t in setups)
        raise TableError(f"records mix {len(setups)} bench/target setups ({shown}); choose one with --bench/--target")
    return rs


def setting_text(r: Record, extra: Sequence[str] = ()) -> str:
    """``name=value`` for every axis of the record's method, in declaration order, then for each evaluation
    setting named in ``extra`` that the record sets (``methods`` layout)."""
    parts = [f"{k}={v}" for k, v in r.axes.items()]
    parts += [f"{n}={value_text(r.eval_setting(n))}" for n in extra if r.eval_setting(n) is not None]
    return ", ".join(parts) or "-"


@dataclass(frozen=True)
class Layout:
    """Key columns, metrics and, per record, ``(setting group, printed key, order within the group)``."""

    name: str
    headers: tuple[str, ...]
    metrics: tuple[str, ...]
    keyed: Callable[[Record], tuple[tuple, tuple, tuple]]


def layout_for(name: str, rs: Sequence[Record], labels: Sequence[str] | None = None) -> Layout:
    """The layout ``name`` over the selected records ``rs``; ``labels`` orders the method rows."""
    order = list(labels) if labels else list(dict.fromkeys(r.label for r in rs))
    rank = {lab: i for i, lab in enumerate(order)}
    if name == "table1":
        return Layout(name, ("Method", "Nodes", "T"), ("tau", "speedup"),
                      lambda r: ((r.nodes, r.temperature), (r.label, r.nodes, r.temperature), (rank[r.label],)))
    if name == "table4":
        return Layout(name, ("Method", "T"), ("tau", "speedup"),
                      lambda r: ((r.temperature,), (r.label, r.temperature), (rank[r.label],)))
    if name == "table6":
        used = sorted({r.label for r in rs})
        if len(used) > 1:
            raise TableError(f"table6 compares training lengths of one method, records have labels {used}; "
                             "choose one with --label")
        return Layout(name, ("Length", "Nodes", "T"), ("tau",),
                      lambda r: ((r.nodes, r.temperature), (r.ttt_length, r.nodes, r.temperature), (r.ttt_length,)))
    # methods: each method at each setting of the axes its config declares, so methods with different knobs
    # sit side by side; plus the evaluation settings that tell apart records these would put in one row.
    extra = _eval_settings_to_show(rs)

    def keyed(r: Record):
        within = (rank[r.label], *r.axes.values(), *(r.eval_setting(n) for n in extra))
        return (r.temperature,), (r.label, setting_text(r, extra), r.temperature), within
    return Layout(name, ("Method", "Setting", "T"), ("tau", "speedup"), keyed)


def _eval_settings_to_show(rs: Sequence[Record]) -> list[str]:
    """The evaluation settings that differ among records of one label, axes and temperature."""
    merged: dict[tuple, list[Record]] = {}
    for r in rs:
        merged.setdefault((r.label, setting_text(r), r.temperature), []).append(r)
    return [n for n in EVAL_SETTING_NAMES if any(len({r.eval_setting(n) for r in g}) > 1 for g in merged.values())]


def _hint(name: str, value: str) -> str:
    """Where a setting the layout does not print can be seen, or how to keep one value of it."""
    if name == "ttt_length":
        return f"use --layout table6 or the methods layout, or keep one with --ttt-length {value}"
    if name == "nodes":
        return f"use --layout table1 or the methods layout, or keep one with --nodes {value}"
    if name in ("method", "label"):
        return f"give each its own row label with --name, or keep one with --setting {name}={value}"
    return f"use the methods layout, or keep one with --setting {name}={value}"


def check_distinct(layout: Layout, configs: dict[tuple, list[Record]]) -> None:
    """Refuse when two configurations would print the same key (the layout has no column for the setting
    that tells them apart), naming that setting, the values the records have, and what shows it."""
    by_printed: dict[tuple, list[dict]] = {}
    for key in configs:
        by_printed.setdefault(layout.keyed(configs[key][0])[1], []).append(dict(key))
    for clash in by_printed.values():
        if len(clash) < 2:
            continue
        first = settings_of(next(iter(configs.values()))[0])
        names = list(dict.fromkeys([*first, *(n for c in clash for n in c)]))
        # Axes and evaluation settings before method and label: they say what differs, not who ran it.
        names.sort(key=lambda n: n in ("method", "label"))
        name = next(n for n in names if len({c.get(n) for c in clash}) > 1)
        values = sorted({settings_of(r).get(name) for rs in configs.values() for r in rs}, key=sort_key)
        shown = ", ".join(value_text(v) for v in values)
        present = [v for v in values if v is not None]
        raise TableError(f"{layout.name} has no column for {name} (records have {shown}): "
                         f"{_hint(name, value_text(present[-1] if present else None))}")
