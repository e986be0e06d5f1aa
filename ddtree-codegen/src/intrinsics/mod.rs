//! The DSL's built-in functions: warp collectives, atomics, bf16/f16 packing and the PTX
//! intrinsics that map to small inline-assembly helpers in the emitted prelude.

use crate::error::{op_bail, OpError};
use crate::ir::{Expr, ExprKind, Lit, Scalar, Space, Ty};

mod prelude;
pub use prelude::Helper;

/// Built-in functions with a fixed signature.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Intrinsic {
    /// `sync_warp()`: `__syncwarp()`.
    SyncWarp,
    /// `thread_fence()`: `__threadfence()`, orders this thread's global writes before its later
    /// writes for every thread of the device (the "last block" pattern: write, fence, count).
    ThreadFence,
    /// `shfl_xor(v, lane_mask)`.
    ShflXor,
    /// `shfl_down(v, delta)`.
    ShflDown,
    /// `shfl_up(v, delta)`.
    ShflUp,
    /// `shfl_idx(v, src_lane)`.
    ShflIdx,
    /// `ballot(pred) -> u32`.
    Ballot,
    /// `vote_any(pred) -> bool`.
    VoteAny,
    /// `vote_all(pred) -> bool`.
    VoteAll,
    /// `atomic_add(&mut x[i], v)` (also `x.atomic_add(i, v)`): returns the old value.
    AtomicAdd,
    /// `atomic_max`.
    AtomicMax,
    /// `atomic_min`.
    AtomicMin,
    /// `atomic_or`.
    AtomicOr,
    /// `atomic_and`.
    AtomicAnd,
    /// `atomic_exch`.
    AtomicExch,
    /// `atomic_cas(&mut x[i], compare, value)`.
    AtomicCas,
    /// `pack_bf16x2(lo: f32, hi: f32) -> u32`, round to nearest even.
    PackBf16x2,
    /// `bf16_lo(u32) -> f32`: the low half as bf16.
    Bf16Lo,
    /// `bf16_hi(u32) -> f32`: the high half as bf16.
    Bf16Hi,
    /// `pack_f16x2(lo: f32, hi: f32) -> u32`.
    PackF16x2,
    /// `f16_lo(u32) -> f32`.
    F16Lo,
    /// `f16_hi(u32) -> f32`.
    F16Hi,
    /// `mma_m16n8k16_bf16(&mut d: [f32; 4], &a: [u32; 4], &b: [u32; 2])`: d += a * b.
    MmaBf16,
    /// `mma_m16n8k16_f16(&mut d: [f32; 4], &a: [u32; 4], &b: [u32; 2])`: d += a * b.
    MmaF16,
    /// `ldmatrix_x1(&mut r: [u32; 1], &shared[i])`.
    LdmatrixX1,
    /// `ldmatrix_x2(&mut r: [u32; 2], &shared[i])`.
    LdmatrixX2,
    /// `ldmatrix_x4(&mut r: [u32; 4], &shared[i])`.
    LdmatrixX4,
    /// `ldmatrix_x2_trans(&mut r: [u32; 2], &shared[i])`.
    LdmatrixX2Trans,
    /// `ldmatrix_x4_trans(&mut r: [u32; 4], &shared[i])`.
    LdmatrixX4Trans,
    /// `cp_async_16(&mut shared[i], &global[j])`: 16-byte asynchronous copy.
    CpAsync16,
    /// `cp_async_16_zfill(&mut shared[i], &global[j], pred)`: copies 16 bytes when `pred`, else
    /// writes 16 zero bytes without reading.
    CpAsync16Zfill,
    /// `cp_async_8(&mut shared[i], &global[j])`: 8-byte asynchronous copy (`cp.async.ca`).
    CpAsync8,
    /// `cp_async_8_zfill(&mut shared[i], &global[j], pred)`: copies 8 bytes when `pred`, else
    /// writes 8 zero bytes without reading.
    CpAsync8Zfill,
    /// `cp_async_4(&mut shared[i], &global[j])`: 4-byte asynchronous copy (`cp.async.ca`).
    CpAsync4,
    /// `cp_async_4_zfill(&mut shared[i], &global[j], pred)`: copies 4 bytes when `pred`, else
    /// writes 4 zero bytes without reading.
    CpAsync4Zfill,
    /// `cp_async_commit()`.
    CpAsyncCommit,
    /// `cp_async_wait(n)` with a compile-time `n`: wait until at most `n` groups are pending.
    CpAsyncWait,
    /// `lop3(a, b, c, lut)` with a compile-time `lut`.
    Lop3,
    /// `prmt(a, b, selector) -> u32`: PTX byte permute.
    Prmt,
    /// `fma_bf16x2(a, b, c) -> u32`: `a * b + c` on two packed bf16 lanes (`fma.rn.bf16x2`).
    FmaBf16x2,
    /// `exp2_approx(x: f32) -> f32`: `ex2.approx.ftz.f32`, 2^x in one special-function
    /// instruction (relative error about 2^-22; subnormal inputs and results flush to zero),
    /// where `x.exp2()` adds a subnormal fix-up around it.
    Exp2Approx,
    /// `grid_wait()`: under programmatic dependent launch, waits until the previous kernel of
    /// the stream has finished and its writes are visible (`griddepcontrol.wait`; a no-op for a
    /// launch without that dependency). Nothing the previous kernel writes may be read, and
    /// nothing it reads may be written, before it. A kernel that does not call it gets
    /// `grid_wait(); grid_launch_dependents();` as its first statements.
    GridWait,
    /// `grid_launch_dependents()`: lets the next kernel of the stream start launching once every
    /// block of this one has called it or exited (`griddepcontrol.launch_dependents`). Call it
    /// after `grid_wait()`, so that at most one kernel waits ahead.
    GridLaunchDependents,
    /// `wgmma_fence()`: `wgmma.fence.sync.aligned`. Before a warpgroup's first `wgmma_*` and
    /// whenever other instructions touched its accumulator or A registers since.
    WgmmaFence,
    /// `wgmma_commit()`: `wgmma.commit_group.sync.aligned`, closes a group of `wgmma_*`.
    WgmmaCommit,
    /// `wgmma_wait(n)` with a compile-time `n`: waits until at most `n` wgmma groups are pending
    /// (their accumulators and shared operands are free again).
    WgmmaWait,
    /// `fence_proxy_async()`: `fence.proxy.async.shared::cta`. Shared memory written by ordinary
    /// stores or landed `cp.async` copies becomes visible to `wgmma` operand reads (the async
    /// proxy); every writer fences, then a barrier, then the `wgmma`.
    FenceProxyAsync,
    /// `wgmma_desc(&x[i]) -> u32`: the low word of the shared-memory descriptor of a `wgmma`
    /// operand at `&x[i]` (bf16 in shared memory, 128-byte swizzled, 8-row groups 1024 bytes
    /// apart): bits 0..14 the byte address / 16, bits 16..30 the 1024-byte group offset / 16.
    /// Adding `n` moves the operand `16 n` bytes (a k16 step is 2, an 8-row group 64) while it
    /// stays in shared memory: make one per tile and add compile-time offsets, so a `wgmma`
    /// costs an add per operand instead of an address conversion.
    WgmmaDesc,
    /// `wgmma_bf16_ss(&mut d: [f32; N / 2], a: u32, b: u32)`, `N` 16, 32 or 64 (from `d`'s
    /// length), `a` and `b` from [`Intrinsic::WgmmaDesc`]: one warpgroup's `D[64, N] += A[64, 16]
    /// B[N, 16]^T` (`wgmma.mma_async` m64nNk16, bf16 in, f32 accumulators). Both operands are
    /// bf16 in shared memory, K-major and 128-byte swizzled: row `r` of an operand at byte `p`
    /// starts at `p + 1024 (r / 8) + 128 (r % 8)` and its 16-byte chunk `c` lies at chunk
    /// `c ^ (r % 8)` of that 128-byte line, counting from a 1024-byte-aligned atom (so `p` sits
    /// 0, 32, 64 or 96 bytes into one: the k16 steps of a 64-wide line). `d[4 j + e]` of lane
    /// `l` in warp `w` of the warpgroup is `D[16 w + l / 4 + 8 (e / 2)][8 j + 2 (l % 4) + e % 2]`,
    /// as in `mma_m16n8k16_bf16`. Asynchronous: fence before, commit and wait before using `d`
    /// or overwriting the operands.
    WgmmaBf16Ss,
    /// `wgmma_bf16_rs_mn(&mut d: [f32; 32], &a: [u32; 4], b: u32)`: `D[64, 64] += A[64, 16]
    /// B[16, 64]` with `A` in registers (warp `w` of the warpgroup holds rows `16 w ..` in the
    /// `mma_m16n8k16_bf16` A layout) and `B` (descriptor `b`, [`Intrinsic::WgmmaDesc`]) bf16 in
    /// shared memory, N-major and 128-byte swizzled: its row `k` (64 values of N) at
    /// `p + 1024 (k / 8) + 128 (k % 8)`, chunks swizzled as for [`Intrinsic::WgmmaBf16Ss`], `p`
    /// 1024-byte aligned. `d` as there.
    WgmmaBf16RsMn,
    /// `wgmma_bf16_rs(&mut d: [f32; N / 2], &a: [u32; 4], b: u32, accumulate: bool)`, `N` 8, 16,
    /// 32, 64, 128 or 256: `D[64, N] = A[64, 16] B[N, 16]^T + (accumulate ? D : 0)` with `A` in
    /// registers (as for [`Intrinsic::WgmmaBf16RsMn`]) and `B` K-major in shared memory as for
    /// [`Intrinsic::WgmmaBf16Ss`]. `a` must not change until the `wgmma` is waited for. Starting
    /// a sum with `accumulate` false instead of zeroing `d` keeps the accumulators written by
    /// `wgmma`s only (ptxas copies them around the loop otherwise).
    WgmmaBf16Rs,
    /// `mbar_init(&mut bar[i], count)`: initializes an mbarrier (a `u64` in shared memory)
    /// expecting `count` arrivals per phase (`mbarrier.init` plus the init fence). Once, by one
    /// thread, then `sync_threads()` before any other use.
    MbarInit,
    /// `mbar_arrive_tx(&mut bar[i], bytes)`: arrives at the mbarrier and adds `bytes` to the
    /// bytes its current phase waits for (`mbarrier.arrive.expect_tx`).
    MbarArriveTx,
    /// `mbar_wait(&bar[i], parity)`: waits until the phase of parity `parity` (0 for the
    /// first, then alternating) has completed: all its arrivals made and its bytes landed.
    /// The phase before the first counts as completed (parity 1 passes at once).
    MbarWait,
    /// `cp_async_bulk(&mut smem[i], &global[j], bytes, &mut bar[k])`: copies `bytes` (a multiple
    /// of 16; both addresses 16-byte aligned) through the async proxy and counts them on the
    /// mbarrier when they land (`cp.async.bulk ... mbarrier::complete_tx`). Readers wait on the
    /// mbarrier; no proxy fence is needed, for `wgmma` reads either.
    CpAsyncBulk,
}

use Intrinsic::*;

/// Every intrinsic, in prelude order.
pub const ALL: &[Intrinsic] = &[
    SyncWarp,
    ThreadFence,
    ShflXor,
    ShflDown,
    ShflUp,
    ShflIdx,
    Ballot,
    VoteAny,
    VoteAll,
    AtomicAdd,
    AtomicMax,
    AtomicMin,
    AtomicOr,
    AtomicAnd,
    AtomicExch,
    AtomicCas,
    PackBf16x2,
    Bf16Lo,
    Bf16Hi,
    PackF16x2,
    F16Lo,
    F16Hi,
    MmaBf16,
    MmaF16,
    LdmatrixX1,
    LdmatrixX2,
    LdmatrixX4,
    LdmatrixX2Trans,
    LdmatrixX4Trans,
    CpAsync16,
    CpAsync16Zfill,
    CpAsync8,
    CpAsync8Zfill,
    CpAsync4,
    CpAsync4Zfill,
    CpAsyncCommit,
    CpAsyncWait,
    Lop3,
    Prmt,
    FmaBf16x2,
    Exp2Approx,
    GridWait,
    GridLaunchDependents,
    WgmmaFence,
    WgmmaCommit,
    WgmmaWait,
    FenceProxyAsync,
    WgmmaDesc,
    WgmmaBf16Ss,
    WgmmaBf16RsMn,
    WgmmaBf16Rs,
    MbarInit,
    MbarArriveTx,
    MbarWait,
    CpAsyncBulk,
];

impl Intrinsic {
    /// The DSL function name.
    pub fn dsl_name(self) -> &'static str {
        match self {
            SyncWarp => "sync_warp",
            ThreadFence => "thread_fence",
            ShflXor => "shfl_xor",
            ShflDown => "shfl_down",
            ShflUp => "shfl_up",
            ShflIdx => "shfl_idx",
            Ballot => "ballot",
            VoteAny => "vote_any",
            VoteAll => "vote_all",
            AtomicAdd => "atomic_add",
            AtomicMax => "atomic_max",
            AtomicMin => "atomic_min",
            AtomicOr => "atomic_or",
            AtomicAnd => "atomic_and",
            AtomicExch => "atomic_exch",
            AtomicCas => "atomic_cas",
            PackBf16x2 => "pack_bf16x2",
            Bf16Lo => "bf16_lo",
            Bf16Hi => "bf16_hi",
            PackF16x2 => "pack_f16x2",
            F16Lo => "f16_lo",
            F16Hi => "f16_hi",
            MmaBf16 => "mma_m16n8k16_bf16",
            MmaF16 => "mma_m16n8k16_f16",
            LdmatrixX1 => "ldmatrix_x1",
            LdmatrixX2 => "ldmatrix_x2",
            LdmatrixX4 => "ldmatrix_x4",
            LdmatrixX2Trans => "ldmatrix_x2_trans",
            LdmatrixX4Trans => "ldmatrix_x4_trans",
            CpAsync16 => "cp_async_16",
            CpAsync16Zfill => "cp_async_16_zfill",
            CpAsync8 => "cp_async_8",
            CpAsync8Zfill => "cp_async_8_zfill",
            CpAsync4 => "cp_async_4",
            CpAsync4Zfill => "cp_async_4_zfill",
            CpAsyncCommit => "cp_async_commit",
            CpAsyncWait => "cp_async_wait",
            Lop3 => "lop3",
            Prmt => "prmt",
            FmaBf16x2 => "fma_bf16x2",
            Exp2Approx => "exp2_approx",
            GridWait => "grid_wait",
            GridLaunchDependents => "grid_launch_dependents",
            WgmmaFence => "wgmma_fence",
            WgmmaCommit => "wgmma_commit",
            WgmmaWait => "wgmma_wait",
            FenceProxyAsync => "fence_proxy_async",
            WgmmaDesc => "wgmma_desc",
            WgmmaBf16Ss => "wgmma_bf16_ss",
            WgmmaBf16RsMn => "wgmma_bf16_rs_mn",
            WgmmaBf16Rs => "wgmma_bf16_rs",
            MbarInit => "mbar_init",
            MbarArriveTx => "mbar_arrive_tx",
            MbarWait => "mbar_wait",
            CpAsyncBulk => "cp_async_bulk",
        }
    }

    /// Looks an intrinsic up by its DSL name.
    pub fn from_dsl(name: &str) -> Option<Intrinsic> {
        ALL.iter().copied().find(|i| i.dsl_name() == name)
    }

    /// Number of arguments.
    pub fn arity(self) -> usize {
        match self {
            SyncWarp | ThreadFence | CpAsyncCommit | GridWait | GridLaunchDependents | WgmmaFence | WgmmaCommit
            | FenceProxyAsync => 0,
            Ballot | VoteAny | VoteAll | Bf16Lo | Bf16Hi | F16Lo | F16Hi | CpAsyncWait | WgmmaWait | WgmmaDesc
            | Exp2Approx => 1,
            ShflXor | ShflDown | ShflUp | ShflIdx | PackBf16x2 | PackF16x2 | AtomicAdd | AtomicMax | AtomicMin
            | AtomicOr | AtomicAnd | AtomicExch | CpAsync16 | CpAsync8 | CpAsync4 | MbarInit | MbarArriveTx
            | MbarWait => 2,
            LdmatrixX1 | LdmatrixX2 | LdmatrixX4 | LdmatrixX2Trans | LdmatrixX4Trans => 2,
            AtomicCas | MmaBf16 | MmaF16 | WgmmaBf16Ss | WgmmaBf16RsMn | CpAsync16Zfill | CpAsync8Zfill
            | CpAsync4Zfill | Prmt | FmaBf16x2 => 3,
            Lop3 | CpAsyncBulk | WgmmaBf16Rs => 4,
        }
    }

    /// Index of the argument that must be a compile-time constant, if any.
    pub fn comptime_arg(self) -> Option<usize> {
        match self {
            CpAsyncWait | WgmmaWait => Some(0),
            Lop3 => Some(3),
            _ => None,
        }
    }

    /// For the `cp.async` copies: the bytes copied and whether a predicate zero-fills instead.
    pub fn cp_async_bytes(self) -> Option<(u32, bool)> {
        match self {
            CpAsync16 => Some((16, false)),
            CpAsync16Zfill => Some((16, true)),
            CpAsync8 => Some((8, false)),
            CpAsync8Zfill => Some((8, true)),
            CpAsync4 => Some((4, false)),
            CpAsync4Zfill => Some((4, true)),
            _ => None,
        }
    }

    /// Whether the DSL offers it as a slice/array method `x.name(i, ...)` (atomics).
    pub fn is_atomic(self) -> bool {
        matches!(
            self,
            AtomicAdd | AtomicMax | AtomicMin | AtomicOr | AtomicAnd | AtomicExch | AtomicCas
        )
    }

    /// Name of the CUDA builtin or prelude helper it renders to.
    pub fn c_name(self) -> &'static str {
        match self {
            SyncWarp => "__syncwarp",
            ThreadFence => "__threadfence",
            ShflXor => "__shfl_xor_sync",
            ShflDown => "__shfl_down_sync",
            ShflUp => "__shfl_up_sync",
            ShflIdx => "__shfl_sync",
            Ballot => "__ballot_sync",
            VoteAny => "__any_sync",
            VoteAll => "__all_sync",
            AtomicAdd => "atomicAdd",
            AtomicMax => "atomicMax",
            AtomicMin => "atomicMin",
            AtomicOr => "atomicOr",
            AtomicAnd => "atomicAnd",
            AtomicExch => "atomicExch",
            AtomicCas => "atomicCAS",
            other => other.dsl_name(),
        }
    }

    /// Whether the call passes the full warp mask first (`__shfl_*_sync(0xffffffffu, ...)`).
    pub fn takes_warp_mask(self) -> bool {
        matches!(self, ShflXor | ShflDown | ShflUp | ShflIdx | Ballot | VoteAny | VoteAll)
    }

    /// The prelude helper this intrinsic needs, if any.
    pub fn helper(self) -> Option<Helper> {
        Some(match self {
            PackBf16x2 => Helper::PackBf16x2,
            Bf16Lo | Bf16Hi => Helper::UnpackBf16x2,
            PackF16x2 => Helper::PackF16x2,
            F16Lo | F16Hi => Helper::UnpackF16x2,
            MmaBf16 => Helper::MmaBf16,
            MmaF16 => Helper::MmaF16,
            LdmatrixX1 | LdmatrixX2 | LdmatrixX4 | LdmatrixX2Trans | LdmatrixX4Trans => Helper::Ldmatrix,
            CpAsync16 | CpAsync16Zfill => Helper::CpAsync,
            CpAsync8 | CpAsync8Zfill | CpAsync4 | CpAsync4Zfill => Helper::CpAsyncSmall,
            CpAsyncCommit | CpAsyncWait => Helper::CpAsyncGroup,
            Lop3 => Helper::Lop3,
            Prmt => Helper::Prmt,
            FmaBf16x2 => Helper::FmaBf16x2,
            Exp2Approx => Helper::Exp2Approx,
            GridWait | GridLaunchDependents => Helper::GridDependency,
            WgmmaFence | WgmmaCommit | WgmmaWait | FenceProxyAsync | WgmmaDesc => Helper::Wgmma,
            WgmmaBf16Ss => Helper::WgmmaSs,
            WgmmaBf16Rs => Helper::WgmmaRs,
            WgmmaBf16RsMn => Helper::WgmmaRsMn,
            MbarInit | MbarArriveTx | MbarWait => Helper::Mbarrier,
            CpAsyncBulk => Helper::CpAsyncBulk,
            _ => return None,
        })
    }

    /// Type-checks the arguments and gives the result type. Untyped integer literals are fixed
    /// to the expected type in place.
    pub fn check(self, args: &mut [Expr]) -> Result<Ty, OpError> {
        if args.len() != self.arity() {
            op_bail!(
                "`{}` takes {} argument(s), got {}",
                self.dsl_name(),
                self.arity(),
                args.len()
            );
        }
        if let Some(i) = self.comptime_arg() {
            if !matches!(args[i].kind, ExprKind::Lit(Lit::Int(_))) {
                op_bail!(
                    "argument {} of `{}` must be a compile-time integer",
                    i + 1,
                    self.dsl_name()
                );
            }
        }
        let u32t = Ty::Scalar(Scalar::U32);
        let name = self.dsl_name();
        Ok(match self {
            SyncWarp | ThreadFence | CpAsyncCommit | GridWait | GridLaunchDependents | WgmmaFence | WgmmaCommit
            | FenceProxyAsync | WgmmaWait => Ty::Void,
            ShflXor | ShflDown | ShflUp | ShflIdx => {
                let t = value_ty(&args[0], name, &[Scalar::F32, Scalar::U32, Scalar::I32])?;
                expect(&mut args[1], Scalar::U32, name, 2)?;
                args[0].ty = Ty::Scalar(t);
                Ty::Scalar(t)
            }
            Ballot => {
                expect(&mut args[0], Scalar::Bool, name, 1)?;
                u32t
            }
            VoteAny | VoteAll => {
                expect(&mut args[0], Scalar::Bool, name, 1)?;
                Ty::Scalar(Scalar::Bool)
            }
            AtomicAdd | AtomicMax | AtomicMin | AtomicOr | AtomicAnd | AtomicExch | AtomicCas => {
                let elem = match &args[0].ty {
                    Ty::Ref {
                        elem,
                        space: Space::Global | Space::Shared,
                        len: None,
                        mutable: true,
                    } => *elem,
                    other => op_bail!("`{name}` needs `&mut x[i]` on a global or shared buffer, got {other}"),
                };
                let allowed: &[Scalar] = match self {
                    AtomicAdd => &[Scalar::F32, Scalar::U32, Scalar::I32, Scalar::U64],
                    AtomicExch => &[Scalar::F32, Scalar::U32, Scalar::I32],
                    AtomicCas | AtomicOr | AtomicAnd => &[Scalar::U32, Scalar::I32, Scalar::U64],
                    _ => &[Scalar::U32, Scalar::I32, Scalar::U64],
                };
                if !allowed.contains(&elem) {
                    op_bail!("`{name}` is not available on `{}` elements", elem.rust_name());
                }
                for (k, a) in args.iter_mut().enumerate().skip(1) {
                    expect(a, elem, name, k + 1)?;
                }
                Ty::Scalar(elem)
            }
            PackBf16x2 | PackF16x2 => {
                expect(&mut args[0], Scalar::F32, name, 1)?;
                expect(&mut args[1], Scalar::F32, name, 2)?;
                u32t
            }
            Bf16Lo | Bf16Hi | F16Lo | F16Hi => {
                expect(&mut args[0], Scalar::U32, name, 1)?;
                Ty::Scalar(Scalar::F32)
            }
            Exp2Approx => {
                expect(&mut args[0], Scalar::F32, name, 1)?;
                Ty::Scalar(Scalar::F32)
            }
            MmaBf16 | MmaF16 => {
                expect_row(&args[0], Scalar::F32, 4, true, Space::Local, name, 1)?;
                expect_row(&args[1], Scalar::U32, 4, false, Space::Local, name, 2)?;
                expect_row(&args[2], Scalar::U32, 2, false, Space::Local, name, 3)?;
                Ty::Void
            }
            LdmatrixX1 | LdmatrixX2 | LdmatrixX4 | LdmatrixX2Trans | LdmatrixX4Trans => {
                let n = match self {
                    LdmatrixX1 => 1,
                    LdmatrixX2 | LdmatrixX2Trans => 2,
                    _ => 4,
                };
                expect_row(&args[0], Scalar::U32, n, true, Space::Local, name, 1)?;
                expect_elem_ref(&args[1], Space::Shared, false, name, 2)?;
                Ty::Void
            }
            CpAsync16 | CpAsync16Zfill | CpAsync8 | CpAsync8Zfill | CpAsync4 | CpAsync4Zfill => {
                expect_elem_ref(&args[0], Space::Shared, true, name, 1)?;
                expect_elem_ref(&args[1], Space::Global, false, name, 2)?;
                if self.cp_async_bytes().is_some_and(|(_, zfill)| zfill) {
                    expect(&mut args[2], Scalar::Bool, name, 3)?;
                }
                Ty::Void
            }
            CpAsyncWait => Ty::Void,
            MbarInit | MbarArriveTx | MbarWait => {
                expect_mbarrier(&args[0], self != MbarWait, name, 1)?;
                expect(&mut args[1], Scalar::U32, name, 2)?;
                Ty::Void
            }
            CpAsyncBulk => {
                expect_elem_ref(&args[0], Space::Shared, true, name, 1)?;
                expect_elem_ref(&args[1], Space::Global, false, name, 2)?;
                expect(&mut args[2], Scalar::U32, name, 3)?;
                expect_mbarrier(&args[3], true, name, 4)?;
                Ty::Void
            }
            WgmmaBf16Ss | WgmmaBf16Rs => {
                let ss = self == WgmmaBf16Ss;
                match &args[0].ty {
                    Ty::Ref {
                        elem: Scalar::F32,
                        space: Space::Local,
                        len: Some(n),
                        mutable: true,
                    } if if ss {
                        matches!(n, 8 | 16 | 32)
                    } else {
                        matches!(n, 4 | 8 | 16 | 32 | 64 | 128)
                    } => {}
                    other => op_bail!(
                        "argument 1 of `{name}` must be `&mut [f32; N / 2]` with N {}, found {other}",
                        if ss {
                            "16, 32 or 64"
                        } else {
                            "8, 16, 32, 64, 128 or 256"
                        }
                    ),
                }
                if self == WgmmaBf16Rs {
                    expect_row(&args[1], Scalar::U32, 4, false, Space::Local, name, 2)?;
                } else {
                    expect(&mut args[1], Scalar::U32, name, 2)?;
                }
                expect(&mut args[2], Scalar::U32, name, 3)?;
                if self == WgmmaBf16Rs {
                    expect(&mut args[3], Scalar::Bool, name, 4)?;
                }
                Ty::Void
            }
            WgmmaBf16RsMn => {
                expect_row(&args[0], Scalar::F32, 32, true, Space::Local, name, 1)?;
                expect_row(&args[1], Scalar::U32, 4, false, Space::Local, name, 2)?;
                expect(&mut args[2], Scalar::U32, name, 3)?;
                Ty::Void
            }
            WgmmaDesc => {
                expect_bf16_shared(&args[0], name, 1)?;
                u32t
            }
            Lop3 => {
                for (k, a) in args.iter_mut().enumerate().take(3) {
                    expect(a, Scalar::U32, name, k + 1)?;
                }
                u32t
            }
            Prmt | FmaBf16x2 => {
                for (k, a) in args.iter_mut().enumerate() {
                    expect(a, Scalar::U32, name, k + 1)?;
                }
                u32t
            }
        })
    }
}

fn value_ty(e: &Expr, name: &str, allowed: &[Scalar]) -> Result<Scalar, OpError> {
    match &e.ty {
        Ty::UntypedInt => Ok(Scalar::U32),
        Ty::Scalar(s) if allowed.contains(s) => Ok(*s),
        other => op_bail!("`{name}` does not take a value of type {other}"),
    }
}

/// Checks that `e` has scalar type `s` (fixing an untyped integer literal to it).
pub(crate) fn expect(e: &mut Expr, s: Scalar, name: &str, pos: usize) -> Result<(), OpError> {
    match &e.ty {
        Ty::Scalar(t) if *t == s => Ok(()),
        Ty::UntypedInt if s.is_int() || s == Scalar::F32 => {
            crate::ops::fix_untyped(e, s);
            Ok(())
        }
        other => op_bail!("argument {pos} of `{name}` must be {}, found {other}", s.rust_name()),
    }
}

fn expect_row(
    e: &Expr,
    elem: Scalar,
    len: u32,
    mutable: bool,
    space: Space,
    name: &str,
    pos: usize,
) -> Result<(), OpError> {
    match &e.ty {
        Ty::Ref {
            elem: el,
            space: sp,
            len: Some(n),
            mutable: m,
        } if *el == elem && *n == len && *sp == space && (*m || !mutable) => Ok(()),
        other => op_bail!(
            "argument {pos} of `{name}` must be `&{}[{}; {len}]` (a register array row), found {other}",
            if mutable { "mut " } else { "" },
            elem.rust_name()
        ),
    }
}

fn expect_bf16_shared(e: &Expr, name: &str, pos: usize) -> Result<(), OpError> {
    match &e.ty {
        Ty::Ref {
            elem: Scalar::Bf16,
            space: Space::Shared,
            len: None,
            ..
        } => Ok(()),
        other => op_bail!("argument {pos} of `{name}` must be `&x[i]` into bf16 shared memory, found {other}"),
    }
}

/// An mbarrier operand: `&x[i]` (or `&mut x[i]`) into a shared `u64` array.
fn expect_mbarrier(e: &Expr, mutable: bool, name: &str, pos: usize) -> Result<(), OpError> {
    match &e.ty {
        Ty::Ref {
            elem: Scalar::U64,
            space: Space::Shared,
            len: None,
            mutable: m,
        } if *m || !mutable => Ok(()),
        other => op_bail!(
            "argument {pos} of `{name}` must be `&{}bar[i]` into a shared `u64` array (an mbarrier), found {other}",
            if mutable { "mut " } else { "" }
        ),
    }
}

fn expect_elem_ref(e: &Expr, space: Space, mutable: bool, name: &str, pos: usize) -> Result<(), OpError> {
    match &e.ty {
        Ty::Ref {
            space: sp,
            len: None,
            mutable: m,
            ..
        } if *sp == space && (*m || !mutable) => Ok(()),
        other => {
            let sp = if space == Space::Shared { "shared" } else { "global" };
            op_bail!(
                "argument {pos} of `{name}` must be `&{}x[i]` into {sp} memory, found {other}",
                if mutable { "mut " } else { "" }
            )
        }
    }
}
