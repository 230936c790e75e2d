"""The /metrics body, byte for byte what prometheus_client writes (the text format 0.0.4
and OpenMetrics 1.0.0), several times faster: a scrape holds the GIL while it renders, and
with prometheus_client's own writer most of a scrape was spent checking and escaping each
sample's metric and label names one character at a time (issue 24: a scrape every 50 ms
took 29% of serve's CPU in bench_freshness).

The names are checked once per family instead. What this writer does not cover (a name
outside the legacy character set, exemplars, timestamps, native histograms, units) it
leaves to prometheus_client: `render` returns None and the caller uses its writer.
tests/test_exposition.py compares the two on generated families.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable

from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.utils import floatToGoString

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_OPENMETRICS_EXTRA = ("_created", "_gsum", "_gcount")  # the text format puts these in gauges of their own
# Name escapings under which a legacy name is written as it is (not DOTS, not VALUES).
_ESCAPINGS = (openmetrics.UNDERSCORES, openmetrics.ALLOWUTF8)
_TEXT_TYPE = {"counter": "counter", "info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram",
              "unknown": "untyped"}


class Unsupported(Exception):
    """A family this writer leaves to prometheus_client's."""


def render(families: Iterable[Metric], openmetrics: bool) -> bytes | None:
    """The families in the text format (`openmetrics` False) or OpenMetrics 1.0.0; None
    when one of them needs prometheus_client's writer."""
    try:
        out: list[str] = []
        for family in families:
            (_openmetrics if openmetrics else _text)(family, out)
    except Unsupported:
        return None
    if openmetrics:
        out.append("# EOF\n")
    return "".join(out).encode("utf-8")


def _text(family: Metric, out: list[str]) -> None:
    name, kind = family.name, family.type
    if kind == "counter":
        name += "_total"
    elif kind == "info":
        name += "_info"
    kind = _TEXT_TYPE.get(kind, kind)
    help_text = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
    _check_name(name)
    out.append(f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n")
    extra: dict[str, list[str]] = {}
    suffixes = {family.name + suffix: suffix for suffix in _OPENMETRICS_EXTRA}
    for sample in family.samples:
        line = _sample_line(sample)
        if sample.name in suffixes:
            extra.setdefault(suffixes[sample.name], []).append(line)
        else:
            out.append(line)
    for suffix, lines in sorted(extra.items()):
        out.append(f"# HELP {family.name}{suffix} {help_text}\n# TYPE {family.name}{suffix} gauge\n")
        out.extend(lines)


def _openmetrics(family: Metric, out: list[str]) -> None:
    if family.unit:
        raise Unsupported("unit")
    _check_name(family.name)
    out.append(f"# HELP {family.name} {_escape(family.documentation)}\n# TYPE {family.name} {family.type}\n")
    for sample in family.samples:
        if ":" in sample.name:  # (its writer turns a sample name's colons into underscores)
            raise Unsupported(sample.name)
        out.append(_sample_line(sample))


def _sample_line(sample) -> str:
    if sample.timestamp is not None or sample.exemplar or sample.native_histogram:
        raise Unsupported("timestamp, exemplar or native histogram")
    _check_name(sample.name)
    value = "" if sample.value is None else _number(sample.value)
    if not sample.labels:
        return f"{sample.name} {value}\n"
    return f"{sample.name}{{{_labels(sample.labels)}}} {value}\n"


def _number(value: float) -> str:
    """floatToGoString, its common case inline: repr unless not finite or long enough for
    Go's exponent."""
    text = repr(float(value))
    if text[-1] in "nf" or text.find(".") > 6:
        return floatToGoString(value)
    return text


# A label-name tuple (as the sample holds them) -> the names sorted and the label set's
# template: the names are checked and sorted once, not per sample.
_templates: dict[tuple[str, ...], tuple[list[str], str]] = {}


def _labels(labels: dict[str, str]) -> str:
    keys = tuple(labels)
    known = _templates.get(keys)
    if known is None:
        names = sorted(_label_name(k) for k in keys)
        known = names, ",".join(f'{k}="{{}}"' for k in names)
        if len(_templates) >= _MAX_CHECKED:
            _templates.clear()
        _templates[keys] = known
    names, template = known
    values = [labels[k] for k in names]
    joined = "".join(values)
    if "\\" in joined or "\n" in joined or '"' in joined:
        values = [_escape(v) for v in values]
    return template.format(*values)


# Names found valid (ours are a few hundred; the bound keeps another registry's from growing them).
_checked_names: set[str] = set()
_checked_label_names: set[str] = set()
_MAX_CHECKED = 10_000


def _check_name(name: str) -> None:
    if name not in _checked_names:
        if not _METRIC_NAME.fullmatch(name):
            raise Unsupported(name)
        if len(_checked_names) >= _MAX_CHECKED:
            _checked_names.clear()
        _checked_names.add(name)


def _label_name(name: str) -> str:
    if name not in _checked_label_names:
        if not _LABEL_NAME.fullmatch(name) or name.startswith("__"):  # (reserved: its writer's own rules)
            raise Unsupported(name)
        if len(_checked_label_names) >= _MAX_CHECKED:
            _checked_label_names.clear()
        _checked_label_names.add(name)
    return name


def _escape(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def format_of(encoder: Callable) -> bool | None:
    """What prometheus_client's `choose_encoder` chose, as `render`'s `openmetrics`: False
    for the text format, True for OpenMetrics 1.0.0; None for anything else (another
    version or name escaping), which its own writer serves."""
    if encoder is generate_latest:
        return False
    if not isinstance(encoder, functools.partial) or encoder.keywords.get("escaping") not in _ESCAPINGS:
        return None
    if encoder.func is generate_latest:
        return False
    if encoder.func is openmetrics.generate_latest and encoder.keywords.get("version") == "1.0.0":
        return True
    return None
