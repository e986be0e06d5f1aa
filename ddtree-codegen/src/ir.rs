//! The kernel IR: a small typed tree of statements and expressions.
//!
//! The `#[kernel]` macro turns a kernel body into Rust code that builds this IR for one set of
//! compile-time parameters (see [`crate::Builder`]); [`crate::render`] prints it as CUDA C.

use std::fmt;

/// A source location in the user's DSL code (1-based line and column; 0 when unknown).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Loc {
    /// 1-based line.
    pub line: u32,
    /// 1-based column.
    pub col: u32,
}

impl fmt::Display for Loc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.col)
    }
}

/// Scalar element types of the DSL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scalar {
    /// 32-bit float.
    F32,
    /// bfloat16, stored as raw bits; no arithmetic (convert with `as f32`).
    Bf16,
    /// IEEE half, stored as raw bits; no arithmetic (convert with `as f32`).
    F16,
    /// 32-bit unsigned integer.
    U32,
    /// 32-bit signed integer.
    I32,
    /// 64-bit unsigned integer.
    U64,
    /// Boolean.
    Bool,
}

impl Scalar {
    /// The DSL (Rust) spelling.
    pub fn rust_name(self) -> &'static str {
        match self {
            Scalar::F32 => "f32",
            Scalar::Bf16 => "bf16",
            Scalar::F16 => "f16",
            Scalar::U32 => "u32",
            Scalar::I32 => "i32",
            Scalar::U64 => "u64",
            Scalar::Bool => "bool",
        }
    }

    /// Parses a DSL type name.
    pub fn from_rust_name(name: &str) -> Option<Scalar> {
        Some(match name {
            "f32" => Scalar::F32,
            "bf16" => Scalar::Bf16,
            "f16" => Scalar::F16,
            "u32" => Scalar::U32,
            "i32" => Scalar::I32,
            "u64" => Scalar::U64,
            "bool" => Scalar::Bool,
            _ => return None,
        })
    }

    /// Integer types (u32, i32, u64).
    pub fn is_int(self) -> bool {
        matches!(self, Scalar::U32 | Scalar::I32 | Scalar::U64)
    }

    /// 16-bit float storage types that allow no arithmetic.
    pub fn is_half(self) -> bool {
        matches!(self, Scalar::Bf16 | Scalar::F16)
    }

    /// Size in bytes.
    pub fn size(self) -> u32 {
        match self {
            Scalar::Bf16 | Scalar::F16 => 2,
            Scalar::Bool => 1,
            Scalar::U64 => 8,
            _ => 4,
        }
    }
}

/// Where an array or a reference lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Space {
    /// Global memory (kernel slice arguments).
    Global,
    /// Block-shared memory.
    Shared,
    /// Per-thread registers (local arrays).
    Local,
}

/// Types of IR values.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Ty {
    /// A scalar.
    Scalar(Scalar),
    /// An integer literal whose type is not fixed yet; it adopts the type of the other operand.
    UntypedInt,
    /// Four u32 lanes (16 bytes), the result of a 128-bit vector load.
    U32x4,
    /// A global slice argument (`&[T]` or `&mut [T]`).
    Slice {
        /// Element type.
        elem: Scalar,
        /// Whether the kernel may write it.
        mutable: bool,
    },
    /// A shared or register array; `dims` outermost first.
    Array {
        /// Element type.
        elem: Scalar,
        /// Dimensions, outermost first.
        dims: Vec<u32>,
        /// Shared or local.
        space: Space,
    },
    /// A sub-slice `&x[a..]` / `&mut x[a..]` of a global slice or a 1-D shared array, bound by
    /// `let`: indexed (and passed on as `&v[i]`) like its base, from element `a` on. It is a
    /// pointer in the CUDA C, so constant offsets from it fold into the loads' addresses.
    View {
        /// Element type.
        elem: Scalar,
        /// Global or shared.
        space: Space,
        /// Whether it was taken with `&mut` (writes through it are allowed).
        mutable: bool,
    },
    /// A pointer made by `&x[i]` / `&mut a[j]`: passed to intrinsics only.
    Ref {
        /// Element type.
        elem: Scalar,
        /// Memory space pointed into.
        space: Space,
        /// Number of elements when it names a whole register row (`&mut acc[j]`), else `None`.
        len: Option<u32>,
        /// Whether it was taken with `&mut`.
        mutable: bool,
    },
    /// No value (calls of void helpers).
    Void,
}

impl Ty {
    /// The scalar type, if this is one.
    pub fn scalar(&self) -> Option<Scalar> {
        match self {
            Ty::Scalar(s) => Some(*s),
            _ => None,
        }
    }
}

impl fmt::Display for Ty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ty::Scalar(s) => f.write_str(s.rust_name()),
            Ty::UntypedInt => f.write_str("{integer}"),
            Ty::U32x4 => f.write_str("u32x4"),
            Ty::Slice { elem, mutable } => {
                write!(f, "&{}[{}]", if *mutable { "mut " } else { "" }, elem.rust_name())
            }
            Ty::Array { elem, dims, space } => {
                let mut s = elem.rust_name().to_string();
                for d in dims.iter().rev() {
                    s = format!("[{s}; {d}]");
                }
                let sp = match space {
                    Space::Shared => "shared ",
                    _ => "",
                };
                write!(f, "{sp}{s}")
            }
            Ty::View { elem, space, mutable } => {
                let m = if *mutable { "mut " } else { "" };
                let sp = if *space == Space::Shared { "shared" } else { "global" };
                write!(f, "&{m}[{}] ({sp} sub-slice)", elem.rust_name())
            }
            Ty::Ref {
                elem,
                space,
                len,
                mutable,
            } => {
                let m = if *mutable { "mut " } else { "" };
                let sp = match space {
                    Space::Global => "global",
                    Space::Shared => "shared",
                    Space::Local => "register",
                };
                match len {
                    Some(n) => write!(f, "&{m}[{}; {n}] ({sp})", elem.rust_name()),
                    None => write!(f, "&{m}{} ({sp})", elem.rust_name()),
                }
            }
            Ty::Void => f.write_str("()"),
        }
    }
}

/// A literal value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Lit {
    /// Integer literal (typed or untyped, see the expression's [`Ty`]).
    Int(i128),
    /// Float literal (f32).
    F32(f32),
    /// Boolean literal.
    Bool(bool),
}

/// Binary operators.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum BinOp {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    BitAnd,
    BitOr,
    BitXor,
    Shl,
    Shr,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    And,
    Or,
}

impl BinOp {
    /// The C spelling.
    pub fn c_str(self) -> &'static str {
        use BinOp::*;
        match self {
            Add => "+",
            Sub => "-",
            Mul => "*",
            Div => "/",
            Rem => "%",
            BitAnd => "&",
            BitOr => "|",
            BitXor => "^",
            Shl => "<<",
            Shr => ">>",
            Eq => "==",
            Ne => "!=",
            Lt => "<",
            Le => "<=",
            Gt => ">",
            Ge => ">=",
            And => "&&",
            Or => "||",
        }
    }

    /// C precedence (higher binds tighter).
    pub fn precedence(self) -> u8 {
        use BinOp::*;
        match self {
            Mul | Div | Rem => 10,
            Add | Sub => 9,
            Shl | Shr => 8,
            Lt | Le | Gt | Ge => 7,
            Eq | Ne => 6,
            BitAnd => 5,
            BitXor => 4,
            BitOr => 3,
            And => 2,
            Or => 1,
        }
    }

    /// Comparison operators (result `bool`).
    pub fn is_comparison(self) -> bool {
        use BinOp::*;
        matches!(self, Eq | Ne | Lt | Le | Gt | Ge)
    }
}

/// Unary operators.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnOp {
    /// Arithmetic negation.
    Neg,
    /// Logical not on `bool`, bitwise not on integers.
    Not,
}

/// Thread-geometry builtins.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum Builtin {
    ThreadIdxX,
    ThreadIdxY,
    ThreadIdxZ,
    BlockIdxX,
    BlockIdxY,
    BlockIdxZ,
    BlockDimX,
    BlockDimY,
    BlockDimZ,
    GridDimX,
    GridDimY,
    GridDimZ,
    /// `threadIdx.x & 31`.
    LaneId,
    /// `threadIdx.x >> 5`.
    WarpId,
}

impl Builtin {
    /// The DSL function name that yields this builtin.
    pub fn from_dsl(name: &str) -> Option<Builtin> {
        use Builtin::*;
        Some(match name {
            "thread_idx_x" => ThreadIdxX,
            "thread_idx_y" => ThreadIdxY,
            "thread_idx_z" => ThreadIdxZ,
            "block_idx_x" => BlockIdxX,
            "block_idx_y" => BlockIdxY,
            "block_idx_z" => BlockIdxZ,
            "block_dim_x" => BlockDimX,
            "block_dim_y" => BlockDimY,
            "block_dim_z" => BlockDimZ,
            "grid_dim_x" => GridDimX,
            "grid_dim_y" => GridDimY,
            "grid_dim_z" => GridDimZ,
            "lane_id" => LaneId,
            "warp_id" => WarpId,
            _ => return None,
        })
    }

    /// The C expression.
    pub fn c_str(self) -> &'static str {
        use Builtin::*;
        match self {
            ThreadIdxX => "threadIdx.x",
            ThreadIdxY => "threadIdx.y",
            ThreadIdxZ => "threadIdx.z",
            BlockIdxX => "blockIdx.x",
            BlockIdxY => "blockIdx.y",
            BlockIdxZ => "blockIdx.z",
            BlockDimX => "blockDim.x",
            BlockDimY => "blockDim.y",
            BlockDimZ => "blockDim.z",
            GridDimX => "gridDim.x",
            GridDimY => "gridDim.y",
            GridDimZ => "gridDim.z",
            LaneId => "(threadIdx.x & 31u)",
            WarpId => "(threadIdx.x >> 5)",
        }
    }
}

/// Functions an expression may call: math, warp collectives, atomics, memory and PTX intrinsics,
/// and user device functions.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Func {
    /// A math function on f32 (or min/max/abs on integers); the C name.
    Math(&'static str),
    /// A warp collective, atomic or intrinsic with a prelude helper; see [`crate::intrinsics`].
    Intrinsic(crate::intrinsics::Intrinsic),
    /// A `#[device_fn]` by name.
    Device(String),
}

/// A 32-bit lane of a [`Ty::U32x4`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum Lane {
    X,
    Y,
    Z,
    W,
}

impl Lane {
    /// Lane from a field name.
    pub fn from_name(name: &str) -> Option<Lane> {
        Some(match name {
            "x" => Lane::X,
            "y" => Lane::Y,
            "z" => Lane::Z,
            "w" => Lane::W,
            _ => return None,
        })
    }

    /// The field name.
    pub fn name(self) -> &'static str {
        match self {
            Lane::X => "x",
            Lane::Y => "y",
            Lane::Z => "z",
            Lane::W => "w",
        }
    }
}

/// An expression with its type.
#[derive(Clone, Debug, PartialEq)]
pub struct Expr {
    /// What it computes.
    pub kind: ExprKind,
    /// Its type.
    pub ty: Ty,
}

/// Expression forms.
#[derive(Clone, Debug, PartialEq)]
pub enum ExprKind {
    /// A literal.
    Lit(Lit),
    /// A variable, argument or array by its C name.
    Var(String),
    /// A thread-geometry builtin.
    Builtin(Builtin),
    /// Unary operation.
    Unary(UnOp, Box<Expr>),
    /// Binary operation.
    Binary(BinOp, Box<Expr>, Box<Expr>),
    /// Numeric conversion `x as T` (bf16/f16 conversions go through prelude helpers).
    Cast(Box<Expr>, Scalar),
    /// Bit reinterpretation between f32 and u32 (`to_bits` / `f32::from_bits`).
    Bitcast(Box<Expr>, Scalar),
    /// Indexing a slice or array.
    Index(Box<Expr>, Box<Expr>),
    /// A lane of a `u32x4`.
    Field(Box<Expr>, Lane),
    /// `&x[i]`: the address of an element, or a whole row of a 2-D register array.
    AddrOf(Box<Expr>),
    /// `&x[a..]`: the sub-slice of the named buffer `x` (a [`ExprKind::Var`]) from element `a`.
    SubSlice(Box<Expr>, Box<Expr>),
    /// A 128-bit load at `&slice[i]` (must be 16-byte aligned).
    VecLoad(Box<Expr>),
    /// A call.
    Call(Func, Vec<Expr>),
    /// `c ? a : b`.
    Select(Box<Expr>, Box<Expr>, Box<Expr>),
}

/// How a `for` loop is unrolled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unroll {
    /// No pragma.
    No,
    /// `#pragma unroll`.
    Full,
}

/// Statements.
#[derive(Clone, Debug, PartialEq)]
pub enum Stmt {
    /// A local scalar or vector variable.
    Let {
        /// C name.
        name: String,
        /// Type.
        ty: Ty,
        /// Whether it is reassigned (otherwise emitted `const`).
        mutable: bool,
        /// Initial value.
        init: Expr,
        /// Where it is in the DSL source.
        loc: Loc,
    },
    /// A shared or register array.
    Array {
        /// C name.
        name: String,
        /// Element type.
        elem: Scalar,
        /// Dimensions, outermost first.
        dims: Vec<u32>,
        /// Shared or local.
        space: Space,
        /// Value every element starts with (local arrays only).
        fill: Option<Expr>,
        /// The kernel's dynamic shared memory (`dyn_shared::<T>()`, `extern __shared__`), whose
        /// size the launch gives; `dims` is that size in elements.
        dynamic: bool,
        /// Where it is in the DSL source.
        loc: Loc,
    },
    /// `place = value` or `place op= value`.
    Assign {
        /// A variable, an indexed element or a vector lane.
        place: Expr,
        /// Compound operator, if any.
        op: Option<BinOp>,
        /// The value.
        value: Expr,
        /// Where it is in the DSL source.
        loc: Loc,
    },
    /// A 128-bit store of `value` at `&slice[i]` (`place` is the indexed element).
    VecStore {
        /// The indexed element whose address is stored to.
        place: Expr,
        /// The `u32x4` value.
        value: Expr,
        /// Where it is in the DSL source.
        loc: Loc,
    },
    /// An expression evaluated for its effect, and where it is in the DSL source.
    Expr(Expr, Loc),
    /// `if`.
    If {
        /// Condition (`bool`).
        cond: Expr,
        /// Then branch.
        then_body: Vec<Stmt>,
        /// Else branch (empty: none).
        else_body: Vec<Stmt>,
        /// Where it is in the DSL source.
        loc: Loc,
    },
    /// `while`.
    While {
        /// Condition.
        cond: Expr,
        /// Body.
        body: Vec<Stmt>,
        /// Where it is in the DSL source.
        loc: Loc,
    },
    /// `for var in (start..end).step_by(step)`.
    For {
        /// Loop variable C name.
        var: String,
        /// Loop variable type.
        ty: Scalar,
        /// Start (inclusive).
        start: Expr,
        /// End (exclusive).
        end: Expr,
        /// Step (positive).
        step: Expr,
        /// Unrolling.
        unroll: Unroll,
        /// Body.
        body: Vec<Stmt>,
        /// Where it is in the DSL source.
        loc: Loc,
    },
    /// `break`.
    Break,
    /// `continue`.
    Continue,
    /// `return` (with a value only in device functions), and where it is in the DSL source.
    Return(Option<Expr>, Loc),
    /// `__syncthreads()`, and where it is in the DSL source.
    SyncThreads(Loc),
}

/// A kernel or device-function argument.
#[derive(Clone, Debug, PartialEq)]
pub struct Arg {
    /// Name (also the C name).
    pub name: String,
    /// Type: a scalar or a slice.
    pub ty: Ty,
}

/// A `#[device_fn]` helper.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceFn {
    /// Name (also the C name).
    pub name: String,
    /// Arguments.
    pub args: Vec<Arg>,
    /// Return type (`Void` for none).
    pub ret: Ty,
    /// Body.
    pub body: Vec<Stmt>,
    /// Device functions this one calls, in first-use order.
    pub callees: Vec<DeviceFn>,
}

/// One kernel specialised for one set of compile-time parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelIr {
    /// Kernel name (the DSL function name).
    pub name: String,
    /// The `extern "C"` symbol: name plus every parameter value.
    pub symbol: String,
    /// Every compile-time parameter as (name, value), in declaration order.
    pub params: Vec<(String, String)>,
    /// Runtime arguments in signature order.
    pub args: Vec<Arg>,
    /// Block dimensions (x, y, z); their product is the `__launch_bounds__`.
    pub block: [u32; 3],
    /// Bytes of dynamic shared memory every launch passes (`dyn_smem` of `#[kernel]`; 0: none).
    pub dyn_smem: u32,
    /// Blocks per SM the registers must allow (`min_blocks` of `#[kernel]`, the second
    /// `__launch_bounds__` argument; 0: none).
    pub min_blocks: u32,
    /// Body.
    pub body: Vec<Stmt>,
    /// Device functions called, in first-use order.
    pub device_fns: Vec<DeviceFn>,
}

impl KernelIr {
    /// Threads per block.
    pub fn threads(&self) -> u32 {
        self.block.iter().product()
    }

    /// Bytes of static shared memory the kernel declares (the dynamic block not included).
    pub fn shared_bytes(&self) -> u64 {
        fn walk(stmts: &[Stmt], acc: &mut u64) {
            for s in stmts {
                match s {
                    Stmt::Array {
                        elem,
                        dims,
                        space: Space::Shared,
                        dynamic: false,
                        ..
                    } => {
                        *acc += dims.iter().map(|&d| d as u64).product::<u64>() * elem.size() as u64;
                    }
                    Stmt::If {
                        then_body, else_body, ..
                    } => {
                        walk(then_body, acc);
                        walk(else_body, acc);
                    }
                    Stmt::While { body, .. } | Stmt::For { body, .. } => walk(body, acc),
                    _ => {}
                }
            }
        }
        let mut acc = 0;
        walk(&self.body, &mut acc);
        acc
    }
}
