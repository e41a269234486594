"""Figures in units a person reads: the one place plans, errors and the CLI
choose between µs/ms/s, B/KiB/MiB/GiB and MFLOP/s/GFLOP/s/TFLOP/s, so a small
model never prints "0.00"."""
from __future__ import annotations

_BYTES = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_RATES = (("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6), ("kFLOP/s", 1e3))


def byte_unit(n: float) -> tuple[str, float]:
    """The unit to write ``n`` bytes in, and its size in bytes."""
    for unit, scale in _BYTES:
        if abs(n) >= scale:
            return unit, scale
    return "B", 1


def human_bytes(n: float, unit: tuple[str, float] | None = None) -> str:
    """``n`` bytes as ``"1.23 GiB"`` (3 significant digits; whole bytes below
    1 KiB); ``unit`` (from :func:`byte_unit`) writes it in a given unit."""
    name, scale = unit or byte_unit(n)
    if name == "B":
        return f"{int(round(n))} B"
    return f"{_digits(n / scale)} {name}"


def human_time(seconds: float) -> str:
    """``"12.3 ms"``, ``"45.6 µs"``, ``"1.23 s"`` (3 significant digits)."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{_digits(seconds / scale)} {unit}"
    return "0 s" if seconds == 0 else f"{_digits(seconds / 1e-9)} ns"


def human_rate(flops_per_s: float) -> str:
    """A FLOP rate as ``"123 TFLOP/s"``, ``"4.56 GFLOP/s"``, ..."""
    for unit, scale in _RATES:
        if abs(flops_per_s) >= scale:
            return f"{_digits(flops_per_s / scale)} {unit}"
    return f"{_digits(flops_per_s)} FLOP/s"


def _digits(x: float) -> str:
    """Three significant digits without an exponent (0.0123, 1.23, 12.3, 123, 1234)."""
    if x == 0:
        return "0"
    a = abs(x)
    decimals = 2 if a < 10 else 1 if a < 100 else 0
    if a < 1:
        decimals = 3 if a >= 0.1 else 4
    return f"{x:.{decimals}f}"
