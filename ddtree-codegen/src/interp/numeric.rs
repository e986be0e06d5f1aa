//! Scalar semantics: C arithmetic on the DSL types (wrapping u32/i32, PTX shift clamping,
//! saturating float-to-int casts), hardware-exact bf16/f16 conversions, and the bit-level
//! intrinsics (`lop3`, `prmt`, `mma.m16n8k16`).

use super::compile::Val;
use super::Hazard;
use crate::ir::{BinOp, Scalar, UnOp};

/// f32 to bf16 bits as `cvt.rn.bf16.f32`: round to nearest even, NaN to the canonical `0x7fff`.
pub(super) fn f32_to_bf16(f: f32) -> u16 {
    if f.is_nan() {
        0x7fff
    } else {
        half::bf16::from_f32(f).to_bits()
    }
}

/// f32 to f16 bits as `cvt.rn.f16.f32`: round to nearest even, NaN to the canonical `0x7fff`.
pub(super) fn f32_to_f16(f: f32) -> u16 {
    if f.is_nan() {
        0x7fff
    } else {
        half::f16::from_f32(f).to_bits()
    }
}

/// bf16 bits to f32 (exact).
pub(super) fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// f16 bits to f32 (exact).
pub(super) fn f16_to_f32(h: u16) -> f32 {
    half::f16::from_bits(h).to_f32()
}

impl Val {
    /// The value as u32 bits (C conversion for other integers and bool).
    pub(super) fn u32(self) -> u32 {
        match self {
            Val::U(x) => x,
            Val::I(x) => x as u32,
            Val::U64(x) => x as u32,
            Val::B(b) => b as u32,
            Val::H(h) => h as u32,
            Val::F(f) => f.to_bits(),
            other => unreachable!("not an integer: {other:?}"),
        }
    }

    pub(super) fn i32(self) -> i32 {
        self.u32() as i32
    }

    pub(super) fn u64(self) -> u64 {
        match self {
            Val::U64(x) => x,
            Val::I(x) => x as i64 as u64,
            other => other.u32() as u64,
        }
    }

    pub(super) fn f32(self) -> f32 {
        match self {
            Val::F(f) => f,
            other => unreachable!("not an f32: {other:?}"),
        }
    }

    pub(super) fn bool(self) -> bool {
        match self {
            Val::B(b) => b,
            other => other.u32() != 0,
        }
    }
}

/// `-a` / `!a` on a value of type `ty`.
pub(super) fn unary(op: UnOp, ty: Scalar, a: Val) -> Val {
    match (op, ty) {
        (UnOp::Neg, Scalar::F32) => Val::F(-a.f32()),
        (UnOp::Neg, Scalar::U64) => Val::U64(a.u64().wrapping_neg()),
        (UnOp::Neg, Scalar::U32) => Val::U(a.u32().wrapping_neg()),
        (UnOp::Neg, _) => Val::I(a.i32().wrapping_neg()),
        (UnOp::Not, Scalar::Bool) => Val::B(!a.bool()),
        (UnOp::Not, Scalar::U64) => Val::U64(!a.u64()),
        (UnOp::Not, Scalar::U32) => Val::U(!a.u32()),
        (UnOp::Not, _) => Val::I(!a.i32()),
    }
}

/// `a op b` with operands of type `ty` (for shifts: the left operand's type).
pub(super) fn binary(op: BinOp, ty: Scalar, a: Val, b: Val) -> Result<Val, Hazard> {
    use BinOp::*;
    Ok(match ty {
        Scalar::F32 => {
            let (x, y) = (a.f32(), b.f32());
            match op {
                Add => Val::F(x + y),
                Sub => Val::F(x - y),
                Mul => Val::F(x * y),
                Div => Val::F(x / y),
                Rem => Val::F(x % y),
                Eq => Val::B(x == y),
                Ne => Val::B(x != y),
                Lt => Val::B(x < y),
                Le => Val::B(x <= y),
                Gt => Val::B(x > y),
                Ge => Val::B(x >= y),
                _ => unreachable!("`{}` on f32", op.c_str()),
            }
        }
        Scalar::Bool => {
            let (x, y) = (a.bool(), b.bool());
            match op {
                Eq => Val::B(x == y),
                Ne => Val::B(x != y),
                BitAnd | And => Val::B(x & y),
                BitOr | Or => Val::B(x | y),
                BitXor => Val::B(x ^ y),
                _ => unreachable!("`{}` on bool", op.c_str()),
            }
        }
        Scalar::U32 => int(op, a.u32(), b, 32, Val::U, |x, y| x < y)?,
        Scalar::U64 => int(op, a.u64(), b, 64, Val::U64, |x, y| x < y)?,
        _ => {
            let x = a.i32();
            match op {
                // Arithmetic shift right keeps the sign; everything else is the bits of u32.
                Shr => {
                    let n = b.u32();
                    Val::I(if n >= 32 { x >> 31 } else { x >> n })
                }
                Div | Rem if b.i32() == 0 => return Err(Hazard::DivisionByZero),
                Div => Val::I(x.wrapping_div(b.i32())),
                Rem => Val::I(x.wrapping_rem(b.i32())),
                Lt => Val::B(x < b.i32()),
                Le => Val::B(x <= b.i32()),
                Gt => Val::B(x > b.i32()),
                Ge => Val::B(x >= b.i32()),
                _ => match int(op, x as u32, b, 32, Val::U, |x, y| x < y)? {
                    Val::U(v) => Val::I(v as i32),
                    other => other,
                },
            }
        }
    })
}

/// Unsigned integer operations on `bits`-wide values.
fn int<T>(op: BinOp, x: T, b: Val, bits: u32, wrap: fn(T) -> Val, lt: fn(T, T) -> bool) -> Result<Val, Hazard>
where
    T: Copy + PartialEq + Default + IntOps,
{
    use BinOp::*;
    let y = T::from_val(b);
    Ok(match op {
        Add => wrap(x.wadd(y)),
        Sub => wrap(x.wsub(y)),
        Mul => wrap(x.wmul(y)),
        Div | Rem if y == T::default() => return Err(Hazard::DivisionByZero),
        Div => wrap(x.div(y)),
        Rem => wrap(x.rem(y)),
        BitAnd => wrap(x.and(y)),
        BitOr => wrap(x.or(y)),
        BitXor => wrap(x.xor(y)),
        // PTX shl/shr clamp the amount: shifting by the width or more gives 0.
        Shl => {
            let n = b.u32();
            wrap(if n >= bits { T::default() } else { x.shl(n) })
        }
        Shr => {
            let n = b.u32();
            wrap(if n >= bits { T::default() } else { x.shr(n) })
        }
        Eq => Val::B(x == y),
        Ne => Val::B(x != y),
        Lt => Val::B(lt(x, y)),
        Le => Val::B(!lt(y, x)),
        Gt => Val::B(lt(y, x)),
        Ge => Val::B(!lt(x, y)),
        And | Or => unreachable!("logical operators on integers"),
    })
}

/// The unsigned integer operations [`int`] needs.
trait IntOps: Sized {
    fn from_val(v: Val) -> Self;
    fn wadd(self, y: Self) -> Self;
    fn wsub(self, y: Self) -> Self;
    fn wmul(self, y: Self) -> Self;
    fn div(self, y: Self) -> Self;
    fn rem(self, y: Self) -> Self;
    fn and(self, y: Self) -> Self;
    fn or(self, y: Self) -> Self;
    fn xor(self, y: Self) -> Self;
    fn shl(self, n: u32) -> Self;
    fn shr(self, n: u32) -> Self;
}

macro_rules! int_ops {
    ($t:ty, $get:ident) => {
        impl IntOps for $t {
            fn from_val(v: Val) -> Self {
                v.$get()
            }
            fn wadd(self, y: Self) -> Self {
                self.wrapping_add(y)
            }
            fn wsub(self, y: Self) -> Self {
                self.wrapping_sub(y)
            }
            fn wmul(self, y: Self) -> Self {
                self.wrapping_mul(y)
            }
            fn div(self, y: Self) -> Self {
                self / y
            }
            fn rem(self, y: Self) -> Self {
                self % y
            }
            fn and(self, y: Self) -> Self {
                self & y
            }
            fn or(self, y: Self) -> Self {
                self | y
            }
            fn xor(self, y: Self) -> Self {
                self ^ y
            }
            fn shl(self, n: u32) -> Self {
                self << n
            }
            fn shr(self, n: u32) -> Self {
                self >> n
            }
        }
    };
}
int_ops!(u32, u32);
int_ops!(u64, u64);

/// `x as to` with C (PTX `cvt`) semantics: float-to-int truncates and saturates (NaN gives 0),
/// int-to-float rounds to nearest even, bf16/f16 as the hardware converts.
pub(super) fn cast(v: Val, from: Scalar, to: Scalar) -> Val {
    let f = match from {
        Scalar::F32 => Some(v.f32()),
        Scalar::Bf16 => Some(bf16_to_f32(v.u32() as u16)),
        Scalar::F16 => Some(f16_to_f32(v.u32() as u16)),
        _ => None,
    };
    match (f, to) {
        (Some(x), Scalar::F32) => Val::F(x),
        (Some(x), Scalar::Bf16) => Val::H(f32_to_bf16(x)),
        (Some(x), Scalar::F16) => Val::H(f32_to_f16(x)),
        (Some(x), Scalar::U32) => Val::U(x as u32),
        (Some(x), Scalar::I32) => Val::I(x as i32),
        (Some(x), Scalar::U64) => Val::U64(x as u64),
        (Some(x), Scalar::Bool) => Val::B(x != 0.0),
        (None, Scalar::F32) => Val::F(match from {
            Scalar::I32 => v.i32() as f32,
            Scalar::U64 => v.u64() as f32,
            _ => v.u32() as f32,
        }),
        (None, Scalar::Bf16 | Scalar::F16) => unreachable!("integer to half casts are rejected by the type checker"),
        (None, Scalar::U32) => Val::U(v.u32()),
        (None, Scalar::I32) => Val::I(v.i32()),
        (None, Scalar::U64) => Val::U64(v.u64()),
        (None, Scalar::Bool) => Val::B(v.bool()),
    }
}

/// A math function by its C name on operands of type `ty`.
pub(super) fn math(name: &str, ty: Scalar, a: &[Val]) -> Val {
    if ty != Scalar::F32 {
        let (x, y) = (a[0], a.get(1).copied().unwrap_or(Val::Void));
        return match (name, ty) {
            ("abs", _) => Val::I(x.i32().wrapping_abs()),
            ("__popc", _) => Val::U(x.u32().count_ones()),
            ("__clz", _) => Val::U(x.u32().leading_zeros()),
            ("max", Scalar::U32) => Val::U(x.u32().max(y.u32())),
            ("min", Scalar::U32) => Val::U(x.u32().min(y.u32())),
            ("max", Scalar::U64) => Val::U64(x.u64().max(y.u64())),
            ("min", Scalar::U64) => Val::U64(x.u64().min(y.u64())),
            ("max", _) => Val::I(x.i32().max(y.i32())),
            ("min", _) => Val::I(x.i32().min(y.i32())),
            _ => unreachable!("integer math `{name}`"),
        };
    }
    let x = a[0].f32();
    let y = || a[1].f32();
    Val::F(match name {
        "expf" => x.exp(),
        "exp2f" => x.exp2(),
        "logf" => x.ln(),
        "log2f" => x.log2(),
        "sqrtf" => x.sqrt(),
        "rsqrtf" => 1.0 / x.sqrt(),
        "tanhf" => x.tanh(),
        "sinf" => x.sin(),
        "cosf" => x.cos(),
        "floorf" => x.floor(),
        "ceilf" => x.ceil(),
        "__frcp_rn" => 1.0 / x,
        "fabsf" => x.abs(),
        "fmaxf" => x.max(y()),
        "fminf" => x.min(y()),
        "fmaf" => x.mul_add(y(), a[2].f32()),
        "powf" => x.powf(y()),
        _ => unreachable!("unknown math function `{name}`"),
    })
}

/// `ex2.approx.ftz.f32` as exactly rounded 2^x, with subnormal inputs and results flushed to
/// (positive) zero.
pub(super) fn exp2_ftz(x: f32) -> f32 {
    let x = if x.is_subnormal() { 0.0 } else { x };
    let y = x.exp2();
    if y.is_subnormal() {
        0.0
    } else {
        y
    }
}

/// `lop3.b32`: each result bit is `lut[(a << 2) | (b << 1) | c]` of the operand bits.
pub(super) fn lop3(a: u32, b: u32, c: u32, lut: u32) -> u32 {
    let mut r = 0;
    for i in 0..8 {
        if lut >> i & 1 == 1 {
            let pick = |bit: u32, x: u32| if i >> bit & 1 == 1 { x } else { !x };
            r |= pick(2, a) & pick(1, b) & pick(0, c);
        }
    }
    r
}

/// `prmt.b32` default mode: result byte `i` is byte `s[4i+2..4i]` of `{b, a}` (a = bytes 0-3);
/// with bit `4i+3` set, that byte's sign bit replicated instead.
pub(super) fn prmt(a: u32, b: u32, s: u32) -> u32 {
    let bytes = ((b as u64) << 32) | a as u64;
    let mut r = 0u32;
    for i in 0..4 {
        let sel = s >> (4 * i) & 0xf;
        let byte = (bytes >> (8 * (sel & 7))) as u8;
        let out = if sel & 8 != 0 {
            if byte & 0x80 != 0 {
                0xff
            } else {
                0
            }
        } else {
            byte
        };
        r |= (out as u32) << (8 * i);
    }
    r
}

/// `fma.rn.bf16` on one lane: `a * b + c` computed exactly, then rounded once to bf16 (nearest
/// even; NaN to the canonical `0x7fff`). The product of two bf16 is exact in f64; the sum is
/// rounded to f64 with its exact error kept (two-sum), which breaks the ties a double rounding
/// would get wrong.
pub(super) fn fma_bf16(a: u16, b: u16, c: u16) -> u16 {
    let (p, c) = (bf16_to_f32(a) as f64 * bf16_to_f32(b) as f64, bf16_to_f32(c) as f64);
    let s = p + c;
    if !s.is_finite() || s == 0.0 {
        return f32_to_bf16(s as f32);
    }
    // Two-sum: s + err == p + c exactly.
    let bb = s - p;
    let err = (p - (s - bb)) + (c - bb);
    // bf16 spacing at |s| (8 significant bits; subnormal below 2^-126).
    let e = ((s.to_bits() >> 52) & 0x7ff) as i32 - 1023;
    let ulp = 2f64.powi(e.max(-126) - 7);
    let r = s / ulp;
    let lo = r.floor();
    let frac = r - lo;
    let up = if frac != 0.5 {
        frac > 0.5
    } else if err != 0.0 {
        err > 0.0
    } else {
        lo % 2.0 != 0.0
    };
    f32_to_bf16(((if up { lo + 1.0 } else { lo }) * ulp) as f32)
}

/// `fma.rn.bf16x2`: [`fma_bf16`] on the low and the high halves.
pub(super) fn fma_bf16x2(a: u32, b: u32, c: u32) -> u32 {
    let lane = |x: u32, sh: u32| (x >> sh) as u16;
    (fma_bf16(lane(a, 16), lane(b, 16), lane(c, 16)) as u32) << 16 | fma_bf16(a as u16, b as u16, c as u16) as u32
}

/// `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.f32` over a warp: `d[lane]` (4 f32 each)
/// += A (16x16, row) * B (16x8, col), with `a[lane]` (4 u32) and `b[lane]` (2 u32) in the PTX
/// fragment layouts (g = lane / 4, t = lane % 4; a0: (g, 2t..), a1: (g + 8, 2t..),
/// a2: (g, 2t + 8..), a3: (g + 8, 2t + 8..); b0: (k = 2t.., n = g), b1: (k = 2t + 8.., g);
/// c0/c1: (g, 2t / 2t + 1), c2/c3: (g + 8, 2t / 2t + 1)).
pub(super) fn mma_m16n8k16(d: &mut [[f32; 4]; 32], a: &[[u32; 4]; 32], b: &[[u32; 2]; 32], bf16: bool) {
    let cvt = |h: u32| {
        if bf16 {
            bf16_to_f32(h as u16)
        } else {
            f16_to_f32(h as u16)
        }
    };
    let mut am = [[0f32; 16]; 16];
    let mut bm = [[0f32; 8]; 16];
    for lane in 0..32 {
        let (g, t) = (lane / 4, lane % 4);
        for (r, (row, col)) in [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]
            .into_iter()
            .enumerate()
        {
            am[row][col] = cvt(a[lane][r] & 0xffff);
            am[row][col + 1] = cvt(a[lane][r] >> 16);
        }
        for (r, k) in [2 * t, 2 * t + 8].into_iter().enumerate() {
            bm[k][g] = cvt(b[lane][r] & 0xffff);
            bm[k + 1][g] = cvt(b[lane][r] >> 16);
        }
    }
    let mut out = [[0f32; 8]; 16];
    for (i, row) in out.iter_mut().enumerate() {
        for (j, o) in row.iter_mut().enumerate() {
            // Products of 16-bit floats are exact in f32; sum them, then accumulate.
            *o = (0..16).map(|k| am[i][k] * bm[k][j]).sum();
        }
    }
    for (lane, dl) in d.iter_mut().enumerate() {
        let (g, t) = (lane / 4, lane % 4);
        dl[0] += out[g][2 * t];
        dl[1] += out[g][2 * t + 1];
        dl[2] += out[g + 8][2 * t];
        dl[3] += out[g + 8][2 * t + 1];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp2_ftz_flushes_subnormals() {
        assert_eq!(exp2_ftz(3.0), 8.0);
        assert_eq!(exp2_ftz(-130.0), 0.0);
        assert_eq!(exp2_ftz(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp2_ftz(f32::from_bits(1)), 1.0);
        assert!(exp2_ftz(f32::NAN).is_nan());
    }

    #[test]
    fn lop3_matches_boolean_formulas() {
        let (a, b, c) = (0xf0f0_1234u32, 0xcccc_5678u32, 0xaaaa_9abcu32);
        assert_eq!(lop3(a, b, c, 0xf0), a);
        assert_eq!(lop3(a, b, c, 0xcc), b);
        assert_eq!(lop3(a, b, c, 0xaa), c);
        assert_eq!(lop3(a, b, c, 0xf0 & 0xcc | 0xaa), (a & b) | c);
        assert_eq!(lop3(a, b, c, 0xf0 ^ 0xcc ^ 0xaa), a ^ b ^ c);
    }

    #[test]
    fn prmt_selects_and_replicates_signs() {
        let (a, b) = (0x8382_0100u32, 0x0786_0504u32);
        assert_eq!(prmt(a, b, 0x3210), a);
        assert_eq!(prmt(a, b, 0x7654), b);
        assert_eq!(prmt(a, b, 0x0123), 0x0001_8283);
        // Sign replication: byte 3 of a (0x83) is negative, byte 0 (0x00) is not.
        assert_eq!(prmt(a, b, 0x8b08), 0x00ff_0000);
    }

    #[test]
    fn fma_bf16x2_rounds_once_like_fma_rn() {
        let h = |v: f32| f32_to_bf16(v) as u32;
        let pair = |lo: f32, hi: f32| h(hi) << 16 | h(lo);
        // The W4A16 dequantization: (128 + nibble) - 136, then times a scale.
        assert_eq!(
            fma_bf16x2(pair(131.0, 143.0), pair(1.0, 1.0), pair(-136.0, -136.0)),
            pair(-5.0, 7.0)
        );
        assert_eq!(
            fma_bf16x2(pair(7.0, -3.0), pair(1.0078125, 0.5), 0x8000_8000),
            pair(7.0625, -1.5)
        );
        // 1.0078125 * 1.5 = 1.51171875 is halfway between two bf16; a tiny negative c must
        // round it down. (An f32 fma then a bf16 rounding would see an exact tie and round
        // to even, up.)
        let tiny = -(2f32.powi(-30));
        assert_eq!(
            fma_bf16x2(pair(1.0078125, 0.0), pair(1.5, 0.0), pair(tiny, 0.0)),
            pair(1.5078125, 0.0)
        );
        assert_eq!(
            fma_bf16x2(pair(1.0078125, 0.0), pair(1.5, 0.0), pair(0.0, 0.0)),
            pair(1.515625, 0.0)
        );
        // A tiny positive c rounds up; overflow gives infinity, NaN is canonical, -0 is kept.
        assert_eq!(
            fma_bf16x2(pair(1.0078125, 0.0), pair(1.5, 0.0), pair(2f32.powi(-30), 0.0)),
            pair(1.515625, 0.0)
        );
        assert_eq!(fma_bf16x2(pair(3e38, 0.0), pair(2.0, 0.0), 0), pair(f32::INFINITY, 0.0));
        assert_eq!(fma_bf16x2(pair(f32::NAN, 0.0), pair(1.0, 0.0), 0), 0x7fff);
        assert_eq!(
            fma_bf16x2(pair(-0.0, 0.0), pair(1.0, 0.0), 0x8000_8000),
            pair(-0.0, 0.0)
        );
        // Subnormal results keep their spacing (2^-133).
        assert_eq!(
            fma_bf16x2(pair(2f32.powi(-130), 0.0), pair(1.5, 0.0), 0),
            pair(1.5 * 2f32.powi(-130), 0.0)
        );
    }

    #[test]
    fn half_conversions_round_to_nearest_even_like_cvt_rn() {
        // 1 + 2^-8 is halfway between two bf16 values: ties to the even mantissa (1.0).
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::NAN), 0x7fff);
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80);
        assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3c00);
        assert_eq!(f32_to_f16(65520.0), 0x7c00);
        assert_eq!(f32_to_f16(f32::NAN), 0x7fff);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
    }

    #[test]
    fn casts_saturate_like_cvt_rzi() {
        assert_eq!(cast(Val::F(-3.7), Scalar::F32, Scalar::U32), Val::U(0));
        assert_eq!(cast(Val::F(3.7), Scalar::F32, Scalar::I32), Val::I(3));
        assert_eq!(cast(Val::F(f32::NAN), Scalar::F32, Scalar::I32), Val::I(0));
        assert_eq!(cast(Val::I(-1), Scalar::I32, Scalar::U64), Val::U64(u64::MAX));
    }

    #[test]
    fn shifts_clamp_and_division_by_zero_is_reported() {
        assert_eq!(binary(BinOp::Shl, Scalar::U32, Val::U(1), Val::U(32)), Ok(Val::U(0)));
        assert_eq!(binary(BinOp::Shr, Scalar::I32, Val::I(-8), Val::U(40)), Ok(Val::I(-1)));
        assert_eq!(
            binary(BinOp::Sub, Scalar::U32, Val::U(0), Val::U(1)),
            Ok(Val::U(u32::MAX))
        );
        assert_eq!(binary(BinOp::Div, Scalar::I32, Val::I(-7), Val::I(2)), Ok(Val::I(-3)));
        assert_eq!(
            binary(BinOp::Rem, Scalar::U32, Val::U(7), Val::U(0)),
            Err(Hazard::DivisionByZero)
        );
    }
}
