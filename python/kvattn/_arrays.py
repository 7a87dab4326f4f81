"""Array helpers shared by the package: output allocation in the caller's array kind, and the
bf16 / fp8 bit conversions NumPy lacks (NumPy has no bf16 or fp8: kvattn takes uint16 arrays as
bf16 bits and uint8 arrays as fp8 bits wherever the storage dtype is known), and the views that
let ml_dtypes arrays (bfloat16, float8_e4m3fn, float8_e5m2) cross although NumPy cannot export
them by DLPack."""

from __future__ import annotations

import numpy as np


# ml_dtypes' NumPy dtypes: their kvattn name and the unsigned type of the same width.
_ML_DTYPES = {
    "bfloat16": ("bf16", np.uint16),
    "float8_e4m3fn": ("fp8_e4m3", np.uint8),
    "float8_e5m2": ("fp8_e5m2", np.uint8),
}


def _invalid(argument: str, message: str):
    from . import _kvattn  # the exception types live in the native module

    error = _kvattn.InvalidArgumentError(f"kvattn: {argument}: {message}")
    error.argument = argument
    return error


def as_bits_if_ml_dtype(array, expected: "str | None", argument: str):
    """A NumPy array of an ml_dtypes type (which NumPy cannot export by DLPack) as a view of its
    raw bits, which kvattn reads as `expected` (the storage or q dtype name); anything else is
    returned as it is. A mismatch of the ml_dtypes type and `expected` raises ValueError."""
    if type(array) is not np.ndarray or array.dtype.kind != "V":
        return array
    entry = _ML_DTYPES.get(array.dtype.name)
    if entry is None:
        return array
    name, bits = entry
    if expected is not None and name != expected:
        raise _invalid(argument, f"dtype {array.dtype.name} ({name}) does not match the "
                                 f"expected {expected}")
    return array.view(bits)


def empty_output(q, rows: int, width: int):
    """An uninitialised ``[rows, width]`` array like ``q``: same kind, dtype and device."""
    new_empty = getattr(q, "new_empty", None)
    if new_empty is not None:  # torch
        return new_empty((rows, width))
    if isinstance(q, np.ndarray):
        return np.empty((rows, width), dtype=q.dtype)
    raise TypeError(
        f"kvattn: cannot allocate an output like {type(q).__name__}; pass out= explicitly")


def bf16_bits(values) -> np.ndarray:
    """float values -> bf16 bits (uint16), rounded to nearest even, as kvattn rounds."""
    f = np.ascontiguousarray(values, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    is_nan = np.isnan(f)
    if is_nan.any():
        rounded[is_nan] = ((u[is_nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def bf16_to_float(bits) -> np.ndarray:
    """bf16 bits (uint16) -> float32 (exact)."""
    b = np.ascontiguousarray(bits, dtype=np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)


def _fp8_table(exponent_bits: int, mantissa_bits: int, finite_only: bool) -> np.ndarray:
    bias = (1 << (exponent_bits - 1)) - 1
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = codes & ((1 << mantissa_bits) - 1)
    scale = float(1 << mantissa_bits)
    normal = (1.0 + mantissa / scale) * np.exp2(exponent - bias)
    subnormal = (mantissa / scale) * np.exp2(1 - bias)
    value = sign * np.where(exponent == 0, subnormal, normal)
    max_exponent = (1 << exponent_bits) - 1
    if finite_only:  # e4m3fn: only S.1111.111 is NaN
        value[(exponent == max_exponent) & (mantissa == (1 << mantissa_bits) - 1)] = np.nan
    else:  # e5m2: IEEE-like inf and NaN
        top = exponent == max_exponent
        value[top & (mantissa == 0)] = sign[top & (mantissa == 0)] * np.inf
        value[top & (mantissa != 0)] = np.nan
    return value


_FP8_TABLES = {
    "fp8_e4m3": _fp8_table(4, 3, finite_only=True),
    "fp8_e5m2": _fp8_table(5, 2, finite_only=False),
}


def fp8_to_float(bits, kind: str = "fp8_e4m3") -> np.ndarray:
    """fp8 bits (uint8) -> float64 (exact); kind is 'fp8_e4m3' (the fn variant) or 'fp8_e5m2'."""
    return _FP8_TABLES[kind][np.asarray(bits, dtype=np.uint8)]
