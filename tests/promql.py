"""A small PromQL parser for tests: enough of the grammar to reject a malformed expression and to
list the series an expression selects (metric name and the label names it matches on) and the
labels it groups by. Not an evaluator; Grafana's variables must be substituted first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+)(?![\w.])
  | (?P<number>0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=,(){}\[\]:@])
""", re.VERBOSE)

AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
                "count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio"}
_PARAMETRIC = {"count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio"}
FUNCTIONS = {
    "abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh",
    "avg_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "cos", "cosh",
    "count_over_time", "day_of_month", "day_of_week", "day_of_year", "days_in_month", "deg",
    "delta", "deriv", "double_exponential_smoothing", "exp", "floor", "histogram_avg",
    "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev",
    "histogram_stdvar", "histogram_sum", "holt_winters", "hour", "idelta", "increase", "irate",
    "label_join", "label_replace", "last_over_time", "ln", "log10", "log2", "mad_over_time",
    "max_over_time", "min_over_time", "minute", "month", "pi", "predict_linear",
    "present_over_time", "quantile_over_time", "rad", "rate", "resets", "round", "scalar", "sgn",
    "sin", "sinh", "sort", "sort_by_label", "sort_by_label_desc", "sort_desc", "sqrt",
    "stddev_over_time", "stdvar_over_time", "sum_over_time", "tan", "tanh", "time", "timestamp",
    "vector", "year"}
_BINARY = {"+", "-", "*", "/", "%", "^", "==", "!=", ">", "<", ">=", "<=", "and", "or",
           "unless", "atan2"}
_MATCH = {"=", "!=", "=~", "!~"}


class PromQLError(ValueError):
    pass


@dataclass
class Selector:
    metric: str | None
    labels: dict[str, str]  # label name -> the value it is matched against (quoted)


@dataclass
class Parsed:
    selectors: list[Selector] = field(default_factory=list)
    grouping: set[str] = field(default_factory=set)  # labels of by / without / on / ignoring


def tokenize(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise PromQLError(f"unexpected {expr[pos:pos + 10]!r} at {pos} in {expr!r}")
        if m.lastgroup != "ws":
            out.append((m.lastgroup or "", m.group()))
        pos = m.end()
    return out


def parse(expr: str) -> Parsed:
    p = _Parser(tokenize(expr), expr)
    p.expr()
    if p.peek() is not None:
        p.fail("unexpected trailing input")
    return p.result


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]], text: str):
        self.tokens, self.i, self.text = tokens, 0, text
        self.result = Parsed()

    def fail(self, why: str):
        near = " ".join(v for _, v in self.tokens[self.i:self.i + 4])
        raise PromQLError(f"{why} near {near!r} in {self.text!r}")

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, value: str | None = None, kind: str | None = None) -> str:
        t = self.peek()
        if t is None or (value is not None and t[1] != value) or (kind and t[0] != kind):
            self.fail(f"expected {value or kind}")
        self.i += 1
        return t[1]

    def accept(self, value: str) -> bool:
        t = self.peek()
        if t is not None and t[1] == value and t[0] in ("op", "ident"):
            self.i += 1
            return True
        return False

    def expr(self) -> None:
        self.unary()
        while (t := self.peek()) is not None and t[1] in _BINARY and t[0] in ("op", "ident"):
            self.i += 1
            self.accept("bool")
            for kw in ("on", "ignoring"):
                if self.accept(kw):
                    self.result.grouping |= self.labels()
            for kw in ("group_left", "group_right"):
                if self.accept(kw) and self.peek() == ("op", "("):
                    self.result.grouping |= self.labels()
            self.unary()

    def unary(self) -> None:
        while self.accept("-") or self.accept("+"):
            pass
        self.primary()
        while True:  # postfix: range, subquery, offset, @
            if self.accept("["):
                self.take(kind="duration")
                if self.accept(":"):
                    if self.peek() and self.peek()[0] == "duration":  # type: ignore[index]
                        self.i += 1
                self.take("]")
            elif self.accept("offset"):
                self.accept("-")
                self.take(kind="duration")
            elif self.accept("@"):
                t = self.peek()
                if t and t[1] in ("start", "end"):
                    self.i += 1
                    self.take("(")
                    self.take(")")
                else:
                    self.take(kind="number")
            else:
                return

    def primary(self) -> None:
        t = self.peek()
        if t is None:
            self.fail("expected an expression")
        kind, value = t  # type: ignore[misc]
        if kind in ("number", "string"):
            self.i += 1
        elif value == "(":
            self.i += 1
            self.expr()
            self.take(")")
        elif value == "{":
            self.selector(None)
        elif kind == "ident" and value in AGGREGATIONS:
            self.i += 1
            self.grouping_clause()
            self.take("(")
            if value in _PARAMETRIC:
                self.expr()
                self.take(",")
            self.expr()
            self.take(")")
            self.grouping_clause()
        elif kind == "ident" and self.tokens[self.i + 1:self.i + 2] == [("op", "(")]:
            if value not in FUNCTIONS:
                self.fail(f"unknown function {value}")
            self.i += 2
            if not self.accept(")"):
                self.expr()
                while self.accept(","):
                    self.expr()
                self.take(")")
        elif kind == "ident":
            self.i += 1
            self.selector(value)
        else:
            self.fail("expected an expression")

    def grouping_clause(self) -> None:
        if self.accept("by") or self.accept("without"):
            self.result.grouping |= self.labels()

    def labels(self) -> set[str]:
        self.take("(")
        names: set[str] = set()
        while not self.accept(")"):
            names.add(self.take(kind="ident"))
            if not self.accept(","):
                self.take(")")
                break
        return names

    def selector(self, metric: str | None) -> None:
        labels: dict[str, str] = {}
        if self.accept("{"):
            while not self.accept("}"):
                name = self.take(kind="ident")
                op = self.take(kind="op")
                if op not in _MATCH:
                    self.fail(f"bad label matcher {op}")
                labels[name] = self.take(kind="string")
                if not self.accept(","):
                    self.take("}")
                    break
        if metric is None and "__name__" not in labels:
            self.fail("a selector needs a metric name")
        self.result.selectors.append(Selector(metric, labels))
