"""multi's `calculate_output`: a small arithmetic language parsed and evaluated here, never by Python's eval.
Numbers, the named graders' scores, + - * / and ^ (or **) for powers, parentheses, and the functions min, max,
abs, sqrt, log (natural), exp, floor, ceil, as OpenAI documents them."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

MAX_LENGTH = 2000
MAX_DEPTH = 64
MAX_NODES = 256  # bounds the tree, and so the evaluator's recursion
FUNCTIONS: dict[str, tuple[Callable[..., float], int | None]] = {  # name -> (function, arguments; None: 1 or more)
    "min": (lambda *xs: min(xs), None),
    "max": (lambda *xs: max(xs), None),
    "abs": (abs, 1),
    "sqrt": (math.sqrt, 1),
    "log": (math.log, 1),
    "exp": (math.exp, 1),
    "floor": (lambda x: float(math.floor(x)), 1),
    "ceil": (lambda x: float(math.ceil(x)), 1),
}
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)|([A-Za-z_][A-Za-z0-9_]*)|(\*\*|.))")
Node = tuple  # ("num", v) | ("var", name) | ("neg", node) | ("op", sym, a, b) | ("call", name, [nodes])


class FormulaError(ValueError):
    """A formula that does not parse, names what is not there, or cannot be computed."""


def parse(text: str, names: set[str]) -> Node:
    """The formula as a tree; FormulaError saying what is wrong and where (names: the scores it may use)."""
    if len(text) > MAX_LENGTH:
        raise FormulaError(f"the formula is {len(text)} characters; at most {MAX_LENGTH}")
    parser = _Parser(_tokens(text), names)
    node = parser.expr(0)
    if parser.peek() is not None:
        raise FormulaError(f"unexpected {parser.peek()!r} at token {parser.pos + 1}; {_HINT}")
    return node


_HINT = "write arithmetic over the graders' names: + - * / ^, parentheses, min max abs sqrt log exp floor ceil"


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            break
        pos = m.end()
        tok = m.group(0).strip()
        if not tok:
            continue
        if m.group(3) is not None and tok not in "+-*/^(),**":
            raise FormulaError(f"unexpected character {tok!r} at position {m.start(3) + 1}; {_HINT}")
        out.append(tok)
    if not out:
        raise FormulaError(f"the formula is empty; {_HINT}")
    return out


class _Parser:
    """Recursive descent: expr = term (+|- term)*; term = unary (*|/ unary)*; unary = -unary | power;
    power = atom (^ unary)?; atom = number | name | function(args) | (expr)."""

    def __init__(self, tokens: list[str], names: set[str]) -> None:
        self.tokens, self.names, self.pos = tokens, names, 0
        if len(tokens) > 2 * MAX_NODES:
            raise FormulaError(f"the formula has {len(tokens)} tokens; at most {2 * MAX_NODES}")

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise FormulaError(f"the formula ends too soon; {_HINT}")
        self.pos += 1
        return tok

    def expect(self, tok: str) -> None:
        got = self.take()
        if got != tok:
            raise FormulaError(f"expected {tok!r} at token {self.pos}, found {got!r}")

    def expr(self, depth: int) -> Node:
        if depth > MAX_DEPTH:
            raise FormulaError(f"the formula nests deeper than {MAX_DEPTH}")
        node = self.term(depth)
        while self.peek() in ("+", "-"):
            node = ("op", self.take(), node, self.term(depth))
        return node

    def term(self, depth: int) -> Node:
        node = self.unary(depth)
        while self.peek() in ("*", "/"):
            node = ("op", self.take(), node, self.unary(depth))
        return node

    def unary(self, depth: int) -> Node:
        if self.peek() in ("-", "+"):
            sign = self.take()
            if depth > MAX_DEPTH:
                raise FormulaError(f"the formula nests deeper than {MAX_DEPTH}")
            inner = self.unary(depth + 1)
            return ("neg", inner) if sign == "-" else inner
        node = self.atom(depth)
        if self.peek() in ("^", "**"):
            self.take()
            node = ("op", "^", node, self.unary(depth + 1))
        return node

    def atom(self, depth: int) -> Node:
        tok = self.take()
        if tok == "(":
            node = self.expr(depth + 1)
            self.expect(")")
            return node
        if tok[0].isdigit() or tok[0] == ".":
            return ("num", float(tok))
        if tok[0].isalpha() or tok[0] == "_":
            return self.name(tok, depth)
        raise FormulaError(f"unexpected {tok!r} at token {self.pos}; {_HINT}")

    def name(self, tok: str, depth: int) -> Node:
        if self.peek() == "(":
            if tok not in FUNCTIONS:
                raise FormulaError(f"unknown function {tok!r}; the functions are {', '.join(FUNCTIONS)}")
            self.take()
            args = [self.expr(depth + 1)]
            while self.peek() == ",":
                self.take()
                args.append(self.expr(depth + 1))
            self.expect(")")
            arity = FUNCTIONS[tok][1]
            if arity is not None and len(args) != arity:
                raise FormulaError(f"{tok}() takes {arity} argument, given {len(args)}")
            return ("call", tok, args)
        if tok not in self.names:
            known = ", ".join(sorted(self.names)) or "none"
            raise FormulaError(f"unknown name {tok!r}; the formula may use the graders' names ({known})")
        return ("var", tok)


def evaluate(node: Node, scores: dict[str, float]) -> float:
    """The formula's value (scores: every name it uses); FormulaError when it cannot be computed (division by zero, log of 0, overflow)."""
    try:
        value = _eval(node, scores)
    except (ZeroDivisionError, ValueError, OverflowError, RecursionError) as e:
        raise FormulaError(f"the formula cannot be computed for these scores ({e})") from None
    if not math.isfinite(value):
        raise FormulaError(f"the formula's value is {value}, not a finite number")
    return value


def _eval(node: Node, scores: dict[str, float]) -> float:
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind == "var":
        return scores[node[1]]
    if kind == "neg":
        return -_eval(node[1], scores)
    if kind == "call":
        return float(FUNCTIONS[node[1]][0](*(_eval(a, scores) for a in node[2])))
    a, b = _eval(node[2], scores), _eval(node[3], scores)
    if node[1] == "+":
        return a + b
    if node[1] == "-":
        return a - b
    if node[1] == "*":
        return a * b
    if node[1] == "/":
        return a / b
    return math.pow(a, b)
