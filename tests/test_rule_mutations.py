"""Mutation test of deploy/prometheus/rules.yml: every threshold, `for:` and branch of the rules
must be pinned by a unit test (rules.test.yml, rules.history.test.yml).

Mutants are generated from the rule file: (1) each alert without its `for:`; (2) each number of
an expression moved up and down (×1.25 and ×0.8; an integer at least to the next integer, since
counts are integers and `count >= 2.4` would be `count >= 3`; not 0, whose role is structural,
nor the quantile of `quantile(0.5, …)`, offsets, ranges or strings); (3) each operand of each
`or`, `and` and `unless` deleted, with its operator (operands found by parenthesis matching, at
every level); (4) each comparison turned around (< and >, <= and >=, == and !=). Each mutant is
written to a temporary directory beside copies of the unit tests and `promtool test rules` must
FAIL on it. A surviving mutant is a missing test: add the test. Only a truly equivalent mutant
may be listed in EQUIVALENT, with the reason.

For speed, the unit test groups that mention the mutated rule (or a rule or alert built on it)
run first, one file per group, cheapest first, and the run stops at the first failure; a mutant
they all pass is then run against the complete copies of both test files.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from test_prometheus_rules import PROMETHEUS, TEST_FILES, promtool  # noqa: F401 (the fixture)

# Mutant id -> why no test can tell it from the rule file. Keep it empty unless it is truly so.
EQUIVALENT: dict[str, str] = {}


# --- A small PromQL lexer: enough to find numbers, comparisons and set operators outside strings,
# label matchers and ranges, and to match parentheses. ---

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<matchers>\{(?:[^}"']|"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')*\})
  | (?P<range>\[[^\]]*\])
  | (?P<duration>\d+(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*(?![\w:.]))
  | (?P<num>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?(?![\w:.]))
  | (?P<ident>[A-Za-z_:][\w:]*)
  | (?P<cmp>==|!=|<=|>=|<|>)
  | (?P<op>[-+*/%^])
  | (?P<lparen>\()
  | (?P<rparen>\))
  | (?P<comma>,)
""", re.VERBOSE)


@dataclass(frozen=True)
class Token:
    kind: str
    text: str
    start: int
    end: int


def tokens(expr: str) -> list[Token]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot lex {expr[pos:pos + 30]!r} in {expr!r}")
        if m.lastgroup != "ws":
            out.append(Token(m.lastgroup, m.group(), m.start(), m.end()))
        pos = m.end()
    return out


def matching_parens(toks: list[Token]) -> dict[int, int]:
    stack, match = [], {}
    for i, t in enumerate(toks):
        if t.kind == "lparen":
            stack.append(i)
        elif t.kind == "rparen":
            match[stack.pop()] = i
    assert not stack, "unbalanced parentheses"
    return match


# Functions whose first argument is a parameter, not a threshold (0.5 of a median is no tunable).
_PARAMETER_FIRST = {"quantile", "topk", "bottomk", "count_values", "quantile_over_time", "histogram_quantile"}


def numbers(expr: str) -> list[Token]:
    toks = tokens(expr)
    match = matching_parens(toks)
    skip = set()
    for i, t in enumerate(toks):
        if t.kind == "ident" and t.text in _PARAMETER_FIRST:
            j = i + 1
            if j < len(toks) and toks[j].text in ("by", "without"):
                j = match[j + 1] + 1  # past the label list
            if j + 1 < len(toks) and toks[j].kind == "lparen" and toks[j + 1].kind == "num":
                skip.add(j + 1)
    return [t for i, t in enumerate(toks) if t.kind == "num" and i not in skip]


def moved(text: str) -> list[str]:
    value = float(text)
    if value == 0:
        return []
    if value.is_integer():
        up, down = max(math.ceil(value * 1.25), value + 1), min(math.floor(value * 0.8), value - 1)
    else:
        up, down = value * 1.25, value * 0.8
    return [f"{up:.6g}", f"{down:.6g}"]


_TURNED = {"<": ">", ">": "<", "<=": ">=", ">=": "<=", "==": "!=", "!=": "=="}


def branch_deletions(expr: str) -> list[tuple[str, str]]:
    """(what, mutated expression) for each operand of each `or` / `and` / `unless`, deleted with
    its operator, at every parenthesis level. `or` binds loosest; `and` and `unless` tighter."""
    toks = tokens(expr)
    match = matching_parens(toks)
    regions = [(0, len(toks))] + [(i + 1, j) for i, j in match.items()]
    out = []

    def chain(lo: int, hi: int, ops: set[str]) -> list[tuple[int, int, int]]:
        """Operands of a chain of `ops` in toks[lo:hi] at this level: (first, last token, operator start)."""
        operands, start, i = [], lo, lo
        while i < hi:
            t = toks[i]
            if t.kind == "lparen":
                i = match[i] + 1
                continue
            if t.kind == "ident" and t.text in ops:
                op_start, j = i, i + 1
                if j < hi and toks[j].text in ("on", "ignoring"):
                    j = match[j + 1] + 1
                operands.append((start, op_start - 1, op_start))
                start, i = j, j
                continue
            i += 1
        operands.append((start, hi - 1, hi))
        return operands

    def delete(lo_char: int, hi_char: int) -> str:
        return (expr[:lo_char] + expr[hi_char:]).strip()

    for lo, hi in regions:
        args, start = [], lo  # split the region into arguments at its commas
        i = lo
        while i < hi:
            if toks[i].kind == "lparen":
                i = match[i] + 1
                continue
            if toks[i].kind == "comma":
                args.append((start, i))
                start = i + 1
            i += 1
        args.append((start, hi))
        for a_lo, a_hi in args:
            if a_lo >= a_hi:
                continue
            ors = chain(a_lo, a_hi, {"or"})
            chains = [("or", ors)] + [("and/unless", chain(first, last + 1, {"and", "unless"}))
                                      for first, last, _ in ors]
            for level, operands in chains:
                if len(operands) < 2:
                    continue
                for k, (first, last, _) in enumerate(operands):
                    if k == 0:  # the operand and the operator after it
                        lo_char, hi_char = toks[first].start, toks[operands[1][0]].start
                    else:  # the operator before the operand, and the operand
                        lo_char, hi_char = toks[operands[k - 1][1]].end, toks[last].end
                    text = " ".join(expr[toks[first].start:toks[last].end].split())
                    short = text if len(text) <= 70 else text[:67] + "..."
                    out.append((f"delete {level} operand {k + 1} of {len(operands)}: {short}",
                                delete(lo_char, hi_char)))
    return out


@dataclass(frozen=True)
class Mutant:
    rule: str    # the record or alert mutated
    what: str
    group: int   # its position in rules.yml
    index: int
    expr: str | None  # the mutated expression; None: the alert loses its `for:`

    @property
    def id(self) -> str:
        return f"{self.rule}: {self.what}"


def mutants(rule_file: dict) -> list[Mutant]:
    out = []
    for g, group in enumerate(rule_file["groups"]):
        for r, rule in enumerate(group["rules"]):
            name, expr = rule.get("alert") or rule["record"], rule["expr"]
            if "for" in rule:
                out.append(Mutant(name, f"without for: {rule['for']}", g, r, None))
            seen: dict[str, int] = {}
            for t in numbers(expr):
                seen[t.text] = seen.get(t.text, 0) + 1
                for new in moved(t.text):
                    out.append(Mutant(name, f"number {t.text} (#{seen[t.text]}) -> {new}", g, r,
                                      expr[:t.start] + new + expr[t.end:]))
            seen = {}
            for t in tokens(expr):
                if t.kind == "cmp":
                    seen[t.text] = seen.get(t.text, 0) + 1
                    out.append(Mutant(name, f"comparison {t.text} (#{seen[t.text]}) -> {_TURNED[t.text]}", g, r,
                                      expr[:t.start] + _TURNED[t.text] + expr[t.end:]))
            for what, new in branch_deletions(expr):
                out.append(Mutant(name, what, g, r, new))
    ids = [m.id for m in out]
    assert len(ids) == len(set(ids)), "mutant ids must be unique"
    return out


def apply(rule_file: dict, mutant: Mutant) -> dict:
    groups = [dict(g, rules=[dict(r) for r in g["rules"]]) for g in rule_file["groups"]]
    rule = groups[mutant.group]["rules"][mutant.index]
    if mutant.expr is None:
        del rule["for"]
    else:
        rule["expr"] = mutant.expr
    return {"groups": groups}


# --- Which unit test groups to run first for a mutant. ---

def _duration_s(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|[smhdwy])", str(text)))


@dataclass
class UnitTestGroup:
    source: str    # the test file it comes from
    header: dict   # that file's settings (rule_files, evaluation_interval, group_eval_order)
    body: dict
    mentions: set[str]
    steps: float   # evaluations promtool runs for it


def unit_test_groups(rule_names: set[str]) -> list[UnitTestGroup]:
    out = []
    for source in TEST_FILES:
        content = yaml.safe_load((PROMETHEUS / source).read_text())
        header = {k: v for k, v in content.items() if k != "tests"}
        interval = _duration_s(header.get("evaluation_interval", "1m"))
        for body in content["tests"]:
            text = " ".join([t["alertname"] for t in body.get("alert_rule_test", [])]
                            + [t["expr"] for t in body.get("promql_expr_test", [])])
            mentions = {n for n in rule_names if re.search(rf"(?<![\w:]){re.escape(n)}(?![\w:])", text)}
            end = max([_duration_s(t["eval_time"]) for t in body.get("alert_rule_test", [])
                       + body.get("promql_expr_test", [])], default=0)
            out.append(UnitTestGroup(source, header, body, mentions, end / interval))
    return out


def dependents(rule_file: dict) -> dict[str, dict[str, int]]:
    """Each rule's name -> itself and every rule built on it, transitively, with the number of
    steps between them (0 for itself)."""
    rules = [r for g in rule_file["groups"] for r in g["rules"]]
    uses = {(r.get("alert") or r["record"]): {n["record"] for n in rules if "record" in n
                                              and re.search(rf"(?<![\w:]){re.escape(n['record'])}(?![\w:])", r["expr"])}
            for r in rules}
    out = {}
    for name in uses:
        found, todo = {name: 0}, [name]
        while todo:  # breadth first: the shortest distances
            current = todo.pop(0)
            for other, used in uses.items():
                if current in used and other not in found:
                    found[other] = found[current] + 1
                    todo.append(other)
        out[name] = found
    return out


def promtool_test(promtool: str, directory: Path, files: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, "test", "rules", *files], cwd=directory, capture_output=True, text=True,
                          timeout=300)


def run_mutant(promtool: str, directory: Path, rule_file: dict, mutant: Mutant, groups: list[UnitTestGroup],
               affected: dict[str, int]) -> str | None:
    """The test group that kills the mutant, or None if it survives. The groups asserting on the
    mutated rule, or on the rules nearest to it, run first."""
    directory.mkdir()
    (directory / "rules.yml").write_text(yaml.safe_dump(apply(rule_file, mutant), sort_keys=False))
    first = sorted((g for g in groups if g.mentions & affected.keys()),
                   key=lambda g: (min(affected[n] for n in g.mentions & affected.keys()), g.steps))
    for n, group in enumerate(first):
        name = f"group{n}.test.yml"
        (directory / name).write_text(yaml.safe_dump({**group.header, "tests": [group.body]}, sort_keys=False))
        if promtool_test(promtool, directory, [name]).returncode != 0:
            return f"{group.source}: {group.body.get('name', n)}"
    for source in TEST_FILES:  # the complete test files
        (directory / source).write_text((PROMETHEUS / source).read_text())
    if promtool_test(promtool, directory, list(TEST_FILES)).returncode != 0:
        return "the complete test files"
    return None


# --- The tests. ---

def test_the_mutation_operators():
    assert [t.text for t in numbers('quantile without (ago) (0.5, x offset 7d) > 0.05 and y{a="1"}[5m] >= 3')] \
        == ["0.05", "3"]
    assert moved("0.05") == ["0.0625", "0.04"] and moved("3") == ["4", "2"] and moved("100") == ["125", "80"]
    assert moved("1") == ["2", "0"] and moved("0") == []
    deleted = dict(branch_deletions("a > 1 and on (x) b or c unless d"))
    assert sorted(deleted.values()) == sorted(["c unless d", "a > 1 and on (x) b", "b or c unless d",
                                               "a > 1 or c unless d", "a > 1 and on (x) b or d",
                                               "a > 1 and on (x) b or c"])
    assert sorted(dict(branch_deletions("f(0.5, (p or q))")).values()) == ["f(0.5, (p))", "f(0.5, (q))"]


@pytest.mark.long
def test_every_mutant_of_the_rules_fails_the_unit_tests(promtool, tmp_path):
    started = time.monotonic()
    rule_file = yaml.safe_load((PROMETHEUS / "rules.yml").read_text())
    generated = mutants(rule_file)
    alerts_with_for = {r["alert"] for g in rule_file["groups"] for r in g["rules"] if "for" in r}
    assert {m.rule for m in generated if m.expr is None} == alerts_with_for
    assert {"number", "comparison", "delete"} <= {m.what.split()[0] for m in generated}
    stale = set(EQUIVALENT) - {m.id for m in generated}
    assert not stale, f"EQUIVALENT lists mutants that no longer exist: {sorted(stale)}"

    # Every mutant is a valid rule file: a syntax error would be killed for the wrong reason.
    check_dir = tmp_path / "check"
    check_dir.mkdir()
    for n, mutant in enumerate(generated):
        (check_dir / f"m{n:03d}.yml").write_text(yaml.safe_dump(apply(rule_file, mutant), sort_keys=False))
    checked = subprocess.run([promtool, "check", "rules", *sorted(p.name for p in check_dir.iterdir())],
                             cwd=check_dir, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]

    names = {r.get("alert") or r["record"] for g in rule_file["groups"] for r in g["rules"]}
    groups, affected = unit_test_groups(names), dependents(rule_file)
    # The harness itself: the rule file unchanged, written as the mutants are, passes every group
    # (run beside the mutants, and checked before their results are believed).
    unchanged = Mutant(generated[0].rule, "unchanged", generated[0].group, generated[0].index,
                       rule_file["groups"][generated[0].group]["rules"][generated[0].index]["expr"])
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        harness = pool.submit(run_mutant, promtool, tmp_path / "unchanged", rule_file, unchanged, groups,
                              {n: 0 for n in names})
        killers = dict(zip(generated, pool.map(
            lambda nm: run_mutant(promtool, tmp_path / f"mutant{nm[0]:03d}", rule_file, nm[1], groups,
                                  affected[nm[1].rule]), enumerate(generated))))
    assert harness.result() is None, f"the unchanged rule file fails {harness.result()}"

    survivors = [m.id for m, killer in killers.items() if killer is None]
    elapsed = time.monotonic() - started
    print(f"\n{len(generated)} mutants of rules.yml, {len(generated) - len(survivors)} killed, "
          f"{len(survivors)} surviving ({len(EQUIVALENT)} listed as equivalent), in {elapsed:.0f} s")
    missing = [s for s in survivors if s not in EQUIVALENT]
    assert not missing, "mutants no unit test catches (add the tests):\n  " + "\n  ".join(missing)
    killed_equivalents = [m.id for m, killer in killers.items() if killer and m.id in EQUIVALENT]
    assert not killed_equivalents, f"listed as equivalent but a test kills them: {killed_equivalents}"
