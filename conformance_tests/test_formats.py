"""Formats: the engine's dequantization of every computable tensor type equals the `gguf` package's.

For each type the gguf package can quantize (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4) random
data is quantized with gguf.quants.quantize
and dequantized both by gguf.quants.dequantize (the reference, numpy) and by the engine's scalar
reference code (colibri_dequantize, through colibri_backend._native.dequantize). Raw random bytes
are compared too, so every bit pattern of a scale (subnormal, inf, NaN halves) is covered, and for
F16/BF16 all 65536 bit patterns are checked.

The K-quants, IQ4_NL and IQ4_XS, which the gguf package can only dequantize, are compared on raw random
blocks (every scale and quant bit pattern) and on blocks built to hit the extremes: all nibble values, the
largest and smallest 6-bit scales and minimums, signed-zero and subnormal super-block scales. MXFP4's E8M0
exponent runs over all 256 values. Q8_K (activations in llama.cpp, no dequantization in the gguf package)
is checked against `q8_k_reference` below, written here from the format description.

Tolerance: none. Every output must be the same float32, bit for bit. The one allowance concerns NaN
*payloads*: a NaN must come out as a NaN of the same sign with the same payload, but the quiet bit
may be set by one side and not the other (x86 F16C conversion, which numpy may use, quiets
signalling NaNs; the engine keeps them). No model weight is a NaN, so this never affects results.
For the formats with a minimum (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) an element is scale * q + minimum: when
both terms are NaNs, IEEE 754 leaves open which payload the sum carries, and numpy's own loops pick either
depending on the array's alignment, so there only "NaN here too" is checked.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from colibri_backend import _native
from colibri_backend.errors import ColibriError

COMPUTABLE = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4]
# dequantization only in the gguf package: compared on raw and constructed blocks
DEQUANT_ONLY = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]
BLOCKED = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4, *DEQUANT_ONLY]
# Element counts: a single block, odd numbers of blocks, a large row. For the float types
# (block size 1) odd counts that are not multiples of anything.
BLOCK_COUNTS = [1, 3, 7, 33, 1001]
FLOAT_COUNTS = [1, 3, 17, 255, 4099]


def engine_dequantize(qtype: T, raw: np.ndarray, n_elements: int) -> np.ndarray:
    return _native.dequantize(int(qtype), np.ascontiguousarray(raw).view(np.uint8), n_elements)


def reference_dequantize(qtype: T, raw: np.ndarray) -> np.ndarray:
    """gguf.quants.dequantize on the raw bytes, as a flat float32 array."""
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if qtype in (T.F32, T.F16):
        out = quants.dequantize(raw, qtype)
    else:
        block_bytes = quants.GGML_QUANT_SIZES[qtype][1]
        out = quants.dequantize(raw.reshape(-1, block_bytes), qtype)
    return np.asarray(out, dtype=np.float32).reshape(-1)


WITH_MIN = {T.Q4_1, T.Q5_1, T.Q2_K, T.Q4_K, T.Q5_K}


def assert_same_floats(ours: np.ndarray, ref: np.ndarray, what: str, any_nan_payload: bool = False) -> None:
    assert ours.dtype == np.float32 and ref.dtype == np.float32
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} != {ref.shape}"
    a = ours.view(np.uint32)
    b = ref.view(np.uint32)
    nan_a, nan_b = np.isnan(ours), np.isnan(ref)
    mismatch_nan = nan_a != nan_b
    assert not mismatch_nan.any(), (
        f"{what}: NaN at different places, first at {int(np.argmax(mismatch_nan))}: "
        f"ours {ours[mismatch_nan][0]!r}, reference {ref[mismatch_nan][0]!r}"
    )
    quiet = np.uint32(0x00400000)
    # NaNs: same sign and payload; the quiet bit may differ (see the module docstring)
    diff = np.where(nan_a, (a | quiet) != (b | quiet), a != b)
    if any_nan_payload:
        diff &= ~nan_a
    if diff.any():
        i = int(np.argmax(diff))
        raise AssertionError(
            f"{what}: {int(diff.sum())} of {diff.size} values differ; first at {i}: "
            f"ours {ours[i]!r} (0x{int(a[i]):08x}), reference {ref[i]!r} (0x{int(b[i]):08x})"
        )


def sample_data(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    if kind == "normal":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "weights":  # typical trained-weight scale
        return (rng.standard_normal(n) * 0.02).astype(np.float32)
    if kind == "wide":  # magnitudes from 1e-8 to 1e4 with random signs: f16 subnormals and rounding
        mag = 10.0 ** rng.uniform(-8, 4, n)
        return (mag * rng.choice([-1.0, 1.0], n)).astype(np.float32)
    if kind == "sparse":  # mostly zeros, and constant blocks (scale 0, min = max)
        x = np.zeros(n, dtype=np.float32)
        idx = rng.choice(n, size=max(1, n // 10), replace=False)
        x[idx] = rng.standard_normal(idx.size).astype(np.float32)
        return x
    if kind == "positive":  # Q4_1's minimum is positive
        return rng.uniform(0.5, 3.0, n).astype(np.float32)
    raise ValueError(kind)


KINDS = ["normal", "weights", "wide", "sparse", "positive"]


@pytest.mark.parametrize("qtype", COMPUTABLE, ids=lambda t: t.name)
@pytest.mark.parametrize("kind", KINDS)
def test_quantized_random_data(qtype: T, kind: str) -> None:
    rng = np.random.default_rng([int(qtype), KINDS.index(kind)])
    block = quants.GGML_QUANT_SIZES[qtype][0]
    counts = BLOCK_COUNTS if block > 1 else FLOAT_COUNTS
    for count in counts:
        n = count * block
        x = sample_data(rng, n, kind)
        with np.errstate(all="ignore"):
            q = quants.quantize(x.reshape(1, n), qtype)
        raw = np.ascontiguousarray(q).view(np.uint8).reshape(-1)
        assert raw.size == n // block * quants.GGML_QUANT_SIZES[qtype][1]
        with np.errstate(all="ignore"):
            ref = reference_dequantize(qtype, raw)
        ours = engine_dequantize(qtype, raw, n)
        assert_same_floats(ours, ref, f"{qtype.name} {kind} n={n}")
        if qtype == T.F32:
            assert_same_floats(ours, x, "F32 round trip")


@pytest.mark.parametrize("qtype", BLOCKED, ids=lambda t: t.name)
def test_raw_random_blocks(qtype: T) -> None:
    """Arbitrary bytes: scales and minimums take every kind of half value, including
    subnormals, infinities and NaNs; quants take every nibble/byte value."""
    rng = np.random.default_rng(1000 + int(qtype))
    block, block_bytes = quants.GGML_QUANT_SIZES[qtype]
    n_blocks = 20000
    raw = rng.integers(0, 256, size=n_blocks * block_bytes, dtype=np.uint8)
    with np.errstate(all="ignore"):
        ref = reference_dequantize(qtype, raw)
    ours = engine_dequantize(qtype, raw, n_blocks * block)
    assert_same_floats(ours, ref, f"{qtype.name} raw bytes", qtype in WITH_MIN)


@pytest.mark.parametrize("qtype", [T.F16, T.BF16], ids=lambda t: t.name)
def test_every_half_bit_pattern(qtype: T) -> None:
    """All 65536 patterns: zeros, subnormals, normals, +-inf, signalling and quiet NaNs."""
    bits = np.arange(65536, dtype=np.uint16)
    ref = reference_dequantize(qtype, bits)
    ours = engine_dequantize(qtype, bits, bits.size)
    assert_same_floats(ours, ref, f"{qtype.name} all bit patterns")
    # and against the definition, independently of both implementations
    if qtype == T.BF16:
        expect = (bits.astype(np.uint32) << 16).view(np.float32)
    else:
        s = np.where(bits >> 15, -1.0, 1.0)
        e = ((bits >> 10) & 31).astype(np.int64)
        m = (bits & 1023).astype(np.float64)
        with np.errstate(all="ignore"):
            val = np.where(e == 0, np.ldexp(m, -24), np.ldexp(1.0 + m / 1024.0, e - 15))
            val = np.where(e == 31, np.where(m == 0, np.inf, np.nan), val)
        expect = (s * val).astype(np.float32)
    finite = np.isfinite(expect)
    assert np.array_equal(ours[finite], expect[finite])
    assert np.array_equal(np.signbit(ours[finite]), np.signbit(expect[finite]))  # signed zeros
    assert np.array_equal(np.isnan(ours), np.isnan(expect))
    assert np.array_equal(np.isinf(ours), np.isinf(expect))


def test_special_values_through_quantize() -> None:
    """F16/BF16 quantization of values around the half/bfloat limits, then dequantization."""
    specials = np.array(
        [
            0.0,
            -0.0,
            1.0,
            -1.0,
            65504.0,
            65519.0,
            65520.0,
            -70000.0,
            6.1e-5,
            6.0e-8,
            2.98e-8,
            1e-45,
            3.4e38,
            np.inf,
            -np.inf,
            np.nan,
            1.0 / 3.0,
            -2.5e-6,
            1e-40,
        ],
        dtype=np.float32,
    )
    for qtype in (T.F16, T.BF16):
        with np.errstate(all="ignore"):
            q = quants.quantize(specials, qtype)
        raw = np.ascontiguousarray(q).view(np.uint8)
        with np.errstate(all="ignore"):
            ref = reference_dequantize(qtype, raw)
        assert_same_floats(engine_dequantize(qtype, raw, specials.size), ref, f"{qtype.name} specials")


def test_argument_errors() -> None:
    raw = np.zeros(34, dtype=np.uint8)
    with pytest.raises(ColibriError):
        _native.dequantize(int(T.Q8_0), raw, 16)  # not a multiple of the block size
    with pytest.raises(ColibriError):
        _native.dequantize(int(T.Q8_0), raw[:33], 32)  # too few bytes
    with pytest.raises(ColibriError):
        _native.dequantize(4, raw, 32)  # removed type id
    with pytest.raises(ColibriError, match="IQ2_XXS"):
        _native.dequantize(int(T.IQ2_XXS), np.zeros(66, dtype=np.uint8), 256)  # known, not computable
    with pytest.raises(ColibriError):
        _native.dequantize(int(T.Q4_K), np.zeros(144, dtype=np.uint8), 128)  # half a super-block


def _halves(values: list[float]) -> np.ndarray:
    return np.array(values, dtype=np.float16).view(np.uint8).reshape(-1, 2)


# super-block scales at the edges of fp16: zeros of both signs, the smallest subnormal, the largest
# finite half, a normal value, and +-inf
EDGE_SCALES = _halves([0.0, -0.0, 2.0**-24, 65504.0, -1.5e-3, 0.03125, np.inf, -np.inf])


@pytest.mark.parametrize("qtype", DEQUANT_ONLY + [T.Q5_0, T.Q5_1], ids=lambda t: t.name)
def test_extreme_blocks(qtype: T) -> None:
    """Constructed blocks: every quant byte pattern (so every nibble, 2-bit and 6-bit value and every
    high bit) combined with every byte value in the scale fields and the edge fp16 scales."""
    rng = np.random.default_rng(2000 + int(qtype))
    block, block_bytes = quants.GGML_QUANT_SIZES[qtype]
    n_blocks = 256 * len(EDGE_SCALES)
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    # byte k of every block takes the value (block index + k) % 256: all values in every position
    raw[:] = (np.arange(n_blocks)[:, None] + np.arange(block_bytes)[None, :]) % 256
    # fp16 fields (d and, where present, dmin / m) cycle through the edge values
    half_at = {
        T.Q2_K: [80, 82],
        T.Q3_K: [108],
        T.Q4_K: [0, 2],
        T.Q5_K: [0, 2],
        T.Q6_K: [208],
        T.IQ4_NL: [0],
        T.IQ4_XS: [0],
        T.Q5_0: [0],
        T.Q5_1: [0, 2],
    }[qtype]
    for k, off in enumerate(half_at):
        raw[:, off : off + 2] = EDGE_SCALES[(np.arange(n_blocks) // 256 + k) % len(EDGE_SCALES)]
    with np.errstate(all="ignore"):
        ref = reference_dequantize(qtype, raw)
    ours = engine_dequantize(qtype, raw.reshape(-1), n_blocks * block)
    assert_same_floats(ours, ref, f"{qtype.name} constructed blocks", qtype in WITH_MIN)


def test_mxfp4_every_exponent() -> None:
    """All 256 E8M0 exponents (0 and 1 give subnormal scales, 254 and 255 overflow the largest
    levels to inf) with all 16 levels in both nibbles."""
    e = np.arange(256, dtype=np.uint8)
    qs = (np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)).astype(np.uint8)
    raw = np.concatenate([e[:, None], np.tile(qs, (256, 1))], axis=1)
    with np.errstate(all="ignore"):
        ref = reference_dequantize(T.MXFP4, raw)
    ours = engine_dequantize(T.MXFP4, raw.reshape(-1), 256 * 32)
    assert_same_floats(ours, ref, "MXFP4 exponents")
    # and against the definition: 2^(e - 127) times the E2M1 value (stored doubled)
    levels = np.array(quants.MXFP4.kvalues, dtype=np.float64) / 2
    idx = np.concatenate([np.arange(16), np.arange(16)[::-1]])
    with np.errstate(all="ignore"):
        expect = (np.ldexp(1.0, e.astype(np.int64) - 127)[:, None] * levels[idx][None, :]).astype(np.float32)
    assert_same_floats(ours, expect.reshape(-1), "MXFP4 definition")


def q8_k_reference(raw: np.ndarray) -> np.ndarray:
    """Q8_K from its layout: float32 d, 256 int8 quants, 16 int16 sums of 16 quants; x = d * q."""
    blocks = raw.reshape(-1, 292)
    d = np.ascontiguousarray(blocks[:, :4]).view(np.float32)
    q = np.ascontiguousarray(blocks[:, 4:260]).view(np.int8).astype(np.float32)
    return (d * q).reshape(-1)


def test_q8_k() -> None:
    rng = np.random.default_rng(3000)
    n_blocks = 500
    raw = rng.integers(0, 256, size=(n_blocks, 292), dtype=np.uint8)
    d = (rng.standard_normal(n_blocks) * 1e-2).astype(np.float32)
    d[:4] = [0.0, -0.0, np.float32(1e-45), np.float32(3.4e38)]
    raw[:, :4] = d.view(np.uint8).reshape(-1, 4)
    ours = engine_dequantize(T.Q8_K, raw.reshape(-1), n_blocks * 256)
    with np.errstate(all="ignore"):
        assert_same_floats(ours, q8_k_reference(raw), "Q8_K")
