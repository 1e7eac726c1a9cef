"""Memory: a compiled program's estimated peak, what is live while it runs, a device's capacity.

`estimate_peak_bytes` reads XLA's buffer assignment (nothing allocated); a `Ledger` adds what
the program's estimate leaves out (pruned yet resident arguments: Adam's moments);
`MemoryModel` predicts the largest size within a capacity. Guide: docs/memory.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np

__all__ = [
    "Executable",
    "FaultHook",
    "Ledger",
    "MemoryModel",
    "compile_measured",
    "compile_side_by_side",
    "device_bytes_in_use",
    "device_capacity",
    "estimate_peak_bytes",
    "learned_capacity",
    "memory_report",
    "others_bytes",
    "predict_line",
    "program_ledger",
    "tree_bytes",
    "usable_capacity",
]


class FaultHook(Protocol):
    """What `jax_adaptive.testing.FaultInjector` implements: called before compiles and runs."""

    def before_compile(self, size: int) -> None:
        """Called before the program for ``size`` compiles."""

    def before_execution(self, size: int, args: Any) -> None:
        """Called before a program of ``size`` runs on ``args``."""


class Executable(NamedTuple):
    """A compiled program with XLA's memory analysis of it and what compiling cost."""

    compiled: Any
    report: dict[str, int]
    seconds: float


def compile_measured(
    lower: Callable[[], Any], fault_hook: FaultHook | None = None, size: int = 0
) -> Executable:
    """Compiles what ``lower()`` lowers, timed, with XLA's memory report (after ``fault_hook``)."""
    start = time.perf_counter()
    if fault_hook is not None:
        fault_hook.before_compile(size)
    compiled = lower().compile()
    return Executable(compiled, memory_report(compiled), time.perf_counter() - start)


def compile_side_by_side(
    lowered: Mapping[int, Any], fault_hook: FaultHook | None = None
) -> dict[int, Future]:
    """Compiles each of ``lowered`` (``{size: Lowered}``) on a thread of its own, all at once.

    XLA compiles without the GIL, so on a host with idle cores a round of sizes costs
    about one compile. Returns when all are done: ``{size: Future}``, each holding an
    `Executable` or the compile's error (an out-of-memory among them), raised by
    ``.result()`` where the caller decides what it means.

    Examples:
        >>> import jax.numpy as jnp
        >>> f = jax.jit(jnp.sin)
        >>> lowered = {n: f.lower(jax.ShapeDtypeStruct((n,), jnp.float32)) for n in (8, 16)}
        >>> done = compile_side_by_side(lowered)
        >>> [done[n].result().report["argument"] for n in (8, 16)]
        [32, 64]
    """
    with ThreadPoolExecutor(
        max(1, len(lowered)), thread_name_prefix="jax_adaptive-compile"
    ) as pool:
        return {
            size: pool.submit(compile_measured, lambda low=low: low, fault_hook, size)
            for size, low in lowered.items()
        }


def memory_report(compiled: Any) -> dict[str, int]:
    """XLA's memory analysis of a compiled program, in bytes (ValueError where there is none).

    The keys: ``argument``, ``output``, ``alias``, ``temp``, ``code`` and, if given, ``peak``.

    Examples:
        >>> import jax.numpy as jnp
        >>> c = jax.jit(jnp.sin).lower(jax.ShapeDtypeStruct((256,), jnp.float32)).compile()
        >>> memory_report(c)["argument"]
        1024
    """
    analysis = compiled.memory_analysis()
    if analysis is None:
        raise ValueError("this backend gives no memory_analysis() for the compiled program.")
    report = {
        "argument": int(analysis.argument_size_in_bytes),
        "output": int(analysis.output_size_in_bytes),
        "alias": int(analysis.alias_size_in_bytes),
        "temp": int(analysis.temp_size_in_bytes),
        "code": int(getattr(analysis, "generated_code_size_in_bytes", 0) or 0),
    }
    peak = getattr(analysis, "peak_memory_in_bytes", None)
    if peak is not None:
        report["peak"] = int(peak)
    return report


def estimate_peak_bytes(compiled: Any) -> int:
    """Estimates the bytes a ``jax.stages.Compiled`` holds at its peak.

    ``argument + output - alias + temp + generated code``, from XLA's memory analysis.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> x = jax.ShapeDtypeStruct((1024,), jnp.float32)
        >>> compiled = jax.jit(lambda a: a * 2, donate_argnums=0).lower(x).compile()
        >>> estimate_peak_bytes(compiled) >= 4096  # the donated output aliases its input
        True
    """
    r = memory_report(compiled)
    return r["argument"] + r["output"] - r["alias"] + r["temp"] + r["code"]


def tree_bytes(tree: Any) -> int:
    """The bytes a pytree of arrays (or ``ShapeDtypeStruct``s) holds on one device.

    A sharded leaf counts one device's shard; a replicated one, its whole size.

    Examples:
        >>> tree_bytes({"w": jax.numpy.zeros((4, 8)), "key": jax.random.key(0)})
        136
    """
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = tuple(np.shape(leaf))
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            shape = tuple(sharding.shard_shape(shape))
        total += math.prod(shape) * leaf.dtype.itemsize  # a PRNG key's dtype has one too
    return total


class Ledger(NamedTuple):
    """What is live on a device while a program runs, in bytes, by part (docs/memory.md).

    ``state`` is everything resident, read or not; ``in_flight`` the calls in flight's inputs
    and new outputs; ``program`` the running program's temporaries and code.

    Examples:
        >>> Ledger(state=1_000, in_flight=200, program=300).total
        1500
    """

    state: int
    in_flight: int
    program: int

    @property
    def total(self) -> int:
        """The peak: the sum of the parts."""
        return self.state + self.in_flight + self.program


def program_ledger(
    report: Mapping[str, int], *, resident: int, inputs: int, in_flight: int = 1
) -> Ledger:
    """The `Ledger` of a program from its `memory_report`.

    ``resident`` bytes are live whatever it reads, each of the ``in_flight`` calls holds
    ``inputs`` bytes, its new outputs and temporaries.

    Examples:
        >>> report = {"argument": 900, "output": 300, "alias": 100, "temp": 50, "code": 7}
        >>> program_ledger(report, resident=1_000, inputs=40, in_flight=2)
        Ledger(state=1000, in_flight=480, program=107)
    """
    new_outputs = report["output"] - report["alias"]
    return Ledger(
        state=resident,
        in_flight=in_flight * (inputs + new_outputs),
        program=in_flight * report["temp"] + report["code"],
    )


def device_capacity(device: jax.Device | None = None) -> int | None:
    """``memory_stats()["bytes_limit"]`` (the first local device's by default); None on a CPU."""
    return _stat(device, "bytes_limit")


def device_bytes_in_use(device: jax.Device | None = None) -> int | None:
    """``memory_stats()["bytes_in_use"]``: every live array of this process; None on a CPU."""
    return _stat(device, "bytes_in_use")


def usable_capacity(
    memory_limit: int | None, device: jax.Device | None, headroom: float, others: int = 0
) -> int | None:
    """The bytes a ledger may reach, or None where nothing says (a CPU, no limit).

    The smaller of ``memory_limit`` (exact: no headroom) and the device's capacity less
    the ``headroom`` fraction less ``others`` (other arrays' bytes at planning).

    Examples:
        >>> usable_capacity(10**6, jax.devices("cpu")[0], headroom=0.1)
        1000000
        >>> usable_capacity(None, jax.devices("cpu")[0], headroom=0.1) is None
        True
    """
    caps = [] if memory_limit is None else [memory_limit]
    device_bytes = device_capacity(device)
    if device_bytes is not None:
        caps.append(int(device_bytes * (1.0 - headroom)) - others)
    return min(caps) if caps else None


def others_bytes(device: jax.Device | None, own: int) -> int:
    """Bytes live on the device that are not ``own`` (another job's, say); 0 where unknown.

    Examples:
        >>> others_bytes(jax.devices("cpu")[0], own=1_000)  # a CPU says nothing
        0
    """
    in_use = device_bytes_in_use(device)
    return 0 if in_use is None else max(0, in_use - own)


def learned_capacity(
    peak: int, headroom: float, first: bool, known: int | None = None, floor: int = 0
) -> int:
    """The capacity a real out-of-memory at a ledger of ``peak`` bytes teaches.

    ``headroom`` below the peak on the ``first`` failure in a row, else halfway from
    ``floor`` (no size goes below it) to the peak; never above ``known``, learned before.

    Examples:
        >>> learned_capacity(1000, 0.1, first=True)
        900
        >>> learned_capacity(1000, 0.1, first=False, known=800, floor=400)
        700
    """
    if first:
        cap = min(int(peak * (1.0 - headroom)), peak - 1)
    else:
        floor = min(floor, peak)
        cap = floor + (peak - floor) // 2
    return cap if known is None else min(cap, known)


def _stat(device: jax.Device | None, name: str) -> int | None:
    try:
        stats = (device or jax.local_devices()[0]).memory_stats()
    except (NotImplementedError, RuntimeError):
        return None
    return int(stats[name]) if stats and name in stats else None


class MemoryModel:
    """Predicts the largest size within a capacity from measured ``points``, ``{size: peak}``.

    The secant through the largest size that fits and the smallest that does not (from one
    side, its two nearest; from one point, through the origin), corrected by a parabola
    through a third where it stays in that bracket. Below two points a ``prior``
    ``(intercept, slope > 0)`` line stands in.

    Examples:
        >>> model = MemoryModel({64: 1_000 + 64 * 50, 256: 1_000 + 256 * 50})
        >>> model.largest_within(10_000)  # 1_000 + 180 * 50 == 10_000
        180
        >>> model.propose(10_000)(180, None)  # 180 is known to fit: check its neighbour
        181
    """

    def __init__(
        self, points: Mapping[int, int] | None = None, prior: tuple[float, float] | None = None
    ):
        self.points: dict[int, int] = dict(points or {})
        if prior is not None and not prior[1] > 0:
            raise ValueError(f"the prior's slope must be positive, got {prior}.")
        self.prior = prior

    def add(self, size: int, nbytes: int) -> None:
        """Records a measured peak."""
        self.points[int(size)] = int(nbytes)

    def largest_within(self, capacity: int) -> int | None:
        """The largest size (at least 0) predicted within ``capacity`` bytes, or None."""
        if self.prior is not None and len(self.points) < 2:
            intercept, slope = self.prior
            if self.points:  # through the measurement, with the prior's slope
                ((size, nbytes),) = self.points.items()
                intercept = nbytes - slope * size
            return max(0, int((capacity - intercept) / slope))
        if not self.points:
            return None
        below = sorted(s for s, b in self.points.items() if b <= capacity)
        above = sorted(s for s, b in self.points.items() if b > capacity)
        if below and above:
            pair = [below[-1], above[0]]
        elif len(self.points) >= 2:
            pair = below[-2:] if below else above[:2]
        else:
            pair = [0, *self.points]
        secant = self._root(pair, capacity)
        # A parabola through a third measurement follows a curving peak, inside the bracket.
        rest = sorted(set(self.points) - set(pair), key=lambda s: abs(self.points[s] - capacity))
        if secant is None or not rest or 0 in pair:
            return None if secant is None else max(0, int(secant))
        curve = self._root(sorted([*pair, rest[0]]), capacity)
        lo, hi = (below[-1], above[0]) if below and above else (0, math.inf)
        best = curve if curve is not None and lo <= curve <= hi else secant
        return max(0, int(best))

    def _root(self, sizes: list[int], capacity: int) -> float | None:
        """Where the polynomial through ``sizes``' points (2 or 3) meets ``capacity``."""
        if len(sizes) == 2:
            (s0, s1), (b0, b1) = sizes, [self.points.get(s, 0) for s in sizes]
            slope = (b1 - b0) / (s1 - s0)
            return None if slope <= 0 else s0 + (capacity - b0) / slope
        # The parabola in plain floats, not numpy's polyfit: this runs right after a real
        # out-of-memory, where a BLAS buffer allocation can abort the process.
        (x0, x1, x2), (y0, y1, y2) = sizes, [self.points.get(s, 0) - capacity for s in sizes]
        d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
        a = (d12 - d01) / (x2 - x0)
        b = d01 - a * (x0 + x1)
        c = y0 - a * x0 * x0 - b * x0
        if a == 0:
            roots = [] if b == 0 else [-c / b]
        else:
            disc = b * b - 4 * a * c
            if disc < 0:
                return None
            q = -(b + math.copysign(math.sqrt(disc), b)) / 2  # the stable quadratic formula
            roots = [q / a] + ([c / q] if q != 0 else [])
        # The root where the parabola rises, nearest the measurements.
        rising = [r for r in roots if 2 * a * r + b > 0]
        if not rising:
            return None
        mean = (x0 + x1 + x2) / 3
        return min(rising, key=lambda r: abs(r - mean))

    def propose(self, capacity: int) -> Callable[[int | None, int | None], int | None]:
        """A ``propose(good, bad)`` for `search_max_size`: a guess strictly inside the bracket."""

        def propose(good: int | None, bad: int | None) -> int | None:
            guess = self.largest_within(capacity)
            if guess is None:
                return None
            guess = max(guess, (good or 0) + 1)
            return guess if bad is None else min(guess, bad - 1)

        return propose


def predict_line(
    points: Mapping[tuple[int, int], int], length: int, capacity: int
) -> tuple[float, float] | None:
    """A new bucket's predicted ``(intercept, slope)`` of peak bytes against micro-batch size.

    Least squares over ``points``, ``{(length, size): estimated bytes}`` of the buckets seen
    (a length is a bucket's positions, ``H * W`` for an image), those near ``capacity``
    (XLA's peak is least linear at tiny sizes), of ``a + m L`` from one bucket and of
    ``a + b L + m (c L + d L^2)`` from two on; None without points or when the line does not rise.

    Examples:
        >>> peak = lambda L, m: 1_000 + 10 * L + m * (3 * L + L * L)
        >>> seen = {(L, m): peak(L, m) for L in (16, 32) for m in (2, 5, 9)}
        >>> [round(x) for x in predict_line(seen, 64, capacity=1)]  # a + bL, cL + dL^2
        [1640, 4288]
    """
    if not points:
        return None
    lengths = {L for L, _ in points}
    near = [k for k, v in points.items() if v >= capacity / 4]
    keys = near if {L for L, _ in near} == lengths else list(points)
    one_bucket = len(lengths) == 1

    def features(L: int, m: int) -> list[float]:
        return [1.0, m * L] if one_bucket else [1.0, L, m * L, m * L * L]

    a = np.array([features(L, m) for L, m in keys], np.float64)
    b = np.array([points[k] for k in keys], np.float64)
    scale = np.abs(a).max(axis=0)
    coeffs = np.linalg.lstsq(a / scale, b, rcond=None)[0] / scale
    intercept = float(np.dot(features(length, 0), coeffs))
    slope = float(np.dot(features(length, 1), coeffs)) - intercept
    return (intercept, slope) if slope > 0 else None
