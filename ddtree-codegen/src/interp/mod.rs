//! A CPU interpreter for [`KernelIr`]: runs a kernel variant over a grid with host buffers, so
//! kernels can be checked (and debugged) without a GPU.
//!
//! Every thread of a block is an interpreter state that runs until it reaches a
//! `sync_threads()` barrier, a warp collective (shuffles, votes, `mma`, `ldmatrix`,
//! `sync_warp`) or its end; the scheduler then releases the barrier or executes the collective
//! for the whole warp at once, so warp-synchronous code behaves as on the GPU and every run is
//! deterministic. Blocks run one after another.
//!
//! While interpreting it reports, as an [`InterpError`] carrying the DSL source location, the
//! block and thread: out-of-bounds accesses to global, shared and register memory, misaligned
//! vector accesses, reads of uninitialised shared memory (and of shared memory a `cp.async` has
//! not delivered yet), shared-memory races between barriers (two threads writing one element,
//! a read of another thread's write, a write over another thread's read), barrier divergence
//! (threads exiting or waiting at different barriers), collectives not reached by the whole
//! warp, and integer division by zero.
//!
//! Intrinsics follow the PTX semantics of the prelude helpers: `mma.sync.m16n8k16` with its
//! fragment layouts, `ldmatrix` (x1/x2/x4, `.trans`), `cp.async` as a copy that lands at the
//! matching `cp_async_wait`, `lop3`, `prmt` (default mode, with sign replication), and
//! round-to-nearest-even bf16/f16 conversions (NaN becomes the canonical `0x7fff`).
//! Math functions use Rust's `f32` functions, which may differ from CUDA's in the last ulp.

mod compile;
mod exec;
mod numeric;

use std::fmt;

use half::{bf16, f16};

use crate::error::CodegenError;
use crate::ir::{KernelIr, Loc, Scalar, Space, Ty};

/// A kernel variant lowered for the interpreter; build once, launch many times.
#[derive(Debug)]
pub struct Program {
    inner: compile::Lowered,
}

impl Program {
    /// Lowers a kernel's IR.
    pub fn new(ir: &KernelIr) -> Result<Program, InterpError> {
        Ok(Program {
            inner: compile::lower(ir)?,
        })
    }

    /// Lowers the variant of kernel `K` for `params`.
    pub fn of<K: crate::Kernel>(params: &K::Params) -> Result<Program, LoadError> {
        Ok(Program::new(&K::ir(params)?)?)
    }

    /// The kernel symbol.
    pub fn symbol(&self) -> &str {
        &self.inner.symbol
    }

    /// The block shape.
    pub fn block(&self) -> [u32; 3] {
        self.inner.block
    }

    /// Runs the kernel over `grid` with `args` in signature order (slices as buffers of the
    /// same element type, scalars as values). Stops at the first hazard.
    pub fn launch(&self, grid: [u32; 3], args: &mut [HostArg<'_>]) -> Result<(), InterpError> {
        exec::launch(&self.inner, grid, args)
    }
}

/// Why a kernel could not be lowered: its IR failed to build, or uses something the
/// interpreter does not support.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Building the IR failed.
    #[error(transparent)]
    Codegen(#[from] CodegenError),
    /// Lowering failed.
    #[error(transparent)]
    Interp(#[from] InterpError),
}

/// A host buffer standing in for a global-memory slice argument: bytes plus an element type.
#[derive(Clone, Debug, PartialEq)]
pub struct Buffer {
    elem: Scalar,
    bytes: Vec<u8>,
}

impl Buffer {
    /// A buffer holding a copy of `v`.
    pub fn from_slice<T: Element>(v: &[T]) -> Buffer {
        let mut bytes = Vec::with_capacity(v.len() * T::SCALAR.size() as usize);
        for x in v {
            x.write(&mut bytes);
        }
        Buffer { elem: T::SCALAR, bytes }
    }

    /// The contents as `T` (which must be the element type).
    pub fn to_vec<T: Element>(&self) -> Vec<T> {
        assert_eq!(self.elem, T::SCALAR, "Buffer::to_vec: element type mismatch");
        self.bytes
            .chunks_exact(T::SCALAR.size() as usize)
            .map(T::read)
            .collect()
    }

    /// Element type.
    pub fn elem(&self) -> Scalar {
        self.elem
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.elem.size() as usize
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// Host types that can fill a [`Buffer`]: the DSL scalars.
pub trait Element: Copy + 'static {
    /// The DSL scalar type.
    const SCALAR: Scalar;
    /// Appends the little-endian bytes.
    fn write(self, out: &mut Vec<u8>);
    /// Reads one value from its little-endian bytes.
    fn read(bytes: &[u8]) -> Self;
}

macro_rules! element {
    ($($t:ty => $s:ident),*) => {$(
        impl Element for $t {
            const SCALAR: Scalar = Scalar::$s;
            fn write(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn read(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("element size"))
            }
        }
    )*};
}
element!(f32 => F32, u32 => U32, i32 => I32, u64 => U64, bf16 => Bf16, f16 => F16);

/// A scalar kernel argument.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value {
    /// f32.
    F32(f32),
    /// u32.
    U32(u32),
    /// i32.
    I32(i32),
    /// u64.
    U64(u64),
    /// bool.
    Bool(bool),
    /// bf16.
    Bf16(bf16),
    /// f16.
    F16(f16),
}

impl Value {
    /// Its DSL type.
    pub fn scalar(self) -> Scalar {
        match self {
            Value::F32(_) => Scalar::F32,
            Value::U32(_) => Scalar::U32,
            Value::I32(_) => Scalar::I32,
            Value::U64(_) => Scalar::U64,
            Value::Bool(_) => Scalar::Bool,
            Value::Bf16(_) => Scalar::Bf16,
            Value::F16(_) => Scalar::F16,
        }
    }
}

macro_rules! value_from {
    ($($t:ty => $v:ident),*) => {$(
        impl From<$t> for Value {
            fn from(x: $t) -> Value {
                Value::$v(x)
            }
        }
    )*};
}
value_from!(f32 => F32, u32 => U32, i32 => I32, u64 => U64, bool => Bool, bf16 => Bf16, f16 => F16);

/// One kernel argument for [`Program::launch`].
#[derive(Debug)]
pub enum HostArg<'a> {
    /// A read-only slice `&[T]`.
    In(&'a Buffer),
    /// A writable slice `&mut [T]`.
    Out(&'a mut Buffer),
    /// A scalar.
    Scalar(Value),
}

/// Which two accesses race.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RaceKind {
    /// Two threads wrote the element with no barrier between.
    WriteWrite,
    /// A thread read an element another thread wrote with no barrier between.
    ReadAfterWrite,
    /// A thread wrote an element another thread read with no barrier between.
    WriteAfterRead,
}

/// What went wrong while interpreting.
#[derive(Clone, Debug, PartialEq)]
pub enum Hazard {
    /// An index outside a buffer or array.
    OutOfBounds {
        /// Buffer, shared array or register array name.
        buffer: String,
        /// Where it lives.
        space: Space,
        /// The element index.
        index: i64,
        /// Its length in elements.
        len: u64,
        /// Whether the access was a write.
        write: bool,
    },
    /// A vector access (16-byte load/store, a `cp.async` of 4, 8 or 16 bytes, an `ldmatrix`
    /// row) not aligned to its size.
    Misaligned {
        /// Buffer or shared array name.
        buffer: String,
        /// The element index.
        index: u64,
        /// The access size in bytes.
        bytes: u32,
    },
    /// A read of shared memory no thread has written.
    UninitializedRead {
        /// Shared array name.
        buffer: String,
        /// The element index.
        index: u64,
    },
    /// A read of shared memory a `cp.async` of this block has not delivered yet (no
    /// `cp_async_wait` for it).
    ReadBeforeWait {
        /// Shared array name.
        buffer: String,
        /// The element index.
        index: u64,
    },
    /// A global write before `grid_wait()` in a kernel that calls it: under programmatic
    /// dependent launch the previous kernel may still read the buffer.
    WriteBeforeGridWait {
        /// Buffer name.
        buffer: String,
    },
    /// Two threads access one shared element without a barrier between, one of them writing.
    Race {
        /// Which accesses.
        kind: RaceKind,
        /// Shared array name.
        buffer: String,
        /// The element index.
        index: u64,
        /// The other thread (x, y, z).
        other: [u32; 3],
    },
    /// Threads of a block exited or waited at different barriers.
    BarrierDivergence(String),
    /// A thread waits at an `mbar_wait` for a phase that can no longer complete: every other
    /// thread is blocked too, waits at a barrier or has exited.
    Deadlock(String),
    /// A warp collective was not reached by every lane of the warp at the same place.
    WarpDivergence(String),
    /// Integer division or remainder by zero.
    DivisionByZero,
    /// The arguments or grid do not fit the kernel.
    InvalidLaunch(String),
    /// Something the interpreter does not implement.
    Unsupported(String),
    /// More interpreted steps in one launch than the interpreter allows (2^32: an endless loop?).
    StepLimit,
}

impl fmt::Display for Hazard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let space = |s: &Space| match s {
            Space::Global => "global buffer",
            Space::Shared => "shared array",
            Space::Local => "register array",
        };
        match self {
            Hazard::OutOfBounds {
                buffer,
                space: s,
                index,
                len,
                write,
            } => write!(
                f,
                "out-of-bounds {} of {} `{buffer}` at index {index} (length {len})",
                if *write { "write" } else { "read" },
                space(s)
            ),
            Hazard::Misaligned { buffer, index, bytes } => {
                write!(
                    f,
                    "{bytes}-byte access to `{buffer}` at index {index} is not {bytes}-byte aligned"
                )
            }
            Hazard::UninitializedRead { buffer, index } => {
                write!(f, "read of uninitialised shared memory `{buffer}`[{index}]")
            }
            Hazard::ReadBeforeWait { buffer, index } => write!(
                f,
                "read of shared memory `{buffer}`[{index}] before the cp.async writing it was waited for"
            ),
            Hazard::WriteBeforeGridWait { buffer } => write!(
                f,
                "write to global buffer `{buffer}` before `grid_wait()`: the previous kernel may still read it"
            ),
            Hazard::Race {
                kind,
                buffer,
                index,
                other,
            } => {
                let what = match kind {
                    RaceKind::WriteWrite => "write after another thread's write",
                    RaceKind::ReadAfterWrite => "read of another thread's write",
                    RaceKind::WriteAfterRead => "write over another thread's read",
                };
                write!(
                    f,
                    "shared-memory race on `{buffer}`[{index}]: {what} (thread {other:?}) with no barrier between"
                )
            }
            Hazard::BarrierDivergence(s) => write!(f, "barrier divergence: {s}"),
            Hazard::Deadlock(s) => write!(f, "deadlock: {s}"),
            Hazard::WarpDivergence(s) => write!(f, "warp divergence: {s}"),
            Hazard::DivisionByZero => f.write_str("integer division by zero"),
            Hazard::InvalidLaunch(s) => write!(f, "invalid launch: {s}"),
            Hazard::Unsupported(s) => write!(f, "not supported by the interpreter: {s}"),
            Hazard::StepLimit => write!(f, "more than {} interpreted steps", exec::STEP_LIMIT),
        }
    }
}

/// A hazard with where it happened.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("kernel `{kernel}`, {function} at {loc}, block {block:?}, thread {thread:?}: {hazard}")]
pub struct InterpError {
    /// Kernel symbol.
    pub kernel: String,
    /// `kernel` or `device fn NAME`: the function the location is in.
    pub function: String,
    /// DSL source location (line:column; 0:0 when unknown).
    pub loc: Loc,
    /// Block index.
    pub block: [u32; 3],
    /// Thread index within the block.
    pub thread: [u32; 3],
    /// What went wrong.
    pub hazard: Hazard,
}

/// Checks that `args` match the kernel signature.
fn check_args(k: &compile::Lowered, args: &[HostArg<'_>]) -> Result<(), Hazard> {
    if args.len() != k.args.len() {
        return Err(Hazard::InvalidLaunch(format!(
            "the kernel takes {} arguments, got {}",
            k.args.len(),
            args.len()
        )));
    }
    for (a, p) in args.iter().zip(&k.args) {
        let ok = match (a, &p.ty) {
            (HostArg::In(b), Ty::Slice { elem, mutable: false }) => b.elem == *elem,
            (HostArg::Out(b), Ty::Slice { elem, .. }) => b.elem == *elem,
            (HostArg::Scalar(v), Ty::Scalar(s)) => v.scalar() == *s,
            _ => false,
        };
        if !ok {
            let got = match a {
                HostArg::In(b) => format!("&[{}]", b.elem.rust_name()),
                HostArg::Out(b) => format!("&mut [{}]", b.elem.rust_name()),
                HostArg::Scalar(v) => v.scalar().rust_name().to_string(),
            };
            return Err(Hazard::InvalidLaunch(format!(
                "argument `{}` is {}, got {got}",
                p.name, p.ty
            )));
        }
    }
    Ok(())
}
