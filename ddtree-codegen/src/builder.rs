//! [`Builder`]: what `#[kernel]`-generated code calls to assemble a [`KernelIr`].
//!
//! It keeps the statement stack (one list per open block), the variable scopes (DSL name to
//! unique C name and type) and the device functions a kernel calls, and attaches kernel name,
//! file and location to every error.

use std::collections::{HashMap, HashSet};

use crate::error::{CodegenError, OpError, Result};
use crate::ir::{Arg, BinOp, DeviceFn, Expr, ExprKind, KernelIr, Loc, Scalar, Space, Stmt, Ty, Unroll};
use crate::kernel::{symbol, KernelParams};
use crate::ops;

#[derive(Clone, Debug)]
struct Var {
    c_name: String,
    ty: Ty,
    mutable: bool,
}

/// C keywords and names the prelude or CUDA reserve; a DSL variable with such a name gets a
/// trailing underscore.
const RESERVED: &[&str] = &[
    "auto",
    "break",
    "case",
    "char",
    "const",
    "continue",
    "default",
    "do",
    "double",
    "else",
    "enum",
    "extern",
    "float",
    "for",
    "goto",
    "if",
    "int",
    "long",
    "register",
    "return",
    "short",
    "signed",
    "sizeof",
    "static",
    "struct",
    "switch",
    "typedef",
    "union",
    "unsigned",
    "void",
    "volatile",
    "while",
    "bool",
    "true",
    "false",
    "class",
    "new",
    "delete",
    "template",
    "this",
    "inline",
    "bf16",
    "f16",
    "u32x4",
    "threadIdx",
    "blockIdx",
    "blockDim",
    "gridDim",
    "warpSize",
    "max",
    "min",
    "abs",
    "lop3",
    "exp2_approx",
    "prmt",
    "smem_addr",
    "namespace",
    "operator",
    "private",
    "public",
];

/// The most dynamic shared memory a block may ask for: 227 KiB, the opt-in limit of sm_90.
pub const MAX_DYN_SMEM: u32 = 227 * 1024;

/// Assembles the IR of one kernel (or device function) for one parameter set.
#[derive(Debug)]
pub struct Builder {
    name: String,
    file: String,
    params: Vec<(String, String)>,
    symbol: String,
    args: Vec<Arg>,
    block: [u32; 3],
    dyn_smem: u32,
    min_blocks: u32,
    dyn_declared: bool,
    ret: Option<Ty>,
    blocks: Vec<Vec<Stmt>>,
    scopes: Vec<HashMap<String, Var>>,
    used: HashSet<String>,
    device_fns: Vec<DeviceFn>,
}

impl Builder {
    /// Starts a kernel named `name` (defined in `file`) for parameters `p`.
    pub fn kernel<P: KernelParams>(name: &str, file: &str, p: &P) -> Builder {
        let fields = p.fields();
        Builder {
            name: name.to_string(),
            file: file.to_string(),
            params: fields.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            symbol: symbol(name, &fields),
            ..Builder::device_fn(name, file, Ty::Void)
        }
    }

    /// Starts a device function returning `ret`.
    pub fn device_fn(name: &str, file: &str, ret: Ty) -> Builder {
        Builder {
            name: name.to_string(),
            file: file.to_string(),
            params: Vec::new(),
            symbol: name.to_string(),
            args: Vec::new(),
            block: [1, 1, 1],
            dyn_smem: 0,
            min_blocks: 0,
            dyn_declared: false,
            ret: Some(ret),
            blocks: vec![Vec::new()],
            scopes: vec![HashMap::new()],
            used: HashSet::new(),
            device_fns: Vec::new(),
        }
    }

    /// Wraps an operation error with this kernel's name, file and `loc`.
    pub fn err(&self, loc: Loc, e: OpError) -> CodegenError {
        CodegenError {
            kernel: self.name.clone(),
            file: self.file.clone(),
            loc,
            message: e.0,
        }
    }

    /// Lifts an [`OpError`] result into a located one.
    pub fn at<T>(&self, loc: Loc, r: std::result::Result<T, OpError>) -> Result<T> {
        r.map_err(|e| self.err(loc, e))
    }

    /// Fails with `message` at `loc`.
    pub fn fail<T>(&self, loc: Loc, message: impl Into<String>) -> Result<T> {
        Err(self.err(loc, OpError::new(message)))
    }

    fn fresh(&mut self, name: &str) -> String {
        let base = if RESERVED.contains(&name) || name.starts_with("__") {
            format!("{}_", name.trim_start_matches('_'))
        } else {
            name.to_string()
        };
        let mut c = base.clone();
        let mut n = 1;
        while self.used.contains(&c) {
            n += 1;
            c = format!("{base}_{n}");
        }
        self.used.insert(c.clone());
        c
    }

    fn declare(&mut self, name: &str, ty: Ty, mutable: bool) -> String {
        let c_name = self.fresh(name);
        self.scopes.last_mut().expect("scope stack is never empty").insert(
            name.to_string(),
            Var {
                c_name: c_name.clone(),
                ty,
                mutable,
            },
        );
        c_name
    }

    fn lookup(&self, name: &str) -> Option<&Var> {
        self.scopes.iter().rev().find_map(|s| s.get(name))
    }

    fn push(&mut self, s: Stmt) {
        self.blocks.last_mut().expect("block stack is never empty").push(s);
    }

    /// Declares a runtime argument (a scalar, or a slice `&[T]` / `&mut [T]`).
    pub fn arg(&mut self, name: &str, ty: Ty, loc: Loc) -> Result<()> {
        match &ty {
            Ty::Scalar(_) | Ty::Slice { .. } | Ty::U32x4 => {}
            other => return self.fail(loc, format!("argument `{name}` cannot have type {other}")),
        }
        let c_name = self.declare(name, ty.clone(), false);
        self.args.push(Arg { name: c_name, ty });
        Ok(())
    }

    /// Sets the block shape; every dimension must be positive and the product at most 1024.
    pub fn block_dim(&mut self, dims: [i128; 3], loc: Loc) -> Result<()> {
        let mut out = [1u32; 3];
        for (o, d) in out.iter_mut().zip(dims) {
            if !(1..=1024).contains(&d) {
                return self.fail(loc, format!("block dimension {d} is outside 1..=1024"));
            }
            *o = d as u32;
        }
        if out.iter().product::<u32>() > 1024 {
            return self.fail(loc, format!("block {out:?} has more than 1024 threads"));
        }
        self.block = out;
        Ok(())
    }

    /// Sets the bytes of dynamic shared memory every launch passes (`dyn_smem` of `#[kernel]`):
    /// a multiple of 16, at most [`MAX_DYN_SMEM`].
    pub fn dyn_smem(&mut self, bytes: i128, loc: Loc) -> Result<()> {
        if !(0..=MAX_DYN_SMEM as i128).contains(&bytes) || bytes % 16 != 0 {
            return self.fail(
                loc,
                format!("dyn_smem = {bytes} must be a multiple of 16 between 0 and {MAX_DYN_SMEM} bytes"),
            );
        }
        self.dyn_smem = bytes as u32;
        Ok(())
    }

    /// Sets the blocks per SM the kernel's registers must allow (`min_blocks` of `#[kernel]`,
    /// the second `__launch_bounds__` argument): 0 (no bound) to 32.
    pub fn min_blocks(&mut self, blocks: i128, loc: Loc) -> Result<()> {
        if !(0..=32).contains(&blocks) {
            return self.fail(loc, format!("min_blocks = {blocks} must be between 0 and 32"));
        }
        self.min_blocks = blocks as u32;
        Ok(())
    }

    /// A variable reference.
    pub fn var(&self, name: &str, loc: Loc) -> Result<Expr> {
        match self.lookup(name) {
            Some(v) => Ok(Expr {
                kind: ExprKind::Var(v.c_name.clone()),
                ty: v.ty.clone(),
            }),
            None => self.fail(loc, format!("unknown variable `{name}`")),
        }
    }

    /// `let [mut] name[: ty] = init;`
    pub fn let_(&mut self, name: &str, ty: Option<Ty>, init: Expr, mutable: bool, loc: Loc) -> Result<()> {
        let mut init = init;
        let ty = match ty {
            Some(t) => {
                let place = Expr {
                    kind: ExprKind::Var(String::new()),
                    ty: t.clone(),
                };
                init = self.at(loc, ops::check_assign(&place, None, init))?;
                t
            }
            None => {
                ops::default_int(&mut init);
                match &init.ty {
                    Ty::Scalar(_) | Ty::U32x4 => init.ty.clone(),
                    Ty::View { .. } if mutable => {
                        return self.fail(loc, format!("bind the sub-slice `{name}` with `let`, not `let mut`"))
                    }
                    Ty::View { .. } => init.ty.clone(),
                    Ty::Void => return self.fail(loc, format!("`{name}` would have no value")),
                    other => return self.fail(loc, format!("cannot bind a value of type {other} to a variable")),
                }
            }
        };
        let c_name = self.declare(name, ty.clone(), mutable);
        self.push(Stmt::Let {
            name: c_name,
            ty,
            mutable,
            init,
            loc,
        });
        Ok(())
    }

    /// `let a = [fill; d0]` / `[[fill; d1]; d0]` (registers) or `shared::<T>(n)` (shared memory).
    pub fn array(
        &mut self,
        name: &str,
        elem: Scalar,
        dims: Vec<i128>,
        space: Space,
        fill: Option<Expr>,
        loc: Loc,
    ) -> Result<()> {
        let mut ds = Vec::with_capacity(dims.len());
        for d in dims {
            if !(1..=1 << 20).contains(&d) {
                return self.fail(loc, format!("array dimension {d} must be between 1 and 2^20"));
            }
            ds.push(d as u32);
        }
        let fill = match fill {
            Some(f) => Some(self.at(
                loc,
                ops::check_assign(
                    &Expr {
                        kind: ExprKind::Var(String::new()),
                        ty: Ty::Scalar(elem),
                    },
                    None,
                    f,
                ),
            )?),
            None => None,
        };
        let ty = Ty::Array {
            elem,
            dims: ds.clone(),
            space,
        };
        let c_name = self.declare(name, ty, true);
        self.push(Stmt::Array {
            name: c_name,
            elem,
            dims: ds,
            space,
            fill,
            dynamic: false,
            loc,
        });
        Ok(())
    }

    /// `let s = dyn_shared::<T>();`: the kernel's whole dynamic shared memory as `T`s (at most
    /// one per kernel, so no two views alias).
    pub fn dyn_shared(&mut self, name: &str, elem: Scalar, loc: Loc) -> Result<()> {
        if self.dyn_smem == 0 {
            return self.fail(
                loc,
                "`dyn_shared` needs `dyn_smem = <bytes>` (non-zero) in `#[kernel(..)]`",
            );
        }
        if self.dyn_declared {
            return self.fail(
                loc,
                "`dyn_shared` may appear once per kernel: it is the whole dynamic shared memory",
            );
        }
        let size = elem.size();
        if self.dyn_smem % size != 0 {
            return self.fail(loc, format!("dyn_smem = {} is not a multiple of {size}", self.dyn_smem));
        }
        self.dyn_declared = true;
        let dims = vec![self.dyn_smem / size];
        let ty = Ty::Array {
            elem,
            dims: dims.clone(),
            space: Space::Shared,
        };
        let c_name = self.declare(name, ty, true);
        self.push(Stmt::Array {
            name: c_name,
            elem,
            dims,
            space: Space::Shared,
            fill: None,
            dynamic: true,
            loc,
        });
        Ok(())
    }

    /// `place = value` or `place op= value`.
    pub fn assign(&mut self, place: Expr, op: Option<BinOp>, value: Expr, loc: Loc) -> Result<()> {
        let is_mut_var = root_var(&place).is_some_and(|c| self.is_mut_c_name(c));
        self.at(loc, ops::check_writable(&place, is_mut_var))?;
        let value = self.at(loc, ops::check_assign(&place, op, value))?;
        self.push(Stmt::Assign { place, op, value, loc });
        Ok(())
    }

    fn is_mut_c_name(&self, c: &str) -> bool {
        self.scopes
            .iter()
            .flat_map(|s| s.values())
            .any(|v| v.c_name == c && v.mutable)
    }

    /// Runs `f` on this builder: the `#[kernel]` macro builds each block of a kernel in such a
    /// call, so every block's temporaries live in a stack frame of their own.
    pub fn scope(&mut self, f: impl FnOnce(&mut Builder) -> Result<()>) -> Result<()> {
        f(self)
    }

    /// Appends statements built in a nested scope (a bare `{ ... }` block).
    pub fn splice(&mut self, stmts: Vec<Stmt>) {
        for s in stmts {
            self.push(s);
        }
    }

    /// `x.vstore(i, v)`: a 128-bit store.
    pub fn vstore(&mut self, base: Expr, idx: Expr, value: Expr, loc: Loc) -> Result<()> {
        let place = self.at(loc, ops::index(base, idx))?;
        self.at(loc, ops::check_writable(&place, false))?;
        if !matches!(place.ty, Ty::Scalar(_)) {
            return self.fail(loc, "`vstore` needs a slice or 1-D array");
        }
        if value.ty != Ty::U32x4 {
            return self.fail(loc, format!("`vstore` stores a u32x4, found {}", value.ty));
        }
        self.push(Stmt::VecStore { place, value, loc });
        Ok(())
    }

    /// An expression statement at `loc`.
    pub fn expr_stmt(&mut self, e: Expr, loc: Loc) {
        self.push(Stmt::Expr(e, loc));
    }

    /// `__syncthreads()` at `loc`.
    pub fn sync_threads(&mut self, loc: Loc) {
        self.push(Stmt::SyncThreads(loc));
    }

    /// Opens a nested block (and variable scope).
    pub fn open(&mut self) {
        self.blocks.push(Vec::new());
        self.scopes.push(HashMap::new());
    }

    /// Closes the innermost block, returning its statements.
    pub fn close(&mut self) -> Vec<Stmt> {
        self.scopes.pop();
        self.blocks.pop().expect("close() without open()")
    }

    fn cond(&self, c: Expr, what: &str, loc: Loc) -> Result<Expr> {
        if c.ty != Ty::Scalar(Scalar::Bool) {
            return self.fail(loc, format!("`{what}` condition must be bool, found {}", c.ty));
        }
        Ok(c)
    }

    /// `if cond { then } else { els }`.
    pub fn if_(&mut self, cond: Expr, then_body: Vec<Stmt>, else_body: Vec<Stmt>, loc: Loc) -> Result<()> {
        let cond = self.cond(cond, "if", loc)?;
        self.push(Stmt::If {
            cond,
            then_body,
            else_body,
            loc,
        });
        Ok(())
    }

    /// `while cond { body }`.
    pub fn while_(&mut self, cond: Expr, body: Vec<Stmt>, loc: Loc) -> Result<()> {
        let cond = self.cond(cond, "while", loc)?;
        self.push(Stmt::While { cond, body, loc });
        Ok(())
    }

    /// Opens a `for` loop's block and declares its variable; finish with [`Builder::end_for`].
    pub fn begin_for(&mut self, var: &str, start: Expr, end: Expr, step: Option<Expr>, loc: Loc) -> Result<ForHeader> {
        let (mut start, mut end) = (start, end);
        let mut step = step.unwrap_or(Expr {
            kind: ExprKind::Lit(crate::ir::Lit::Int(1)),
            ty: Ty::UntypedInt,
        });
        let ty = [&start.ty, &end.ty, &step.ty]
            .iter()
            .find_map(|t| t.scalar())
            .unwrap_or(Scalar::U32);
        if !ty.is_int() {
            return self.fail(loc, format!("`for` ranges need integers, found {}", ty.rust_name()));
        }
        for (e, what) in [(&mut start, "start"), (&mut end, "end"), (&mut step, "step")] {
            match &e.ty {
                Ty::UntypedInt => ops::fix_untyped(e, ty),
                Ty::Scalar(s) if *s == ty => {}
                other => {
                    return self.fail(
                        loc,
                        format!(
                            "range {what} has type {other}, expected {} (add a cast)",
                            ty.rust_name()
                        ),
                    )
                }
            }
        }
        if let ExprKind::Lit(crate::ir::Lit::Int(s)) = step.kind {
            if s <= 0 {
                return self.fail(loc, "`step_by` must be positive");
            }
        }
        self.open();
        let c_name = self.declare(var, Ty::Scalar(ty), false);
        Ok(ForHeader {
            var: c_name,
            ty,
            start,
            end,
            step,
            loc,
        })
    }

    /// Closes a loop opened with [`Builder::begin_for`].
    pub fn end_for(&mut self, h: ForHeader, unroll: bool) {
        let body = self.close();
        self.push(Stmt::For {
            var: h.var,
            ty: h.ty,
            start: h.start,
            end: h.end,
            step: h.step,
            unroll: if unroll { Unroll::Full } else { Unroll::No },
            body,
            loc: h.loc,
        });
    }

    /// `break`.
    pub fn break_(&mut self) {
        self.push(Stmt::Break);
    }

    /// `continue`.
    pub fn continue_(&mut self) {
        self.push(Stmt::Continue);
    }

    /// `return` / `return value`.
    pub fn return_(&mut self, value: Option<Expr>, loc: Loc) -> Result<()> {
        let ret = self.ret.clone().unwrap_or(Ty::Void);
        let value = match (value, &ret) {
            (None, Ty::Void) => None,
            (Some(v), Ty::Scalar(_) | Ty::U32x4) => {
                let place = Expr {
                    kind: ExprKind::Var(String::new()),
                    ty: ret.clone(),
                };
                Some(self.at(loc, ops::check_assign(&place, None, v))?)
            }
            (None, t) => return self.fail(loc, format!("`return` needs a value of type {t}")),
            (Some(_), _) => return self.fail(loc, "kernels return no value"),
        };
        self.push(Stmt::Return(value, loc));
        Ok(())
    }

    /// A call of a `#[device_fn]`; `def` is its IR, built by its own macro expansion.
    pub fn call_device(&mut self, def: DeviceFn, mut args: Vec<Expr>, loc: Loc) -> Result<Expr> {
        if args.len() != def.args.len() {
            return self.fail(
                loc,
                format!(
                    "`{}` takes {} argument(s), got {}",
                    def.name,
                    def.args.len(),
                    args.len()
                ),
            );
        }
        for (a, p) in args.iter_mut().zip(&def.args) {
            let ok = match (&a.ty, &p.ty) {
                (Ty::UntypedInt, Ty::Scalar(s)) => {
                    ops::fix_untyped(a, *s);
                    true
                }
                (Ty::Slice { elem, mutable }, Ty::Slice { elem: pe, mutable: pm }) => elem == pe && (*mutable || !pm),
                (x, y) => x == y,
            };
            if !ok {
                return self.fail(
                    loc,
                    format!(
                        "argument `{}` of `{}` expects {}, found {}",
                        p.name, def.name, p.ty, a.ty
                    ),
                );
            }
        }
        let ret = def.ret.clone();
        let name = def.name.clone();
        match self.device_fns.iter().find(|d| d.name == name) {
            Some(existing) if *existing != def => {
                return self.fail(loc, format!("two different device functions are named `{name}`"))
            }
            Some(_) => {}
            None => self.device_fns.push(def),
        }
        Ok(Expr {
            kind: ExprKind::Call(crate::ir::Func::Device(name), args),
            ty: ret,
        })
    }

    /// Finishes a kernel.
    pub fn finish(mut self) -> Result<KernelIr> {
        let body = self.blocks.pop().expect("unbalanced blocks");
        if !self.blocks.is_empty() {
            return self.fail(Loc::default(), "internal: unbalanced blocks");
        }
        Ok(KernelIr {
            name: self.name,
            symbol: self.symbol,
            params: self.params,
            args: self.args,
            block: self.block,
            dyn_smem: self.dyn_smem,
            min_blocks: self.min_blocks,
            body,
            device_fns: self.device_fns,
        })
    }

    /// Finishes a device function.
    pub fn finish_device_fn(mut self) -> Result<DeviceFn> {
        let body = self.blocks.pop().expect("unbalanced blocks");
        Ok(DeviceFn {
            name: self.name,
            args: self.args,
            ret: self.ret.unwrap_or(Ty::Void),
            body,
            callees: self.device_fns,
        })
    }
}

fn root_var(e: &Expr) -> Option<&str> {
    match &e.kind {
        ExprKind::Var(c) => Some(c),
        ExprKind::Index(b, _) | ExprKind::Field(b, _) => root_var(b),
        _ => None,
    }
}

/// An open `for` loop, returned by [`Builder::begin_for`].
#[derive(Debug)]
pub struct ForHeader {
    var: String,
    ty: Scalar,
    start: Expr,
    end: Expr,
    step: Expr,
    loc: Loc,
}
