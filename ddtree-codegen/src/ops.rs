//! Type-checked constructors for IR expressions. The macro-generated builder code calls these;
//! each returns an [`OpError`] that the [`crate::Builder`] turns into a located [`crate::CodegenError`].

use crate::error::{op_bail, OpError};
use crate::intrinsics::Intrinsic;
use crate::ir::{BinOp, Builtin, Expr, ExprKind, Func, Lane, Lit, Scalar, Space, Ty, UnOp};

type R<T> = Result<T, OpError>;

fn mk(kind: ExprKind, ty: Ty) -> Expr {
    Expr { kind, ty }
}

/// A value known when the source is generated (a parameter or an expression over parameters).
pub trait Comptime {
    /// The literal expression for this value.
    fn to_expr(&self) -> Expr;
}

macro_rules! comptime_int {
    ($($t:ty),*) => {$(
        impl Comptime for $t {
            fn to_expr(&self) -> Expr { mk(ExprKind::Lit(Lit::Int(*self as i128)), Ty::UntypedInt) }
        }
    )*};
}
comptime_int!(u8, u16, u32, u64, usize, i8, i16, i32, i64, isize);

impl Comptime for bool {
    fn to_expr(&self) -> Expr {
        mk(ExprKind::Lit(Lit::Bool(*self)), Ty::Scalar(Scalar::Bool))
    }
}

impl Comptime for f32 {
    fn to_expr(&self) -> Expr {
        mk(ExprKind::Lit(Lit::F32(*self)), Ty::Scalar(Scalar::F32))
    }
}

/// An integer literal, typed by its suffix or untyped.
pub fn int_lit(v: i128, suffix: Option<Scalar>) -> R<Expr> {
    match suffix {
        None => Ok(mk(ExprKind::Lit(Lit::Int(v)), Ty::UntypedInt)),
        Some(Scalar::F32) => Ok(float_lit(v as f32)),
        Some(s) if s.is_int() => {
            check_range(v, s)?;
            Ok(mk(ExprKind::Lit(Lit::Int(v)), Ty::Scalar(s)))
        }
        Some(s) => op_bail!("integer literal cannot have type {}", s.rust_name()),
    }
}

/// An f32 literal.
pub fn float_lit(v: f32) -> Expr {
    mk(ExprKind::Lit(Lit::F32(v)), Ty::Scalar(Scalar::F32))
}

/// A bool literal.
pub fn bool_lit(v: bool) -> Expr {
    mk(ExprKind::Lit(Lit::Bool(v)), Ty::Scalar(Scalar::Bool))
}

fn check_range(v: i128, s: Scalar) -> R<()> {
    let (lo, hi) = match s {
        Scalar::U32 => (0, u32::MAX as i128),
        Scalar::I32 => (i32::MIN as i128, i32::MAX as i128),
        Scalar::U64 => (0, u64::MAX as i128),
        _ => return Ok(()),
    };
    if v < lo || v > hi {
        op_bail!("literal {v} does not fit in {}", s.rust_name());
    }
    Ok(())
}

/// Gives an untyped integer literal the type `s` (recursively through folded arithmetic).
pub(crate) fn fix_untyped(e: &mut Expr, s: Scalar) {
    if e.ty != Ty::UntypedInt {
        return;
    }
    if s == Scalar::F32 {
        if let ExprKind::Lit(Lit::Int(v)) = e.kind {
            *e = float_lit(v as f32);
            return;
        }
    }
    e.ty = Ty::Scalar(s);
    match &mut e.kind {
        ExprKind::Unary(_, a) => fix_untyped(a, s),
        ExprKind::Binary(_, a, b) => {
            fix_untyped(a, s);
            fix_untyped(b, s);
        }
        _ => {}
    }
}

/// The type an untyped integer defaults to when nothing else fixes it: u32, or i32 if negative.
pub fn default_int(e: &mut Expr) {
    if e.ty == Ty::UntypedInt {
        let neg =
            matches!(e.kind, ExprKind::Lit(Lit::Int(v)) if v < 0) || matches!(e.kind, ExprKind::Unary(UnOp::Neg, _));
        fix_untyped(e, if neg { Scalar::I32 } else { Scalar::U32 });
    }
}

/// A thread-geometry builtin.
pub fn builtin(b: Builtin) -> Expr {
    mk(ExprKind::Builtin(b), Ty::Scalar(Scalar::U32))
}

/// Makes both operands the same scalar type (untyped literals adopt the other side's type).
fn unify(a: &mut Expr, b: &mut Expr, op: &str) -> R<Option<Scalar>> {
    match (&a.ty, &b.ty) {
        (Ty::UntypedInt, Ty::UntypedInt) => Ok(None),
        (Ty::UntypedInt, Ty::Scalar(s)) => {
            let s = *s;
            if !(s.is_int() || s == Scalar::F32) {
                op_bail!("cannot use an integer literal with {} in `{op}`", s.rust_name());
            }
            fix_untyped(a, s);
            Ok(Some(s))
        }
        (Ty::Scalar(s), Ty::UntypedInt) => {
            let s = *s;
            if !(s.is_int() || s == Scalar::F32) {
                op_bail!("cannot use an integer literal with {} in `{op}`", s.rust_name());
            }
            fix_untyped(b, s);
            Ok(Some(s))
        }
        (Ty::Scalar(x), Ty::Scalar(y)) if x == y => Ok(Some(*x)),
        (x, y) => op_bail!("mismatched types in `{op}`: {x} and {y} (add an `as` cast)"),
    }
}

fn fold_int(op: BinOp, x: i128, y: i128) -> Option<i128> {
    use BinOp::*;
    Some(match op {
        Add => x.checked_add(y)?,
        Sub => x.checked_sub(y)?,
        Mul => x.checked_mul(y)?,
        Div if y != 0 => x / y,
        Rem if y != 0 => x % y,
        BitAnd => x & y,
        BitOr => x | y,
        BitXor => x ^ y,
        Shl if (0..64).contains(&y) => x.checked_shl(y as u32)?,
        Shr if (0..64).contains(&y) => x >> y,
        _ => return None,
    })
}

/// `a op b`.
pub fn binary(op: BinOp, mut a: Expr, mut b: Expr) -> R<Expr> {
    use BinOp::*;
    let sym = op.c_str();
    if matches!(op, Shl | Shr) {
        let lt = match &a.ty {
            Ty::UntypedInt => None,
            Ty::Scalar(s) if s.is_int() => Some(*s),
            other => op_bail!("`{sym}` needs an integer on the left, found {other}"),
        };
        match &b.ty {
            Ty::UntypedInt => fix_untyped(&mut b, Scalar::U32),
            Ty::Scalar(s) if s.is_int() => {}
            other => op_bail!("`{sym}` needs an integer shift amount, found {other}"),
        }
        return Ok(match lt {
            Some(s) => mk(ExprKind::Binary(op, Box::new(a), Box::new(b)), Ty::Scalar(s)),
            None => mk(ExprKind::Binary(op, Box::new(a), Box::new(b)), Ty::UntypedInt),
        });
    }
    let s = unify(&mut a, &mut b, sym)?;
    if s.is_none() {
        if let (ExprKind::Lit(Lit::Int(x)), ExprKind::Lit(Lit::Int(y))) = (&a.kind, &b.kind) {
            if op.is_comparison() || matches!(op, And | Or) {
                // Leave it to C; comparisons of two literals are rare.
            } else if let Some(v) = fold_int(op, *x, *y) {
                return Ok(mk(ExprKind::Lit(Lit::Int(v)), Ty::UntypedInt));
            }
        }
    }
    let result = match op {
        Add | Sub | Mul | Div | Rem => match s {
            None => Ty::UntypedInt,
            Some(s) if s.is_int() || s == Scalar::F32 => Ty::Scalar(s),
            Some(s) if s.is_half() => op_bail!("no arithmetic on {}: convert with `as f32` first", s.rust_name()),
            Some(s) => op_bail!("`{sym}` is not defined on {}", s.rust_name()),
        },
        BitAnd | BitOr | BitXor => match s {
            None => Ty::UntypedInt,
            Some(s) if s.is_int() || s == Scalar::Bool => Ty::Scalar(s),
            Some(s) => op_bail!("`{sym}` needs integers or bools, found {}", s.rust_name()),
        },
        Eq | Ne | Lt | Le | Gt | Ge => {
            match s {
                None => {
                    default_int(&mut a);
                    default_int(&mut b);
                }
                Some(s) if s.is_half() => {
                    op_bail!("cannot compare {} values: convert with `as f32` first", s.rust_name())
                }
                Some(Scalar::Bool) if !matches!(op, Eq | Ne) => {
                    op_bail!("`{sym}` is not defined on bool")
                }
                _ => {}
            }
            Ty::Scalar(Scalar::Bool)
        }
        And | Or => {
            if s != Some(Scalar::Bool) {
                op_bail!("`{sym}` needs bool operands, found {}", a.ty);
            }
            Ty::Scalar(Scalar::Bool)
        }
        Shl | Shr => unreachable!("handled above"),
    };
    Ok(mk(ExprKind::Binary(op, Box::new(a), Box::new(b)), result))
}

/// `-a` or `!a`.
pub fn unary(op: UnOp, a: Expr) -> R<Expr> {
    match (op, &a.ty) {
        (UnOp::Neg, Ty::UntypedInt) => {
            if let ExprKind::Lit(Lit::Int(v)) = a.kind {
                return Ok(mk(ExprKind::Lit(Lit::Int(-v)), Ty::UntypedInt));
            }
            Ok(mk(ExprKind::Unary(op, Box::new(a)), Ty::UntypedInt))
        }
        (UnOp::Neg, Ty::Scalar(Scalar::F32 | Scalar::I32)) => {
            if let ExprKind::Lit(Lit::F32(v)) = a.kind {
                return Ok(float_lit(-v));
            }
            let ty = a.ty.clone();
            Ok(mk(ExprKind::Unary(op, Box::new(a)), ty))
        }
        (UnOp::Not, Ty::Scalar(s)) if s.is_int() || *s == Scalar::Bool => {
            let ty = a.ty.clone();
            Ok(mk(ExprKind::Unary(op, Box::new(a)), ty))
        }
        (UnOp::Neg, t) => op_bail!("cannot negate a value of type {t}"),
        (UnOp::Not, t) => op_bail!("`!` is not defined on {t}"),
    }
}

/// `a as T`.
pub fn cast(mut a: Expr, to: Scalar) -> R<Expr> {
    let from = match &a.ty {
        Ty::UntypedInt => {
            fix_untyped(
                &mut a,
                if to.is_int() || to == Scalar::F32 {
                    to
                } else {
                    Scalar::U32
                },
            );
            return if a.ty == Ty::Scalar(to) { Ok(a) } else { cast(a, to) };
        }
        Ty::Scalar(s) => *s,
        other => op_bail!("cannot cast {other} to {}", to.rust_name()),
    };
    if from == to {
        return Ok(a);
    }
    let ok = match (from, to) {
        (f, t) if f.is_half() || t.is_half() => (f.is_half() && t == Scalar::F32) || (t.is_half() && f == Scalar::F32),
        (_, Scalar::Bool) => false,
        _ => true,
    };
    if !ok {
        if from.is_half() || to.is_half() {
            op_bail!(
                "cannot cast {} to {} directly: {} converts only to and from f32",
                from.rust_name(),
                to.rust_name(),
                if from.is_half() {
                    from.rust_name()
                } else {
                    to.rust_name()
                }
            );
        }
        op_bail!("cannot cast {} to {}", from.rust_name(), to.rust_name());
    }
    Ok(mk(ExprKind::Cast(Box::new(a), to), Ty::Scalar(to)))
}

/// `f32::to_bits` / `f32::from_bits`.
pub fn bitcast(a: Expr, to: Scalar) -> R<Expr> {
    match (&a.ty, to) {
        (Ty::Scalar(Scalar::F32), Scalar::U32) | (Ty::Scalar(Scalar::U32), Scalar::F32) => {
            Ok(mk(ExprKind::Bitcast(Box::new(a), to), Ty::Scalar(to)))
        }
        (Ty::UntypedInt, Scalar::F32) => {
            let mut a = a;
            fix_untyped(&mut a, Scalar::U32);
            bitcast(a, to)
        }
        (t, _) => op_bail!("bit reinterpretation is defined between f32 and u32 only, found {t}"),
    }
}

/// `base[idx]`.
pub fn index(base: Expr, mut idx: Expr) -> R<Expr> {
    match &idx.ty {
        Ty::UntypedInt => fix_untyped(&mut idx, Scalar::U32),
        Ty::Scalar(s) if s.is_int() => {}
        other => op_bail!("index must be an integer, found {other}"),
    }
    let ty = match &base.ty {
        Ty::Slice { elem, .. } => Ty::Scalar(*elem),
        Ty::View { elem, .. } => {
            if idx.ty != Ty::Scalar(Scalar::U32) {
                op_bail!("a sub-slice is indexed with a u32, found {}", idx.ty);
            }
            Ty::Scalar(*elem)
        }
        Ty::Array { elem, dims, space } => {
            if let (ExprKind::Lit(Lit::Int(i)), Some(&d)) = (&idx.kind, dims.first()) {
                if *i < 0 || *i >= d as i128 {
                    op_bail!("index {i} is out of bounds for an array of length {d}");
                }
            }
            if dims.len() == 1 {
                Ty::Scalar(*elem)
            } else {
                Ty::Array {
                    elem: *elem,
                    dims: dims[1..].to_vec(),
                    space: *space,
                }
            }
        }
        other => op_bail!("cannot index a value of type {other}"),
    };
    Ok(mk(ExprKind::Index(Box::new(base), Box::new(idx)), ty))
}

/// `&base[offset..]` / `&mut base[offset..]`: a sub-slice of a global slice or 1-D shared array
/// (not of registers, which have no addresses, nor of another sub-slice).
pub fn sub_slice(base: Expr, mut offset: Expr, mutable: bool) -> R<Expr> {
    match &offset.ty {
        Ty::UntypedInt => fix_untyped(&mut offset, Scalar::U32),
        Ty::Scalar(Scalar::U32) => {}
        other => op_bail!("a sub-slice starts at a u32 offset, found {other}"),
    }
    if !matches!(base.kind, ExprKind::Var(_)) {
        op_bail!("a sub-slice is taken of a named slice or shared array: `&x[a..]`");
    }
    let (elem, space, writable) = match &base.ty {
        Ty::Slice { elem, mutable } => (*elem, Space::Global, *mutable),
        Ty::Array {
            elem,
            dims,
            space: Space::Shared,
        } if dims.len() == 1 => (*elem, Space::Shared, true),
        Ty::Array {
            space: Space::Local, ..
        } => {
            op_bail!("register arrays have no sub-slices (registers have no addresses)")
        }
        Ty::View { .. } => op_bail!("a sub-slice of a sub-slice is not supported: offset the first one"),
        other => op_bail!("sub-slices are taken of slices and 1-D shared arrays, not of {other}"),
    };
    if mutable && !writable {
        op_bail!("cannot take `&mut` into a read-only slice (declare it `&mut [T]`)");
    }
    Ok(mk(
        ExprKind::SubSlice(Box::new(base), Box::new(offset)),
        Ty::View { elem, space, mutable },
    ))
}

/// `v.x` on a `u32x4`.
pub fn field(base: Expr, name: &str) -> R<Expr> {
    match (&base.ty, Lane::from_name(name)) {
        (Ty::U32x4, Some(l)) => Ok(mk(ExprKind::Field(Box::new(base), l), Ty::Scalar(Scalar::U32))),
        (Ty::U32x4, None) => op_bail!("`u32x4` has lanes x, y, z, w; no `{name}`"),
        (t, _) => op_bail!("no field `{name}` on a value of type {t}"),
    }
}

/// The root variable and mutability of a place expression.
fn place_root(e: &Expr) -> Option<&Expr> {
    match &e.kind {
        ExprKind::Var(_) => Some(e),
        ExprKind::Index(b, _) | ExprKind::Field(b, _) => place_root(b),
        _ => None,
    }
}

/// `&x[i]` / `&mut x[i]` / `&mut arr` / `&mut arr[j]` (a row of a 2-D register array).
pub fn addr_of(place: Expr, mutable: bool) -> R<Expr> {
    let root =
        place_root(&place).ok_or_else(|| OpError::new("`&` is allowed only on indexed buffers and register arrays"))?;
    let (space, root_mut) = match &root.ty {
        Ty::Slice { mutable, .. } => (Space::Global, *mutable),
        Ty::View { space, mutable, .. } => (*space, *mutable),
        Ty::Array { space, .. } => (*space, true),
        other => op_bail!("cannot take the address of {other}"),
    };
    if mutable && !root_mut {
        if matches!(root.ty, Ty::View { .. }) {
            op_bail!("cannot take `&mut` into a read-only sub-slice (take it with `&mut x[a..]`)");
        }
        op_bail!("cannot take `&mut` into a read-only slice (declare it `&mut [T]`)");
    }
    let ty = match &place.ty {
        Ty::Scalar(elem) if matches!(place.kind, ExprKind::Index(..)) => Ty::Ref {
            elem: *elem,
            space,
            len: None,
            mutable,
        },
        Ty::Array { elem, dims, space } if dims.len() == 1 => Ty::Ref {
            elem: *elem,
            space: *space,
            len: Some(dims[0]),
            mutable,
        },
        other => op_bail!("cannot take the address of {other}"),
    };
    Ok(mk(ExprKind::AddrOf(Box::new(place)), ty))
}

/// `c ? a : b` (from `if c { a } else { b }` in expression position).
pub fn select(c: Expr, mut a: Expr, mut b: Expr) -> R<Expr> {
    if c.ty != Ty::Scalar(Scalar::Bool) {
        op_bail!("`if` condition must be bool, found {}", c.ty);
    }
    let s = unify(&mut a, &mut b, "if/else")?;
    let ty = s.map(Ty::Scalar).unwrap_or(Ty::UntypedInt);
    Ok(mk(ExprKind::Select(Box::new(c), Box::new(a), Box::new(b)), ty))
}

/// Checks an assignment and returns the value converted to the place's type.
pub fn check_assign(place: &Expr, op: Option<BinOp>, value: Expr) -> R<Expr> {
    if !matches!(place.kind, ExprKind::Var(_) | ExprKind::Index(..) | ExprKind::Field(..)) {
        op_bail!("cannot assign to this expression");
    }
    let pty = match &place.ty {
        Ty::Scalar(s) => *s,
        Ty::U32x4 if op.is_none() => {
            if value.ty != Ty::U32x4 {
                op_bail!("mismatched types: expected u32x4, found {}", value.ty);
            }
            return Ok(value);
        }
        other => op_bail!("cannot assign to a value of type {other}"),
    };
    if let Some(op) = op {
        let combined = binary(op, place.clone(), value)?;
        if combined.ty != Ty::Scalar(pty) {
            op_bail!("`{}=` changes the type of the place", op.c_str());
        }
        match combined.kind {
            ExprKind::Binary(_, _, v) => Ok(*v),
            _ => unreachable!(),
        }
    } else {
        let mut v = value;
        crate::intrinsics::expect(&mut v, pty, "=", 1).map_err(|_| {
            OpError::new(format!(
                "mismatched types: expected {}, found {}",
                pty.rust_name(),
                v.ty
            ))
        })?;
        Ok(v)
    }
}

/// Checks that a place may be written: a `let mut` variable, a `&mut [T]` slice element, or
/// a shared/register array element. `is_mut_var` says whether the root variable is `let mut`.
pub fn check_writable(place: &Expr, is_mut_var: bool) -> R<()> {
    let root = place_root(place).ok_or_else(|| OpError::new("cannot assign to this expression"))?;
    match &root.ty {
        Ty::Slice { mutable: false, .. } => {
            op_bail!("cannot write through a `&[T]` slice argument (declare it `&mut [T]`)")
        }
        Ty::View { mutable: false, .. } => {
            op_bail!("cannot write through a read-only sub-slice (take it with `&mut x[a..]`)")
        }
        Ty::Slice { .. } | Ty::Array { .. } | Ty::View { .. } => Ok(()),
        _ if is_mut_var => Ok(()),
        _ => op_bail!("cannot assign twice to an immutable variable (declare it `let mut`)"),
    }
}

/// Math on f32 (and `min`/`max`/`abs` on integers, `count_ones`/`leading_zeros` on u32): `x.exp()`, `x.max(y)`,
/// `a.mul_add(b, c)`.
pub fn math(name: &str, mut args: Vec<Expr>) -> R<Expr> {
    let (c_f32, c_int, arity) = match name {
        "exp" => ("expf", None, 1),
        "exp2" => ("exp2f", None, 1),
        "ln" => ("logf", None, 1),
        "log2" => ("log2f", None, 1),
        "sqrt" => ("sqrtf", None, 1),
        "rsqrt" => ("rsqrtf", None, 1),
        "tanh" => ("tanhf", None, 1),
        "sin" => ("sinf", None, 1),
        "cos" => ("cosf", None, 1),
        "floor" => ("floorf", None, 1),
        "ceil" => ("ceilf", None, 1),
        "recip" => ("__frcp_rn", None, 1),
        "abs" => ("fabsf", Some("abs"), 1),
        "max" => ("fmaxf", Some("max"), 2),
        "min" => ("fminf", Some("min"), 2),
        "mul_add" => ("fmaf", None, 3),
        "powf" => ("powf", None, 2),
        "count_ones" => ("", Some("__popc"), 1),
        "leading_zeros" => ("", Some("__clz"), 1),
        _ => op_bail!("unknown method `{name}`"),
    };
    if args.len() != arity {
        op_bail!("`{name}` takes {} argument(s) besides the receiver", arity - 1);
    }
    // Unify all arguments to one scalar type.
    let mut s = None;
    for a in &args {
        if let Ty::Scalar(t) = a.ty {
            match s {
                None => s = Some(t),
                Some(u) if u != t => {
                    op_bail!("mismatched types in `{name}`: {} and {}", u.rust_name(), t.rust_name())
                }
                _ => {}
            }
        } else if a.ty != Ty::UntypedInt {
            op_bail!("`{name}` needs numbers, found {}", a.ty);
        }
    }
    let s = s.unwrap_or(Scalar::U32);
    for a in &mut args {
        fix_untyped(a, s);
    }
    let c = match s {
        Scalar::F32 if !c_f32.is_empty() => c_f32,
        Scalar::F32 => op_bail!("`{name}` is defined on integers only"),
        t if t.is_int() => match (c_int, t) {
            (Some("abs"), Scalar::U32 | Scalar::U64) => op_bail!("`abs` on an unsigned integer"),
            (Some("__popc" | "__clz"), t) if t != Scalar::U32 => op_bail!("`{name}` is defined on u32 only"),
            (Some(c), _) => c,
            (None, _) => op_bail!("`{name}` is defined on f32 only, found {}", t.rust_name()),
        },
        t => op_bail!("`{name}` is not defined on {} (convert with `as f32`)", t.rust_name()),
    };
    Ok(mk(ExprKind::Call(Func::Math(c), args), Ty::Scalar(s)))
}

/// A call of an intrinsic.
pub fn intrinsic(i: Intrinsic, mut args: Vec<Expr>) -> R<Expr> {
    let ty = i.check(&mut args)?;
    Ok(mk(ExprKind::Call(Func::Intrinsic(i), args), ty))
}

/// `x.vload(i)`: 16 bytes at `&x[i]`.
pub fn vload(base: Expr, idx: Expr) -> R<Expr> {
    let el = index(base, idx)?;
    match &el.ty {
        Ty::Scalar(_) => Ok(mk(ExprKind::VecLoad(Box::new(el)), Ty::U32x4)),
        t => op_bail!("`vload` needs a slice or 1-D array, found {t}"),
    }
}

/// Method-call dispatch: slices/arrays (`vload`, atomics), `to_bits`, and math.
pub fn method(recv: Expr, name: &str, mut args: Vec<Expr>) -> R<Expr> {
    let is_buffer = matches!(recv.ty, Ty::Slice { .. } | Ty::Array { .. } | Ty::View { .. });
    if is_buffer {
        if name == "vload" {
            if args.len() != 1 {
                op_bail!("`vload` takes one index");
            }
            return vload(recv, args.remove(0));
        }
        if let Some(i) = Intrinsic::from_dsl(name).filter(|i| i.is_atomic()) {
            if args.is_empty() {
                op_bail!("`{name}` needs an index");
            }
            let idx = args.remove(0);
            let place = index(recv, idx)?;
            let mut all = vec![addr_of(place, true)?];
            all.extend(args);
            return intrinsic(i, all);
        }
        op_bail!("unknown method `{name}` on a buffer (buffers have `vload`, `vstore` and atomics)");
    }
    if name == "to_bits" && args.is_empty() {
        return bitcast(recv, Scalar::U32);
    }
    let mut all = vec![recv];
    all.extend(args);
    math(name, all)
}

impl Comptime for f64 {
    fn to_expr(&self) -> Expr {
        float_lit(*self as f32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::expr as render;

    fn var(name: &str, s: Scalar) -> Expr {
        mk(ExprKind::Var(name.into()), Ty::Scalar(s))
    }

    #[test]
    fn untyped_literals_adopt_the_other_side() {
        let e = binary(BinOp::Add, var("n", Scalar::U32), int_lit(3, None).unwrap()).unwrap();
        assert_eq!(e.ty, Ty::Scalar(Scalar::U32));
        assert_eq!(render(&e), "n + 3u");
        let f = binary(BinOp::Mul, var("x", Scalar::F32), int_lit(2, None).unwrap()).unwrap();
        assert_eq!(render(&f), "x * 2.0f");
    }

    #[test]
    fn mismatched_and_half_arithmetic_are_errors() {
        let e = binary(BinOp::Add, var("n", Scalar::U32), var("i", Scalar::I32)).unwrap_err();
        assert!(e.0.contains("mismatched types"), "{}", e.0);
        let e = binary(BinOp::Add, var("h", Scalar::Bf16), var("g", Scalar::Bf16)).unwrap_err();
        assert!(e.0.contains("convert with `as f32`"), "{}", e.0);
        assert!(cast(var("h", Scalar::Bf16), Scalar::U32).is_err());
        assert!(int_lit(-1, Some(Scalar::U32)).is_err());
    }

    #[test]
    fn precedence_gets_parentheses_only_where_needed() {
        let a = var("a", Scalar::U32);
        let b = var("b", Scalar::U32);
        let sum = binary(BinOp::Add, a.clone(), b.clone()).unwrap();
        let prod = binary(BinOp::Mul, sum.clone(), b.clone()).unwrap();
        assert_eq!(render(&prod), "(a + b) * b");
        let and = binary(BinOp::BitAnd, a.clone(), b.clone()).unwrap();
        let cmp = binary(BinOp::Eq, and, int_lit(0, None).unwrap()).unwrap();
        assert_eq!(render(&cmp), "(a & b) == 0u");
        let sub = binary(BinOp::Sub, a.clone(), binary(BinOp::Sub, b.clone(), a).unwrap()).unwrap();
        assert_eq!(render(&sub), "a - (b - a)");
    }

    #[test]
    fn indexing_checks_constant_bounds() {
        let arr = mk(
            ExprKind::Var("r".into()),
            Ty::Array {
                elem: Scalar::F32,
                dims: vec![4],
                space: Space::Local,
            },
        );
        assert!(index(arr.clone(), int_lit(3, None).unwrap()).is_ok());
        assert!(index(arr, int_lit(4, None).unwrap())
            .unwrap_err()
            .0
            .contains("out of bounds"));
    }

    #[test]
    fn f32_literals_round_trip() {
        for v in [0.1f32, 1.0, 1e-6, f32::MAX, -2.5, f32::MIN_POSITIVE] {
            let s = crate::render::f32_lit(v);
            let parsed: f32 = s.trim_end_matches('f').parse().unwrap();
            assert_eq!(parsed, v, "{s}");
        }
        assert_eq!(crate::render::f32_lit(f32::INFINITY), "__int_as_float(0x7f800000)");
    }
}
