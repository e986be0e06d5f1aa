//! Lowering of [`KernelIr`] to flat per-function op lists with resolved variable slots.
//!
//! Structured control flow becomes jumps. Calls that may have to wait for other threads
//! (device functions, warp collectives) are hoisted out of expressions into their own ops that
//! write a temporary slot, so a thread can stop at them and resume later; `&&`, `||` and
//! `if`-expressions around such calls become branches, keeping C's evaluation order.

use std::collections::HashMap;

use super::{Hazard, InterpError};
use crate::intrinsics::Intrinsic;
use crate::ir::{
    Arg, BinOp, Builtin, DeviceFn, Expr, ExprKind, Func, KernelIr, Lane, Lit, Loc, Scalar, Space, Stmt, Ty, UnOp,
};

/// A variable slot in a function's frame.
pub(super) type Slot = u32;

/// A runtime value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Val {
    Void,
    B(bool),
    U(u32),
    I(i32),
    U64(u64),
    F(f32),
    /// bf16 or f16 bits.
    H(u16),
    V4([u32; 4]),
    /// A global buffer (kernel argument index).
    Buf(u32),
    /// A shared array (index into [`Lowered::shared`]).
    Shared(u32),
    /// A register array (index into the frame's arrays).
    Local(u32),
    Ref(Ref),
}

/// `&x[i]`: an element (or register row) address.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Ref {
    pub space: Space,
    /// Buffer, shared array or frame array index.
    pub arr: u32,
    /// Flat element index.
    pub idx: u64,
}

/// An element place: `root[i][j]...`.
#[derive(Clone, Debug)]
pub(super) struct Place {
    /// Slot holding the buffer/array handle.
    pub root: Slot,
    /// Name for messages.
    pub name: String,
    pub space: Space,
    pub elem: Scalar,
    /// Array dimensions (empty for a global slice).
    pub dims: Vec<u32>,
    /// Indices, outermost first (fewer than `dims` for a register row).
    pub indices: Vec<CExpr>,
}

/// A lowered expression; it never waits for other threads.
#[derive(Clone, Debug)]
pub(super) enum CExpr {
    Const(Val),
    Slot(Slot),
    Builtin(Builtin),
    Unary(UnOp, Scalar, Box<CExpr>),
    /// Operation, operand type.
    Binary(BinOp, Scalar, Box<CExpr>, Box<CExpr>),
    And(Box<CExpr>, Box<CExpr>),
    Or(Box<CExpr>, Box<CExpr>),
    Cast(Box<CExpr>, Scalar, Scalar),
    Bitcast(Box<CExpr>, Scalar),
    Load(Box<Place>),
    VecLoad(Box<Place>),
    Field(Box<CExpr>, Lane),
    AddrOf(Box<Place>),
    Select(Box<CExpr>, Box<CExpr>, Box<CExpr>),
    /// C name, operand type, arguments.
    Math(&'static str, Scalar, Vec<CExpr>),
    /// A per-thread intrinsic (conversions, lop3, prmt, atomics, cp.async).
    Intrinsic(Intrinsic, Vec<CExpr>),
}

/// A lowered statement.
#[derive(Clone, Debug)]
pub(super) enum Op {
    Set(Slot, CExpr),
    SetLane(Slot, Lane, CExpr),
    LocalArray {
        slot: Slot,
        len: u32,
        fill: CExpr,
    },
    SharedArray {
        slot: Slot,
        id: u32,
    },
    Store(Place, CExpr),
    VecStore(Place, CExpr),
    Eval(CExpr),
    Jump(usize),
    /// Jump to the target when the condition is false.
    JumpIfNot(CExpr, usize),
    Call {
        func: u32,
        args: Vec<CExpr>,
        dst: Option<Slot>,
    },
    Ret(Option<CExpr>),
    Barrier,
    /// A warp collective: every lane of the warp executes it together.
    Warp {
        op: Intrinsic,
        args: Vec<CExpr>,
        dst: Option<Slot>,
    },
}

/// An op and the DSL location of the statement it came from.
#[derive(Clone, Debug)]
pub(super) struct OpAt {
    pub op: Op,
    pub loc: Loc,
}

/// One lowered function (index 0 is the kernel).
#[derive(Debug)]
pub(super) struct LFunc {
    /// `kernel` or `device fn NAME`.
    pub label: String,
    pub nslots: usize,
    pub ops: Vec<OpAt>,
}

/// A shared array: one per declaration per block, whichever function declares it.
#[derive(Debug)]
pub(super) struct SharedDecl {
    pub name: String,
    pub elem: Scalar,
    pub len: u64,
}

/// A lowered kernel.
#[derive(Debug)]
pub(super) struct Lowered {
    pub symbol: String,
    pub block: [u32; 3],
    pub args: Vec<Arg>,
    pub funcs: Vec<LFunc>,
    pub shared: Vec<SharedDecl>,
    /// The kernel calls `grid_wait()` itself (else it runs as if waiting first).
    pub places_grid_wait: bool,
}

/// Lowers a kernel and the device functions it calls.
pub(super) fn lower(ir: &KernelIr) -> Result<Lowered, InterpError> {
    let mut fns: Vec<&DeviceFn> = Vec::new();
    fn collect<'a>(d: &'a DeviceFn, out: &mut Vec<&'a DeviceFn>) {
        if out.iter().any(|e| e.name == d.name) {
            return;
        }
        out.push(d);
        for c in &d.callees {
            collect(c, out);
        }
    }
    for d in &ir.device_fns {
        collect(d, &mut fns);
    }
    let fn_ids: HashMap<String, u32> = fns
        .iter()
        .enumerate()
        .map(|(i, d)| (d.name.clone(), i as u32 + 1))
        .collect();
    let mut cx = Cx {
        fn_ids: &fn_ids,
        shared: Vec::new(),
        symbol: &ir.symbol,
    };
    let mut funcs = vec![cx.lower_fn("kernel".to_string(), &ir.args, &ir.body)?];
    for d in &fns {
        funcs.push(cx.lower_fn(format!("device fn `{}`", d.name), &d.args, &d.body)?);
    }
    Ok(Lowered {
        symbol: ir.symbol.clone(),
        block: ir.block,
        args: ir.args.clone(),
        funcs,
        shared: cx.shared,
        places_grid_wait: crate::render::places_grid_wait(ir),
    })
}

struct Cx<'a> {
    fn_ids: &'a HashMap<String, u32>,
    shared: Vec<SharedDecl>,
    symbol: &'a str,
}

impl Cx<'_> {
    fn lower_fn(&mut self, label: String, args: &[Arg], body: &[Stmt]) -> Result<LFunc, InterpError> {
        let mut f = FnLower {
            cx: self,
            label: &label,
            vars: HashMap::new(),
            views: HashMap::new(),
            nslots: 0,
            ops: Vec::new(),
            loops: Vec::new(),
            loc: Loc::default(),
        };
        for a in args {
            f.declare(&a.name);
        }
        f.stmts(body)?;
        f.emit(Op::Ret(None));
        let (nslots, ops) = (f.nslots as usize, f.ops);
        Ok(LFunc { label, nslots, ops })
    }
}

struct Loop {
    /// Jumps to patch to the loop's continue point and exit.
    continues: Vec<usize>,
    breaks: Vec<usize>,
}

struct FnLower<'c, 'a> {
    cx: &'c mut Cx<'a>,
    label: &'c str,
    vars: HashMap<String, Slot>,
    /// Sub-slices (`let v = &x[a..]`) by name: their buffer `x` (its slot holds `a`).
    views: HashMap<String, Expr>,
    nslots: u32,
    ops: Vec<OpAt>,
    loops: Vec<Loop>,
    loc: Loc,
}

type R<T> = Result<T, InterpError>;

/// The scalar type an expression's value has (untyped integer literals are C `int`).
fn scalar(t: &Ty) -> Scalar {
    match t {
        Ty::Scalar(s) => *s,
        _ => Scalar::I32,
    }
}

/// Whether lowering `e` emits ops (it calls a device function or a warp collective).
fn hoists(e: &Expr) -> bool {
    match &e.kind {
        ExprKind::Lit(_) | ExprKind::Var(_) | ExprKind::Builtin(_) => false,
        ExprKind::Unary(_, a)
        | ExprKind::Cast(a, _)
        | ExprKind::Bitcast(a, _)
        | ExprKind::Field(a, _)
        | ExprKind::AddrOf(a)
        | ExprKind::VecLoad(a) => hoists(a),
        ExprKind::Binary(_, a, b) | ExprKind::Index(a, b) | ExprKind::SubSlice(a, b) => hoists(a) || hoists(b),
        ExprKind::Select(c, a, b) => hoists(c) || hoists(a) || hoists(b),
        ExprKind::Call(f, args) => {
            matches!(f, Func::Device(_))
                || matches!(f, Func::Intrinsic(i) if is_collective(*i))
                || args.iter().any(hoists)
        }
    }
}

/// Intrinsics that all lanes of a warp execute together.
pub(super) fn is_collective(i: Intrinsic) -> bool {
    use Intrinsic::*;
    matches!(
        i,
        SyncWarp
            | ShflXor
            | ShflDown
            | ShflUp
            | ShflIdx
            | Ballot
            | VoteAny
            | VoteAll
            | MmaBf16
            | MmaF16
            | LdmatrixX1
            | LdmatrixX2
            | LdmatrixX4
            | LdmatrixX2Trans
            | LdmatrixX4Trans
            | WgmmaBf16Ss
            | WgmmaBf16RsMn
            | WgmmaBf16Rs
    )
}

/// Collectives that all 128 threads of a warpgroup (four warps from a multiple of 128) execute
/// together.
pub(super) fn is_warpgroup(i: Intrinsic) -> bool {
    matches!(
        i,
        Intrinsic::WgmmaBf16Ss | Intrinsic::WgmmaBf16RsMn | Intrinsic::WgmmaBf16Rs
    )
}

impl FnLower<'_, '_> {
    fn unsupported<T>(&self, what: impl Into<String>) -> R<T> {
        Err(InterpError {
            kernel: self.cx.symbol.to_string(),
            function: self.label.to_string(),
            loc: self.loc,
            block: [0; 3],
            thread: [0; 3],
            hazard: Hazard::Unsupported(what.into()),
        })
    }

    fn declare(&mut self, name: &str) -> Slot {
        let s = self.nslots;
        self.nslots += 1;
        self.vars.insert(name.to_string(), s);
        s
    }

    fn temp(&mut self) -> Slot {
        self.nslots += 1;
        self.nslots - 1
    }

    fn slot(&self, name: &str) -> R<Slot> {
        match self.vars.get(name) {
            Some(s) => Ok(*s),
            None => self.unsupported(format!("unknown variable `{name}`")),
        }
    }

    fn emit(&mut self, op: Op) -> usize {
        self.ops.push(OpAt { op, loc: self.loc });
        self.ops.len() - 1
    }

    fn patch(&mut self, at: usize, target: usize) {
        match &mut self.ops[at].op {
            Op::Jump(t) | Op::JumpIfNot(_, t) => *t = target,
            _ => unreachable!("patching a non-jump"),
        }
    }

    fn stmts(&mut self, body: &[Stmt]) -> R<()> {
        for s in body {
            self.stmt(s)?;
        }
        Ok(())
    }

    fn stmt(&mut self, s: &Stmt) -> R<()> {
        match s {
            Stmt::Let { name, init, loc, .. } => {
                self.loc = *loc;
                if let ExprKind::SubSlice(base, offset) = &init.kind {
                    // The view's slot holds its offset; its indexing goes to `base`.
                    let v = self.expr(offset)?;
                    let slot = self.declare(name);
                    self.emit(Op::Set(slot, v));
                    self.views.insert(name.clone(), (**base).clone());
                    return Ok(());
                }
                let v = self.expr(init)?;
                let slot = self.declare(name);
                self.emit(Op::Set(slot, v));
            }
            Stmt::Array {
                name,
                elem,
                dims,
                space,
                fill,
                loc,
                ..
            } => {
                self.loc = *loc;
                let len: u64 = dims.iter().map(|&d| d as u64).product();
                let slot = self.declare(name);
                match space {
                    Space::Shared => {
                        let id = self.cx.shared.len() as u32;
                        self.cx.shared.push(SharedDecl {
                            name: name.clone(),
                            elem: *elem,
                            len,
                        });
                        self.emit(Op::SharedArray { slot, id });
                    }
                    _ => {
                        let fill = match fill {
                            Some(f) => self.expr(f)?,
                            None => CExpr::Const(Val::Void),
                        };
                        self.emit(Op::LocalArray {
                            slot,
                            len: len as u32,
                            fill,
                        });
                    }
                }
            }
            Stmt::Assign { place, op, value, loc } => {
                self.loc = *loc;
                let v = self.expr(value)?;
                match &place.kind {
                    ExprKind::Var(n) => {
                        let slot = self.slot(n)?;
                        let v = match op {
                            Some(o) => CExpr::Binary(*o, scalar(&place.ty), Box::new(CExpr::Slot(slot)), Box::new(v)),
                            None => v,
                        };
                        self.emit(Op::Set(slot, v));
                    }
                    ExprKind::Field(b, lane) => {
                        let ExprKind::Var(n) = &b.kind else {
                            return self.unsupported("assignment to a lane of a non-variable");
                        };
                        let slot = self.slot(n)?;
                        let v = match op {
                            Some(o) => CExpr::Binary(
                                *o,
                                Scalar::U32,
                                Box::new(CExpr::Field(Box::new(CExpr::Slot(slot)), *lane)),
                                Box::new(v),
                            ),
                            None => v,
                        };
                        self.emit(Op::SetLane(slot, *lane, v));
                    }
                    _ => {
                        let p = self.place(place)?;
                        let v = match op {
                            Some(o) => {
                                CExpr::Binary(*o, p.elem, Box::new(CExpr::Load(Box::new(p.clone()))), Box::new(v))
                            }
                            None => v,
                        };
                        self.emit(Op::Store(p, v));
                    }
                }
            }
            Stmt::VecStore { place, value, loc } => {
                self.loc = *loc;
                let v = self.expr(value)?;
                let p = self.place(place)?;
                self.emit(Op::VecStore(p, v));
            }
            Stmt::Expr(e, loc) => {
                self.loc = *loc;
                match &e.kind {
                    ExprKind::Call(Func::Device(_), _) => {
                        self.call(e, false)?;
                    }
                    ExprKind::Call(Func::Intrinsic(i), _) if is_collective(*i) => {
                        self.call(e, false)?;
                    }
                    _ => {
                        let v = self.expr(e)?;
                        self.emit(Op::Eval(v));
                    }
                }
            }
            Stmt::If {
                cond,
                then_body,
                else_body,
                loc,
            } => {
                self.loc = *loc;
                let c = self.expr(cond)?;
                let br = self.emit(Op::JumpIfNot(c, 0));
                self.stmts(then_body)?;
                if else_body.is_empty() {
                    let end = self.ops.len();
                    self.patch(br, end);
                } else {
                    self.loc = *loc;
                    let j = self.emit(Op::Jump(0));
                    let els = self.ops.len();
                    self.patch(br, els);
                    self.stmts(else_body)?;
                    let end = self.ops.len();
                    self.patch(j, end);
                }
            }
            Stmt::While { cond, body, loc } => {
                self.loc = *loc;
                let top = self.ops.len();
                let c = self.expr(cond)?;
                let br = self.emit(Op::JumpIfNot(c, 0));
                self.loop_body(body, top, br, *loc)?;
            }
            Stmt::For {
                var,
                ty,
                start,
                end,
                step,
                body,
                loc,
                ..
            } => {
                self.loc = *loc;
                let s = self.expr(start)?;
                let slot = self.declare(var);
                self.emit(Op::Set(slot, s));
                let top = self.ops.len();
                let e = self.expr(end)?;
                let cond = CExpr::Binary(BinOp::Lt, *ty, Box::new(CExpr::Slot(slot)), Box::new(e));
                let br = self.emit(Op::JumpIfNot(cond, 0));
                self.loops.push(Loop {
                    continues: Vec::new(),
                    breaks: Vec::new(),
                });
                self.stmts(body)?;
                let lp = self.loops.pop().expect("pushed above");
                let cont = self.ops.len();
                self.loc = *loc;
                let st = self.expr(step)?;
                self.emit(Op::Set(
                    slot,
                    CExpr::Binary(BinOp::Add, *ty, Box::new(CExpr::Slot(slot)), Box::new(st)),
                ));
                self.emit(Op::Jump(top));
                let exit = self.ops.len();
                self.patch(br, exit);
                for c in lp.continues {
                    self.patch(c, cont);
                }
                for b in lp.breaks {
                    self.patch(b, exit);
                }
            }
            Stmt::Break => {
                let j = self.emit(Op::Jump(0));
                match self.loops.last_mut() {
                    Some(l) => l.breaks.push(j),
                    None => return self.unsupported("`break` outside a loop"),
                }
            }
            Stmt::Continue => {
                let j = self.emit(Op::Jump(0));
                match self.loops.last_mut() {
                    Some(l) => l.continues.push(j),
                    None => return self.unsupported("`continue` outside a loop"),
                }
            }
            Stmt::Return(v, loc) => {
                self.loc = *loc;
                let v = match v {
                    Some(e) => Some(self.expr(e)?),
                    None => None,
                };
                self.emit(Op::Ret(v));
            }
            Stmt::SyncThreads(loc) => {
                self.loc = *loc;
                self.emit(Op::Barrier);
            }
        }
        Ok(())
    }

    /// A `while` body: `top` re-evaluates the condition, `br` exits.
    fn loop_body(&mut self, body: &[Stmt], top: usize, br: usize, loc: Loc) -> R<()> {
        self.loops.push(Loop {
            continues: Vec::new(),
            breaks: Vec::new(),
        });
        self.stmts(body)?;
        let lp = self.loops.pop().expect("pushed above");
        self.loc = loc;
        self.emit(Op::Jump(top));
        let exit = self.ops.len();
        self.patch(br, exit);
        for c in lp.continues {
            self.patch(c, top);
        }
        for b in lp.breaks {
            self.patch(b, exit);
        }
        Ok(())
    }

    /// Emits a hoisted call (device function or collective); returns its result slot.
    fn call(&mut self, e: &Expr, want: bool) -> R<Option<Slot>> {
        let ExprKind::Call(f, args) = &e.kind else {
            unreachable!("call() on a non-call")
        };
        let mut cargs = Vec::with_capacity(args.len());
        for a in args {
            cargs.push(self.expr(a)?);
        }
        let dst = (want || e.ty != Ty::Void).then(|| self.temp());
        match f {
            Func::Device(name) => {
                let Some(&func) = self.cx.fn_ids.get(name) else {
                    return self.unsupported(format!("unknown device function `{name}`"));
                };
                self.emit(Op::Call { func, args: cargs, dst });
            }
            Func::Intrinsic(i) => {
                if matches!(i, Intrinsic::WgmmaBf16Ss | Intrinsic::WgmmaBf16Rs) {
                    // The accumulator row's length gives the shape (N = 2 len).
                    let Ty::Ref { len: Some(n), .. } = &args[0].ty else {
                        unreachable!("checked when the kernel was built")
                    };
                    cargs.push(CExpr::Const(Val::U(2 * n)));
                }
                self.emit(Op::Warp {
                    op: *i,
                    args: cargs,
                    dst,
                });
            }
            Func::Math(_) => unreachable!("math calls are not hoisted"),
        }
        Ok(dst)
    }

    fn place(&mut self, e: &Expr) -> R<Place> {
        let mut indices = Vec::new();
        let mut cur = e;
        while let ExprKind::Index(b, i) = &cur.kind {
            indices.push(self.expr(i)?);
            cur = b;
        }
        indices.reverse();
        let ExprKind::Var(name) = &cur.kind else {
            return self.unsupported("indexing something other than a named buffer or array");
        };
        if let Some(base) = self.views.get(name).cloned() {
            // `v[i]` of `v = &x[a..]` is `x[a + i]`, bounds-checked against `x`.
            let off = CExpr::Slot(self.slot(name)?);
            if let Some(first) = indices.first_mut() {
                let i = std::mem::replace(first, CExpr::Const(Val::U(0)));
                *first = CExpr::Binary(BinOp::Add, Scalar::U32, Box::new(off), Box::new(i));
            }
            cur = &base;
            let ExprKind::Var(bname) = &cur.kind else {
                unreachable!("a sub-slice's base is a named buffer (checked when the kernel was built)")
            };
            return self.place_of(bname, cur, indices);
        }
        self.place_of(name, cur, indices)
    }

    /// The place `name[indices]` of the buffer or array `root`.
    fn place_of(&self, name: &str, root_e: &Expr, indices: Vec<CExpr>) -> R<Place> {
        let root = self.slot(name)?;
        let (space, elem, dims) = match &root_e.ty {
            Ty::Slice { elem, .. } => (Space::Global, *elem, Vec::new()),
            Ty::Array { elem, dims, space } => (*space, *elem, dims.clone()),
            other => return self.unsupported(format!("indexing a value of type {other}")),
        };
        Ok(Place {
            root,
            name: name.to_string(),
            space,
            elem,
            dims,
            indices,
        })
    }

    /// Lowers a value (control flow around hoisted calls is emitted as ops).
    fn expr(&mut self, e: &Expr) -> R<CExpr> {
        Ok(match &e.kind {
            ExprKind::Lit(l) => CExpr::Const(match (l, scalar(&e.ty)) {
                (Lit::Bool(b), _) => Val::B(*b),
                (Lit::F32(v), _) => Val::F(*v),
                (Lit::Int(v), Scalar::F32) => Val::F(*v as f32),
                (Lit::Int(v), Scalar::U32) => Val::U(*v as u32),
                (Lit::Int(v), Scalar::U64) => Val::U64(*v as u64),
                (Lit::Int(v), _) => Val::I(*v as i32),
            }),
            ExprKind::Var(n) => CExpr::Slot(self.slot(n)?),
            ExprKind::Builtin(b) => CExpr::Builtin(*b),
            ExprKind::Unary(op, a) => CExpr::Unary(*op, scalar(&a.ty), Box::new(self.expr(a)?)),
            ExprKind::Binary(op @ (BinOp::And | BinOp::Or), a, b) if hoists(b) => {
                // Short-circuit around the hoisted right side.
                let t = self.temp();
                let l = self.expr(a)?;
                self.emit(Op::Set(t, l));
                let test = match op {
                    BinOp::And => CExpr::Slot(t),
                    _ => CExpr::Unary(UnOp::Not, Scalar::Bool, Box::new(CExpr::Slot(t))),
                };
                let br = self.emit(Op::JumpIfNot(test, 0));
                let r = self.expr(b)?;
                self.emit(Op::Set(t, r));
                let end = self.ops.len();
                self.patch(br, end);
                CExpr::Slot(t)
            }
            ExprKind::Binary(op, a, b) => {
                let ty = match (&a.ty, &b.ty) {
                    (Ty::UntypedInt, Ty::Scalar(s)) if !matches!(op, BinOp::Shl | BinOp::Shr) => *s,
                    (t, _) => scalar(t),
                };
                let (l, r) = (self.expr(a)?, self.expr(b)?);
                match op {
                    BinOp::And => CExpr::And(Box::new(l), Box::new(r)),
                    BinOp::Or => CExpr::Or(Box::new(l), Box::new(r)),
                    _ => CExpr::Binary(*op, ty, Box::new(l), Box::new(r)),
                }
            }
            ExprKind::Cast(a, to) => CExpr::Cast(Box::new(self.expr(a)?), scalar(&a.ty), *to),
            ExprKind::Bitcast(a, to) => CExpr::Bitcast(Box::new(self.expr(a)?), *to),
            ExprKind::Index(..) => CExpr::Load(Box::new(self.place(e)?)),
            ExprKind::Field(a, l) => CExpr::Field(Box::new(self.expr(a)?), *l),
            ExprKind::AddrOf(p) => CExpr::AddrOf(Box::new(self.place(p)?)),
            ExprKind::SubSlice(..) => return self.unsupported("a sub-slice outside `let v = &x[a..]`"),
            ExprKind::VecLoad(p) => CExpr::VecLoad(Box::new(self.place(p)?)),
            ExprKind::Select(c, a, b) if hoists(a) || hoists(b) => {
                let t = self.temp();
                let c = self.expr(c)?;
                let br = self.emit(Op::JumpIfNot(c, 0));
                let av = self.expr(a)?;
                self.emit(Op::Set(t, av));
                let j = self.emit(Op::Jump(0));
                let els = self.ops.len();
                self.patch(br, els);
                let bv = self.expr(b)?;
                self.emit(Op::Set(t, bv));
                let end = self.ops.len();
                self.patch(j, end);
                CExpr::Slot(t)
            }
            ExprKind::Select(c, a, b) => CExpr::Select(
                Box::new(self.expr(c)?),
                Box::new(self.expr(a)?),
                Box::new(self.expr(b)?),
            ),
            ExprKind::Call(Func::Math(name), args) => {
                let ty = args.iter().find_map(|a| a.ty.scalar()).unwrap_or(Scalar::U32);
                let mut cargs = Vec::with_capacity(args.len());
                for a in args {
                    cargs.push(self.expr(a)?);
                }
                CExpr::Math(name, ty, cargs)
            }
            ExprKind::Call(Func::Intrinsic(i), args) if !is_collective(*i) => {
                let mut cargs = Vec::with_capacity(args.len());
                for a in args {
                    cargs.push(self.expr(a)?);
                }
                CExpr::Intrinsic(*i, cargs)
            }
            ExprKind::Call(..) => match self.call(e, true)? {
                Some(t) => CExpr::Slot(t),
                None => CExpr::Const(Val::Void),
            },
        })
    }
}
