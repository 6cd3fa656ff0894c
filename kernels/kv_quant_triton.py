"""The Triton side of FP8 K/V caches (kernels/kv_quant.py): rounding fp32 values to an fp8 cache's format.

Why integer arithmetic and not ``x.to(tl.float8e4nv)``: Triton's interpreter (3.9, the CPU tests) rounds fp32 to
fp8 wrongly (a rounding carry into the exponent is lost: 7.9 becomes 4.0), so the native conversion could not be
tested on the CPU. ``to_fp8`` rounds by integer operations on the fp32 bits, which the interpreter and the GPU
execute alike, bit-exact with torch's cast after a clamp (``kv_quant.quantize_ref``). It costs a few integer
operations an element in the writes only (write_kv and the decode kernel's fused write); attention reads fp8 with
``from_kv`` (exact for every finite value, on the GPU and in the interpreter).

fp8 tensors are passed to the kernels as they are (the interpreter loads and stores them; on a GPU e4m3fn needs
sm_89+ for its conversions, e5m2 does not).
"""

import triton
import triton.language as tl

__all__ = ["from_kv", "to_fp8"]


@triton.jit
def _fp8_bits(x, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr):
    """fp32 ``x`` -> the int32 encoding (0..255) of an fp8 format with MANT mantissa bits, exponent bias BIAS and
    largest finite value whose fp32 bits are MAX_BITS: round to nearest even, saturate (inf too), NaN -> 0x7F."""
    u = x.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80  # bit 31 -> bit 7
    a = u & 0x7FFFFFFF  # |x|'s bits: ordered like |x|
    is_nan = a > 0x7F800000
    a = tl.minimum(a, MAX_BITS)  # saturate: |x| <= max rounds to at most max (max is representable)
    exp = a >> 23  # fp32 biased exponent
    # Normal results: drop 23 - MANT mantissa bits, ties to even; a carry runs into the exponent, as it should.
    SHIFT: tl.constexpr = 23 - MANT
    normal = ((a + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MANT)
    # Subnormal results (|x| < 2^(1 - BIAS)): |x| in units of 2^(1 - BIAS - MANT), ties to even. The count may
    # reach 1 << MANT, which is the smallest normal's encoding. sh >= SHIFT + 1 here; capped so that tiny or zero
    # inputs shift their 24-bit mantissa out (to 0) without an undefined shift.
    mant = (a & 0x7FFFFF) | 0x800000
    sh = tl.minimum(tl.maximum(151 - BIAS - MANT - exp, 1), 30)
    q = mant >> sh
    rem = mant & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    bits = tl.where(exp >= 128 - BIAS, normal, q)
    return tl.where(is_nan, 0x7F, bits) | sign


@triton.jit
def to_fp8(x, FP8: tl.constexpr):
    """fp32 ``x`` rounded to FP8 (``tl.float8e4nv`` or ``tl.float8e5``, a cache pointer's element type): round to
    nearest even, saturate to the finite max, NaN stays NaN. Returns a tensor of FP8."""
    if FP8 == tl.float8e4nv:
        bits = _fp8_bits(x, 3, 7, 0x43E00000)  # max 448 = 1.75 * 2^8
    else:
        bits = _fp8_bits(x, 2, 15, 0x47600000)  # max 57344 = 1.75 * 2^15
    return bits.to(tl.uint8).to(FP8, bitcast=True)


@triton.jit
def from_kv(x, dtype: tl.constexpr):
    """A loaded K/V tile as ``dtype`` (the dots' operand type); exact for fp8 tiles going to fp16 or fp32.

    e5m2 is the high byte of an fp16, so it converts by a shift on every architecture: Triton 3.6 lowers
    ``.to(tl.float16)`` of e5m2 to an sm_89 instruction even for sm_80, which ptxas rejects (the A100 runs e5m2
    caches). e4m3 (sm_89+) takes the native conversion, one instruction for two values to fp16. Other dtypes: ``.to``.
    """
    if x.dtype == tl.float8e5:
        x = (x.to(tl.uint8, bitcast=True).to(tl.uint16) << 8).to(tl.float16, bitcast=True)
    return x.to(dtype)
