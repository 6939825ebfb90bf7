"""What a Hugging Face model's own code does that the decoder contract must follow, read from its source.

transformers states neither of these as data, so they are read from the modeling code the model runs:

  head_transform(model)   what the causal LM's forward does to `lm_head(hidden)` before its loss (Cohere's
                          `logits * self.logit_scale`, Gemma-2's `final_logit_softcapping`, Granite's
                          `/ logits_scaling`), and whether its loss adds a term the loss heads do not compute (a
                          router's load-balancing loss, a z-loss). The config's values decide the branches taken.
  layer_output(owner, attr)  what the decoder loop (`for layer in self.<attr>: ...` in the forward of the module
                          that owns the layer list) takes from each layer's return and hands to the next.

Either returns a one-line reason instead where the code does something this reader does not know, so the caller
refuses rather than guess: a loss that silently differs from the model's own is the failure this module prevents.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import replace
from typing import Any

from torch import nn

from models.adapter import LayerOutput, LogitTransform


class _Unknown(Exception):
    """An expression this reader cannot evaluate or a statement it cannot follow."""


@functools.cache
def _parse_forward(cls: type) -> ast.FunctionDef | None:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    fn = tree.body[0]
    return fn if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) else None  # type: ignore[return-value]


class _Evaluator:
    """Evaluates the small expressions the branches around the head use, on the model: `self.config.x`,
    `self.logit_scale`, `self.config.get_text_config().x`, `x is not None`, comparisons, and/or/not. A bare name is
    a local bound by `:=` or, failing that, the config's field of that name (`output_router_logits` defaults to it)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.local: dict[str, Any] = {}
        self.unknown: set[str] = set()  # locals assigned from something not evaluable: never the config's field

    def __call__(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id == "self":
                return self.model
            if node.id in self.local:
                return self.local[node.id]
            if node.id == "labels":
                return True  # training: the loss is computed
            if node.id in self.unknown:
                raise _Unknown(node.id)
            config = getattr(self.model, "config", None)
            if config is not None and hasattr(config, node.id):
                return getattr(config, node.id)
            raise _Unknown(node.id)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr == "training":
                return True  # the branch a training step takes
            base = self(node.value)
            if not hasattr(base, node.attr):
                raise _Unknown(ast.unparse(node))
            return getattr(base, node.attr)
        if (
            isinstance(node, ast.Call)
            and not node.args
            and not node.keywords
            and isinstance(node.func, ast.Attribute)
            and node.func.attr.startswith("get_")
        ):
            return self(node.func)()  # a getter (config.get_text_config()); nothing with side effects
        if isinstance(node, ast.NamedExpr):
            value = self(node.value)
            self.local[node.target.id] = value
            return value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return not self(node.operand)
        if isinstance(node, ast.BoolOp):
            # Short-circuit as Python does: `cap is not None and cap > 0` must not evaluate `None > 0`.
            value = None
            for operand in node.values:
                value = self(operand)
                if bool(value) is not isinstance(node.op, ast.And):
                    return value
            return value
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            a, b, op = self(node.left), self(node.comparators[0]), node.ops[0]
            compare = {
                ast.Is: lambda: a is b,
                ast.IsNot: lambda: a is not b,
                ast.Eq: lambda: a == b,
                ast.NotEq: lambda: a != b,
                ast.Gt: lambda: a > b,
                ast.GtE: lambda: a >= b,
                ast.Lt: lambda: a < b,
                ast.LtE: lambda: a <= b,
            }
            if type(op) in compare:
                try:
                    return compare[type(op)]()
                except TypeError:  # a value this comparison cannot take (None > 0): not known, so refused
                    raise _Unknown(ast.unparse(node)) from None
        raise _Unknown(ast.unparse(node))


def _head_attr(model: nn.Module) -> str | None:
    head = model.get_output_embeddings()
    return next((name for name, m in model.named_children() if m is head), None)


def _mentions(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def _is_head_call(node: ast.AST, head: str) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == head
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    )


def _ops_of(node: ast.expr, is_input: Any, ev: _Evaluator) -> list[tuple[str, float]]:
    """The elementwise ops `node` applies to the input (`is_input(n)` says which node that is), innermost first."""
    if is_input(node):
        return []
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args and not node.keywords:
        if node.func.attr == "float":
            return [*_ops_of(node.func.value, is_input, ev), ("float", 1.0)]
        if node.func.attr == "contiguous":
            return _ops_of(node.func.value, is_input, ev)
    if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
        func = ast.unparse(node.func)
        if func in ("torch.tanh", "nn.functional.tanh", "torch.nn.functional.tanh", "F.tanh"):
            return [*_ops_of(node.args[0], is_input, ev), ("tanh", 1.0)]
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "soft_cap" and len(node.args) == 2:
        cap = ev(node.args[1])  # xLSTM's soft_cap(values, cap): cap·tanh(values / cap), None: unchanged
        inner = _ops_of(node.args[0], is_input, ev)
        return inner if cap is None else [*inner, ("div", float(cap)), ("tanh", 1.0), ("mul", float(cap))]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
        if _touches_input(node.left, is_input):
            inner, factor = node.left, node.right
        elif isinstance(node.op, ast.Mult) and _touches_input(node.right, is_input):
            inner, factor = node.right, node.left
        else:
            raise _Unknown(ast.unparse(node))
        value = ev(factor)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _Unknown(ast.unparse(node))
        return [*_ops_of(inner, is_input, ev), ("mul" if isinstance(node.op, ast.Mult) else "div", float(value))]
    raise _Unknown(ast.unparse(node))


def _is_name(name: str, node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _touches_input(node: ast.AST, is_input: Any) -> bool:
    return any(is_input(n) for n in ast.walk(node))


def _transform(primitive: list[tuple[str, float]], source: str) -> LogitTransform:
    """Primitive ops → the transform: div c, tanh, mul c is a soft-cap; mul and div are scales."""
    ops: list[tuple[str, float]] = []
    i = 0
    while i < len(primitive):
        window = primitive[i : i + 3]
        if [op for op, _ in window] == ["div", "tanh", "mul"] and window[0][1] == window[2][1]:
            ops.append(("softcap", window[0][1]))
            i += 3
            continue
        op, value = primitive[i]
        if op == "tanh":
            raise _Unknown("tanh without a matching soft-cap scale")
        ops.append(("scale", value if op == "mul" else 1.0 / value) if op in ("mul", "div") else (op, value))
        i += 1
    return LogitTransform(tuple(ops), source)


def head_transform(model: nn.Module) -> LogitTransform | str:
    """The transform between the causal LM's head and its loss, or a one-line reason it cannot be followed."""
    cls = type(model)
    fn, head = _parse_forward(cls), _head_attr(model)
    if fn is None or head is None:
        return f"{cls.__name__}'s forward cannot be read (no source, or no named output projection)"
    ev = _Evaluator(model)
    bias = getattr(model.get_output_embeddings(), "bias", None) is not None
    try:
        return _read_head(fn.body, head, ev, cls.__name__, bias)
    except _Unknown as e:
        return f"{cls.__name__}'s forward does something to its logits or loss this project cannot follow ({e})"


def _read_head(body: list[ast.stmt], head: str, ev: _Evaluator, source: str, head_has_bias: bool) -> LogitTransform:
    primitive: list[tuple[str, float]] = []
    var: str | None = None  # the logits' variable, once the head has been called
    loss_seen = False
    shifts = True
    scaled: dict[str, list[tuple[str, float]]] = {}  # a variable's scaling since it was last set (the head's input)
    for stmt in _flatten(body, ev):
        if isinstance(stmt, ast.Return):
            break
        if var is None:
            if isinstance(stmt, ast.Assign) and any(_is_head_call(n, head) for n in ast.walk(stmt.value)):
                if len(stmt.targets) != 1 or not isinstance(stmt.targets[0], ast.Name):
                    raise _Unknown(ast.unparse(stmt))
                var = stmt.targets[0].id  # type: ignore[attr-defined]
                call = next(n for n in ast.walk(stmt.value) if _is_head_call(n, head))
                before = _head_input_ops(call, scaled, ev)
                if before and head_has_bias:  # h·s through W and a bias is not (hW + b)·s
                    raise _Unknown(f"a scaled input to a head with a bias: {ast.unparse(call)}")
                primitive += before + _ops_of(stmt.value, lambda n: _is_head_call(n, head), ev)
            else:
                _track_scaling(stmt, scaled, ev)
                _bind(stmt, ev)
            continue
        if _is_loss_statement(stmt):
            if loss_seen or not _standard_loss(stmt, var):
                raise _Unknown(ast.unparse(stmt).splitlines()[0])
            loss_seen = True
            shifts = ast.unparse(stmt.value.func) == "self.loss_function"  # type: ignore[attr-defined]
        elif _assigns(stmt, "loss") and loss_seen:
            raise _Unknown(f"adds to its loss: {ast.unparse(stmt).splitlines()[0]}")
        elif isinstance(stmt, ast.Assign) and _targets(stmt) == [var] and len(stmt.targets) == 1:
            primitive += _ops_of(stmt.value, functools.partial(_is_name, var), ev)
        elif isinstance(stmt, ast.Assign) and not any(_mentions(t, var) for t in stmt.targets):
            _bind(stmt, ev)  # another variable (labels moved to the logits' device, a local factor)
        elif _mentions(stmt, var) and not loss_seen:
            raise _Unknown(ast.unparse(stmt).splitlines()[0])  # e.g. an in-place change or a branch not read
    if var is None:
        raise _Unknown(f"no call of self.{head}")
    if not loss_seen:
        raise _Unknown("its loss is not transformers' causal-LM cross-entropy (no self.loss_function call)")
    return replace(_transform(primitive, source), shifts_labels=shifts)


def _base_name(node: ast.expr) -> str | None:
    """The variable under slicing and `.to(...)`: `hidden_states[:, idx, :]`, `hidden_states.to(dtype)`."""
    while True:
        if isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("to",):
            node = node.func.value
        else:
            return node.id if isinstance(node, ast.Name) else None


def _track_scaling(stmt: ast.stmt, scaled: dict[str, list[tuple[str, float]]], ev: _Evaluator) -> None:
    """`h = h / s` (MiniCPM3 scales the hidden states before its head) adds a scale to h; `h = h[...]` or
    `h = slice_logits_to_keep(h, ...)` keeps them; any other assignment starts h afresh."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return
    name, value = stmt.targets[0].id, stmt.value
    if _base_name(value) == name:
        return
    if isinstance(value, ast.Call) and ast.unparse(value.func) == "slice_logits_to_keep" and value.args:
        if _base_name(value.args[0]) == name:
            return
    try:
        ops = _ops_of(value, functools.partial(_is_name, name), ev)
    except _Unknown:
        scaled.pop(name, None)
        return
    scaled[name] = scaled.get(name, []) + ops


def _head_input_ops(
    call: ast.Call, scaled: dict[str, list[tuple[str, float]]], ev: _Evaluator
) -> list[tuple[str, float]]:
    """The scaling the head's input carries (from earlier statements, or in the call: `lm_head(h / s)`); anything
    else between the hidden states and the head (another module: ModernBERT's prediction head) cannot be followed."""
    if len(call.args) != 1 or call.keywords:
        raise _Unknown(ast.unparse(call))
    arg = call.args[0]
    name = _base_name(arg)
    if name is not None:
        ops = scaled.get(name, [])
    else:
        inner = next((n for n in ast.walk(arg) if isinstance(n, ast.Name) and n.id != "self"), None)
        if inner is None:
            raise _Unknown(ast.unparse(call))
        ops = scaled.get(inner.id, []) + _ops_of(
            arg, lambda n: isinstance(n, ast.expr) and _base_name(n) == inner.id, ev
        )
    if any(op not in ("mul", "div") for op, _ in ops):
        raise _Unknown(f"a transformed input to the head: {ast.unparse(call)}")
    return ops


def _bind(stmt: ast.stmt, ev: _Evaluator) -> None:
    """Remember a local's value where it can be evaluated (`cap = self.config.logits_soft_cap`), forget it where
    not, so a later factor never reads a stale value."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return
    name = stmt.targets[0].id
    try:
        ev.local[name] = ev(stmt.value)
    except _Unknown:
        ev.local.pop(name, None)
        ev.unknown.add(name)


def _flatten(body: list[ast.stmt], ev: _Evaluator) -> list[ast.stmt]:
    """The statements a training forward runs, in order: an `if` is replaced by the branch its test takes (the
    config's values decide it); an `if` whose test cannot be evaluated stays as one statement."""
    out: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, ast.If):
            try:
                taken = ev(stmt.test)
            except _Unknown:
                out.append(stmt)
                continue
            out += _flatten(stmt.body if taken else stmt.orelse, ev)
        else:
            out.append(stmt)
    return out


def _targets(stmt: ast.Assign) -> list[str]:
    return [t.id for t in stmt.targets if isinstance(t, ast.Name)]


def _assigns(stmt: ast.stmt, name: str) -> bool:
    if isinstance(stmt, ast.AugAssign):
        return isinstance(stmt.target, ast.Name) and stmt.target.id == name
    return isinstance(stmt, ast.Assign) and name in _targets(stmt)


def _is_loss_statement(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Assign)
        and _targets(stmt) == ["loss"]
        and not (isinstance(stmt.value, ast.Constant) and stmt.value.value is None)
    )


def _standard_loss(stmt: ast.stmt, var: str) -> bool:
    """`loss = self.loss_function(logits, labels, ...)` (transformers' causal-LM cross-entropy: fp32, shifted
    labels, mean over the tokens not ignored) or `loss_fct(logits.view(...), labels.view(-1))` with torch's
    CrossEntropyLoss: the cross-entropy the loss heads compute."""
    value = stmt.value  # type: ignore[attr-defined]
    if not isinstance(value, ast.Call):
        return False
    func = ast.unparse(value.func)
    first = value.args[0] if value.args else next((k.value for k in value.keywords if k.arg == "logits"), None)
    return func in ("self.loss_function", "loss_fct") and first is not None and _mentions(first, var)


# ------------------------------------------------------------------------------------------------------------
# The decoder loop.
# ------------------------------------------------------------------------------------------------------------


def layer_output(owner: nn.Module, attr: str) -> LayerOutput | None:
    """How the loop over `owner.<attr>` in `owner`'s forward reads each layer's return, or None when no such loop
    can be read (the caller falls back to what the layer's own source returns)."""
    fn = _parse_forward(type(owner))
    if fn is None:
        return None
    loops = [
        loop
        for loop in ast.walk(fn)
        if isinstance(loop, ast.For)
        and any(
            isinstance(n, ast.Attribute) and n.attr == attr and ast.unparse(n.value) == "self"
            for n in ast.walk(loop.iter)
        )
    ]
    outer = [n for n in ast.walk(fn) if isinstance(n, (ast.For, ast.While))]
    if any(o is not loop and any(n is loop for n in ast.walk(o)) for loop in loops for o in outer):
        return LayerOutput("repeats")  # an outer loop runs (a section of) the layers again: Dory's recurrence
    for loop in loops:
        bound = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
        for stmt in (n for n in ast.walk(loop) if isinstance(n, ast.Assign)):
            call = stmt.value
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in bound:
                return _read_layer_call(loop, stmt, call)
    return None


def _read_layer_call(loop: ast.For, stmt: ast.Assign, call: ast.Call) -> LayerOutput:
    first = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "hidden_states"), None)
    hidden = first.id if isinstance(first, ast.Name) else None
    target = stmt.targets[0] if len(stmt.targets) == 1 else None
    if isinstance(target, ast.Name):
        if target.id == hidden:
            return LayerOutput("tensor")
        name = target.id
        takes_first = any(
            isinstance(n, ast.Assign) and _targets(n) == [hidden] and ast.unparse(n.value) == f"{name}[0]"
            for n in ast.walk(loop)
        )
        return LayerOutput("first") if takes_first else LayerOutput("passes_more")
    if isinstance(target, ast.Tuple) and target.elts and all(isinstance(e, ast.Name) for e in target.elts):
        names = [e.id for e in target.elts]  # type: ignore[attr-defined]
        if names[0] != hidden:
            return LayerOutput("passes_more")
        handed_on = any(_mentions(a, n) for n in names[1:] for a in [*call.args, *(k.value for k in call.keywords)])
        return LayerOutput("passes_more") if handed_on else LayerOutput("first", len(names))
    return LayerOutput("passes_more")


def returns_a_tuple(layer_class: type) -> bool:
    """Does this decoder layer's forward return a tuple literal (`return hidden_states, router_state`)? The fallback
    where no loop can be read: transformers' return annotations say `tuple` for many layers that return a tensor."""
    fn = _parse_forward(layer_class)
    if fn is None:
        return False  # no source to read: the group runner's own check catches a tuple at the first step
    return any(isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) for node in ast.walk(fn))
