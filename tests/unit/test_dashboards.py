"""The Grafana dashboard (deploy/grafana/txactors.json) and the Prometheus alert rules
(deploy/prometheus/txactors-rules.yml) name only series the code exports, with only the labels
those series carry: a renamed metric or label fails here, not on an operator's blank panel or
an alert that can never fire. What is exported is read from the code's own registries, not
from a list kept by hand. Where promtool is installed (Debian's `prometheus` package), it
checks the rules and runs their unit tests (deploy/prometheus/txactors-rules.test.yml)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from txactors.coordinator.core.table import TransactionTable
from txactors.observe.metrics import ConsumerMetrics, CoordinatorMetrics
from txactors.ops.top import COUNTED

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "txactors.json"
RULES = ROOT / "deploy" / "prometheus" / "txactors-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "txactors-rules.test.yml"

REQUIRE_PROMTOOL = "TXACTORS_REQUIRE_PROMTOOL"
"""Set by .ci/run once it installed promtool: then its test must not skip."""
TARGET_LABELS = frozenset({"job", "instance"})
"""Labels Prometheus adds to every scraped series."""
SCRAPE_SERIES = {"up": TARGET_LABELS}
"""Series Prometheus makes itself for each target."""

FUNCTIONS = frozenset(
    [
        "sum",
        "count",
        "max",
        "min",
        "avg",
        "group",
        "topk",
        "bottomk",
        "quantile",
        "count_values",
        "stddev",
        "stdvar",
        "rate",
        "irate",
        "increase",
        "delta",
        "deriv",
        "histogram_quantile",
        "absent",
        "absent_over_time",
        "max_over_time",
        "min_over_time",
        "avg_over_time",
        "sum_over_time",
        "count_over_time",
        "last_over_time",
        "changes",
        "resets",
        "clamp_min",
        "clamp_max",
        "abs",
        "vector",
        "scalar",
        "time",
        "label_replace",
        "sort",
        "sort_desc",
    ]
)
KEYWORDS = frozenset(["and", "or", "unless", "bool", "offset", "inf", "nan"])
GROUPING = frozenset(["by", "without", "on", "ignoring", "group_left", "group_right"])
TOKEN = re.compile(
    r"""
    "(?:[^"\\]|\\.)*" | '(?:[^'\\]|\\.)*'      # strings
    | \[[^\]]*\]                                # ranges, subqueries
    | \$\{?\w+\}?                               # Grafana variables
    | [A-Za-z_:][\w:]*                          # names
    | \d[\w.+-]*                                # numbers, durations
    | =~ | !~ | != | == | >= | <= | [-+*/%^=<>{}(),]
    """,
    re.VERBOSE,
)


def exported() -> dict[str, frozenset[str]]:
    """Every series name the code exports, with its labels: a coordinator tracking one
    partition and a consumer tracking one (topic, group), as they do once started."""
    registry = CollectorRegistry()
    coordinator = CoordinatorMetrics(registry)
    coordinator.track(0, TransactionTable())
    ConsumerMetrics(registry).track("orders", "billing")
    names: dict[str, set[str]] = {}
    for family in registry.collect():
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return {
        **{name: frozenset(labels) | TARGET_LABELS for name, labels in names.items()},
        **SCRAPE_SERIES,
    }


class Query:
    """What a PromQL expression names: series with the labels it matches on, and the labels
    it groups by. Enough of PromQL for the expressions we ship; anything else fails."""

    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.series: list[tuple[str, set[str]]] = []
        self.grouping: set[str] = set()
        self.unknown_functions: set[str] = set()
        tokens = TOKEN.findall(expr)
        leftover = TOKEN.sub("", expr).strip()
        assert not leftover, f"cannot read {leftover!r} in {expr!r}"
        i = 0
        while i < len(tokens):
            token = tokens[i]
            following = tokens[i + 1] if i + 1 < len(tokens) else ""
            if token in GROUPING:
                if following == "(":
                    end = tokens.index(")", i)
                    self.grouping.update(t for t in tokens[i + 2 : end] if t != ",")
                    i = end
            elif token == "{":
                raise AssertionError(f"a selector without a metric name in {expr!r}")
            elif re.fullmatch(r"[A-Za-z_:][\w:]*", token):
                if following == "(" or following in ("by", "without"):
                    if token not in FUNCTIONS:
                        self.unknown_functions.add(token)
                elif token not in KEYWORDS:
                    matched: set[str] = set()
                    if following == "{":
                        end = tokens.index("}", i)
                        inner = tokens[i + 2 : end]
                        matched = {inner[j] for j in range(0, len(inner), 4)}
                        i = end
                    self.series.append((token, matched))
            i += 1

    def problems(self, known: dict[str, frozenset[str]]) -> Iterator[str]:
        for function in sorted(self.unknown_functions):
            yield f"{function}(): not a PromQL function this test knows"
        labels: set[str] = set(TARGET_LABELS)
        for name, matched in self.series:
            if name not in known:
                yield f"{name}: no such series"
                continue
            labels |= known[name]
            for label in sorted(matched - known[name]):
                yield f"{name}{{{label}=...}}: {name} has no label {label}"
        for label in sorted(self.grouping - labels):
            yield f"by/on ({label}): no series here has it"
        if not self.series:
            yield "names no series"

    def output_labels(self, known: dict[str, frozenset[str]]) -> set[str]:
        """The labels a result may carry: what it is grouped by, else its series' labels."""
        if self.grouping:
            return set(self.grouping)
        return {label for name, _ in self.series for label in known.get(name, ())}


def dashboard_queries() -> Iterator[tuple[str, str]]:
    """(where, expr) of every query of the dashboard: panels, rows' panels, variables."""
    dashboard = json.loads(DASHBOARD.read_text())

    def panels(items: list[dict[str, object]]) -> Iterator[dict[str, object]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))  # type: ignore[arg-type]

    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):  # type: ignore[attr-defined]
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            found = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query)
            assert found, f"variable {variable['name']}: {query!r} is not label_values(m, l)"
            series, label = found.groups()
            yield f"variable {variable['name']}", f"group by ({label}) ({series})"


def rule_queries() -> Iterator[tuple[str, str]]:
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            yield f"rule {rule.get('alert') or rule.get('record')}", rule["expr"]


def problems_of(queries: Iterator[tuple[str, str]]) -> list[str]:
    known = exported()
    return [
        f"{where}: {problem}" for where, expr in queries for problem in Query(expr).problems(known)
    ]


def test_the_dashboard_names_only_exported_series_and_labels() -> None:
    queries = list(dashboard_queries())
    assert len(queries) > 20
    assert problems_of(iter(queries)) == []


def test_the_alert_rules_name_only_exported_series_and_labels() -> None:
    queries = list(rule_queries())
    assert len(queries) > 10
    assert problems_of(iter(queries)) == []


def test_legends_and_annotations_name_labels_their_queries_keep() -> None:
    """`{{partition}}` in a legend, `$labels.group` in an alert's text: a label the query
    aggregated away would show empty."""
    known = exported()
    dashboard = json.loads(DASHBOARD.read_text())
    wrong = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            used = set(re.findall(r"{{\s*(\w+)\s*}}", target.get("legendFormat", "")))
            kept = Query(target["expr"]).output_labels(known)
            wrong += [f"{panel['title']}: {label}" for label in sorted(used - kept)]
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            text = " ".join(rule.get("annotations", {}).values())
            used = set(re.findall(r"\$labels\.(\w+)", text))
            kept = Query(rule["expr"]).output_labels(known)
            wrong += [f"{rule['alert']}: {label}" for label in sorted(used - kept)]
    assert wrong == []


def test_the_dashboard_covers_every_coordinator_and_consumer_series() -> None:
    """A metric added to the code and left off the dashboard fails here."""
    used = {name for _, expr in dashboard_queries() for name, _ in Query(expr).series}
    families = {name.removesuffix("_bucket") for name in used}
    exported_families = {
        re.sub(r"_(bucket|count|sum|created)$", "", name)
        for name in exported()
        if name.startswith("txactors_") and not name.endswith("_created")
    }
    assert sorted(exported_families - families) == []


def test_a_wrong_name_or_label_is_caught() -> None:
    known = exported()
    assert list(Query("rate(txactors_commits_total[5m])").problems(known)) == []
    assert list(Query("sum(rate(txactors_comits_total[5m]))").problems(known)) == [
        "txactors_comits_total: no such series"
    ]
    assert list(Query('txactors_commits_total{group="g"}').problems(known)) == [
        "txactors_commits_total{group=...}: txactors_commits_total has no label group"
    ]
    assert list(Query("sum by (topic) (txactors_commits_total)").problems(known)) == [
        "by/on (topic): no series here has it"
    ]
    assert list(Query("summ(txactors_commits_total)").problems(known)) == [
        "summ(): not a PromQL function this test knows"
    ]


def test_top_reads_counters_the_coordinator_exports() -> None:
    known = exported()
    assert [name for name in COUNTED if "partition" not in known.get(name, ())] == []


def test_promtool_checks_and_tests_the_rules() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        assert not os.environ.get(REQUIRE_PROMTOOL), f"{REQUIRE_PROMTOOL} is set: .ci/promtool ran"
        pytest.skip(
            "promtool is not installed (`bash .ci/promtool` or `just promtool` installs it "
            "from Debian's prometheus package); "
            "the rules' syntax and unit tests are unchecked"
        )
    for args in (["check", "rules", str(RULES)], ["test", "rules", str(RULE_TESTS)]):
        done = subprocess.run(
            [promtool, *args], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr
