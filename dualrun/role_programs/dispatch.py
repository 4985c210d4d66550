"""Dispatch and collect rules as open tables (pure logic: no Ray, no torch).

A *dispatch* rule turns one driver call into the arguments of each of `n` workers:
`rule(n, i, *args, **kwargs) -> (args, kwargs)`. A *collect* rule turns the list of per-worker
results into what the driver call returns. Both tables are plain dicts filled by `register_dispatch`
/ `register_collect`, so a project can add its own rules by name instead of growing an if-chain.

Slice semantics (documented in docs/roles.md): every *sliceable* argument (list, tuple, range, or
anything with `__len__`, `__getitem__(slice)` and `shape`, such as numpy arrays and torch tensors;
never str/bytes/dict) is cut into `n` contiguous shares whose sizes differ by at most one, the
first `len % n` shares being one longer (numpy's `array_split`). When an argument is shorter than
`n`, the trailing workers get an empty share (and are still called). Other arguments are copied.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

DispatchFn = Callable[..., tuple[tuple, dict]]
CollectFn = Callable[[list], Any]

DISPATCH: dict[str, DispatchFn] = {}
COLLECT: dict[str, CollectFn] = {}
EXECUTE = ("all", "first")


def _register(table: dict[str, Any], name: str) -> Callable[[Any], Any]:
    def deco(fn: Any) -> Any:
        table[name] = fn
        return fn

    return deco


def register_dispatch(name: str) -> Callable[[DispatchFn], DispatchFn]:
    """Add a named dispatch rule: `@register_dispatch('my_rule') def rule(n, i, *args, **kwargs)`."""
    return _register(DISPATCH, name)


def register_collect(name: str) -> Callable[[CollectFn], CollectFn]:
    """Add a named collect rule: `@register_collect('my_rule') def rule(results: list)`."""
    return _register(COLLECT, name)


def _resolve(kind: str, table: dict[str, Any], rule: Any, callable_shape: str) -> Any:
    if callable(rule):
        return rule
    try:
        return table[rule]
    except KeyError:
        raise ValueError(f"{kind}={rule!r}: expected one of {sorted(table)} or a callable {callable_shape}") from None


def resolve_dispatch(rule: str | DispatchFn) -> DispatchFn:
    return _resolve("dispatch", DISPATCH, rule, "(n, i, *args, **kwargs) -> (args, kwargs)")


def resolve_collect(rule: str | CollectFn) -> CollectFn:
    return _resolve("collect", COLLECT, rule, "over the list of per-worker results")


def check_execute(execute: str) -> str:
    if execute not in EXECUTE:
        raise ValueError(f"execute={execute!r}: expected one of {list(EXECUTE)}")
    return execute


# -- slicing -------------------------------------------------------------------------------------------
def sliceable(x: Any) -> bool:
    """Lists, tuples, ranges and array-likes (numpy arrays, torch tensors) are cut; everything else is copied."""
    if isinstance(x, (list, tuple, range)):
        return True
    if isinstance(x, (str, bytes, bytearray, dict)):
        return False
    return hasattr(x, "__len__") and hasattr(x, "__getitem__") and hasattr(x, "shape") and len(x.shape) > 0


def bounds(length: int, n: int, i: int) -> tuple[int, int]:
    """[start, stop) of share `i` of `n` over `length` items: contiguous, sizes differ by at most one."""
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"share {i} of {n}: expected 0 <= i < n and n >= 1")
    base, extra = divmod(length, n)
    start = i * base + min(i, extra)
    return start, start + base + (1 if i < extra else 0)


def share(x: Any, n: int, i: int) -> Any:
    """Worker `i`'s contiguous share of `x` (same type for list/tuple; a view for arrays)."""
    start, stop = bounds(len(x), n, i)
    return x[start:stop]


@register_dispatch("all")
def dispatch_all(n: int, i: int, /, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """Every worker gets the same arguments."""
    return args, kwargs


@register_dispatch("slice")
def dispatch_slice(n: int, i: int, /, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """Sliceable arguments cut into contiguous shares, one per worker; the rest copied."""
    cut = lambda v: share(v, n, i) if sliceable(v) else v  # noqa: E731
    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def plan_calls(n: int, execute: str, dispatch: str | DispatchFn, args: Sequence[Any],
               kwargs: dict[str, Any]) -> list[tuple[int, tuple, dict]]:
    """(rank, args, kwargs) for every worker that runs: all `n` ranks, or rank 0 alone (dispatch ignored)."""
    if check_execute(execute) == "first":
        return [(0, tuple(args), dict(kwargs))]
    rule = resolve_dispatch(dispatch)
    out = []
    for i in range(n):
        a, k = rule(n, i, *args, **kwargs)
        out.append((i, tuple(a), dict(k)))
    return out


# -- collecting ----------------------------------------------------------------------------------------
@register_collect("none")
def collect_none(results: list) -> list:
    """The list of per-worker results, in rank order."""
    return list(results)


def concat(parts: Sequence[Any]) -> Any:
    """Concatenate same-kind parts: lists/tuples/ranges, dicts key-wise, numpy arrays, torch tensors."""
    if not parts:
        return []
    first = parts[0]
    if isinstance(first, dict):
        return {k: concat([p[k] for p in parts]) for k in first}
    kind = type(first).__module__.split(".")[0]
    if kind == "numpy" and hasattr(first, "shape"):
        import numpy

        return numpy.concatenate(parts)
    if kind == "torch" and hasattr(first, "shape"):
        import torch

        return torch.cat(list(parts))
    out: list = []
    for p in parts:
        out.extend(p)
    return out


@register_collect("flatten")
def collect_flatten(results: list) -> Any:
    """Concatenate per-worker lists; tuples are concatenated element-wise (a tuple of lists); None dropped."""
    results = [r for r in results if r is not None]
    if results and all(isinstance(r, tuple) for r in results):
        width = len(results[0])
        if any(len(r) != width for r in results):
            raise ValueError("collect='flatten': workers returned tuples of different lengths")
        return tuple(concat([r[j] for r in results]) for j in range(width))
    return concat(results)


@register_collect("first")
def collect_first(results: list) -> Any:
    """Rank 0's result alone (what execute='first' callers usually want)."""
    return results[0] if results else None
