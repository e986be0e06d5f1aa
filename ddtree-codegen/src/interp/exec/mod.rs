//! The scheduler and memories: threads as resumable states, barriers, warp collectives, and the
//! shadow state behind the shared-memory hazard checks.

mod collective;
mod eval;
mod memory;

use super::compile::{is_collective, is_warpgroup, CExpr, Lowered, Op, Place, Ref, Slot, Val};
use super::numeric::{
    bf16_to_f32, binary, cast, exp2_ftz, f16_to_f32, f32_to_bf16, f32_to_f16, fma_bf16x2, lop3, math, mma_m16n8k16,
    prmt, unary,
};
use super::{check_args, Buffer, Hazard, HostArg, InterpError, RaceKind, Value};
use crate::intrinsics::Intrinsic;
use crate::ir::{Builtin, Loc, Scalar, Space};

/// Most interpreted steps one launch may take.
pub(super) const STEP_LIMIT: u64 = 1 << 32;

/// A global buffer as the kernel sees it (scalar arguments leave a hole).
enum GBuf<'a> {
    Ro(&'a Buffer),
    Rw(&'a mut Buffer),
    Scalar,
}

impl GBuf<'_> {
    fn buffer(&self) -> &Buffer {
        match self {
            GBuf::Ro(b) => b,
            GBuf::Rw(b) => b,
            GBuf::Scalar => unreachable!("a scalar argument used as a buffer"),
        }
    }
}

/// Per shared element: initialisation and the last writer and readers since the last barrier.
#[derive(Clone, Copy, Default)]
struct Shadow {
    init: bool,
    /// A `cp.async` to it has been issued but not waited for.
    pending: bool,
    w_epoch: u32,
    w_thread: u32,
    w_wsync: u32,
    r_epoch: u32,
    r_first: u32,
    r_other: u32,
    r_many: bool,
    /// Warp of every reader, or `MANY`.
    r_warp: u32,
    r_wsync: u32,
}

const MANY: u32 = u32::MAX;

/// The address field of a `wgmma` descriptor's low word (bytes / 16).
const DESC_ADDR: u32 = 0x3fff;

/// The rest of a `wgmma_desc` low word: 8-row groups 1024 bytes apart (in 16-byte units).
const DESC_GROUPS: u32 = 64 << 16;

struct SharedMem {
    /// The array's first byte in the block's shared window (what `wgmma_desc` encodes): the
    /// arrays lie one after another in declaration order, each 1024-byte aligned.
    base: u64,
    esize: usize,
    bytes: Vec<u8>,
    shadow: Vec<Shadow>,
}

struct Frame {
    func: u32,
    pc: usize,
    slots: Vec<Val>,
    arrays: Vec<Vec<Val>>,
    dst: Option<Slot>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Status {
    Running,
    Barrier,
    Warp,
    /// At an `mbar_wait` whose phase has not completed: the mbarrier and the parity.
    Mbar((u32, u64), u32),
    Exited,
}

/// A `cp.async` in flight: its first `len` (4, 8 or 16) bytes land at `byte`.
struct CopyAsync {
    arr: u32,
    byte: usize,
    len: usize,
    data: [u8; 16],
}

/// An mbarrier: arrivals still expected and bytes still in flight in the current phase, the
/// phase number, and the copies that land when the phase completes.
struct Mbar {
    count: u32,
    pending: u32,
    tx: i64,
    phase: u32,
    copies: Vec<CopyAsync>,
}

struct Thread {
    tid: [u32; 3],
    linear: u32,
    frames: Vec<Frame>,
    status: Status,
    /// Committed cp.async groups, oldest first, and the group being built.
    groups: Vec<Vec<CopyAsync>>,
    open: Vec<CopyAsync>,
    /// Past `grid_wait()` (from the start in a kernel that does not call it): global writes
    /// are allowed.
    waited: bool,
}

impl Thread {
    fn top(&self) -> &Frame {
        self.frames.last().expect("a live thread has a frame")
    }

    fn top_mut(&mut self) -> &mut Frame {
        self.frames.last_mut().expect("a live thread has a frame")
    }
}

struct Exec<'k, 'a> {
    k: &'k Lowered,
    globals: Vec<GBuf<'a>>,
    shared: Vec<SharedMem>,
    /// The block's mbarriers by (shared array, element).
    mbars: std::collections::HashMap<(u32, u64), Mbar>,
    grid: [u32; 3],
    block: [u32; 3],
    epoch: u32,
    wsync: Vec<u32>,
    steps: u64,
}

/// Runs `k` over `grid`.
pub(super) fn launch(k: &Lowered, grid: [u32; 3], args: &mut [HostArg<'_>]) -> Result<(), InterpError> {
    let at_launch = |hazard| InterpError {
        kernel: k.symbol.clone(),
        function: "kernel".to_string(),
        loc: Loc::default(),
        block: [0; 3],
        thread: [0; 3],
        hazard,
    };
    check_args(k, args).map_err(at_launch)?;
    if grid.contains(&0) {
        return Err(at_launch(Hazard::InvalidLaunch(format!("empty grid {grid:?}"))));
    }
    let mut init = Vec::with_capacity(args.len());
    let mut globals = Vec::with_capacity(args.len());
    for (i, a) in args.iter_mut().enumerate() {
        match a {
            HostArg::In(b) => {
                globals.push(GBuf::Ro(b));
                init.push(Val::Buf(i as u32));
            }
            HostArg::Out(b) => {
                globals.push(GBuf::Rw(b));
                init.push(Val::Buf(i as u32));
            }
            HostArg::Scalar(v) => {
                globals.push(GBuf::Scalar);
                init.push(match *v {
                    Value::F32(x) => Val::F(x),
                    Value::U32(x) => Val::U(x),
                    Value::I32(x) => Val::I(x),
                    Value::U64(x) => Val::U64(x),
                    Value::Bool(x) => Val::B(x),
                    Value::Bf16(x) => Val::H(x.to_bits()),
                    Value::F16(x) => Val::H(x.to_bits()),
                });
            }
        }
    }
    let mut ex = Exec {
        k,
        globals,
        shared: Vec::new(),
        mbars: std::collections::HashMap::new(),
        grid,
        block: [0; 3],
        epoch: 1,
        wsync: Vec::new(),
        steps: 0,
    };
    for z in 0..grid[2] {
        for y in 0..grid[1] {
            for x in 0..grid[0] {
                ex.run_block([x, y, z], &init)?;
            }
        }
    }
    Ok(())
}

/// The element value of `bytes` (little-endian) as type `elem`.
fn decode(elem: Scalar, b: &[u8]) -> Val {
    match elem {
        Scalar::F32 => Val::F(f32::from_le_bytes(b[..4].try_into().expect("4 bytes"))),
        Scalar::U32 => Val::U(u32::from_le_bytes(b[..4].try_into().expect("4 bytes"))),
        Scalar::I32 => Val::I(i32::from_le_bytes(b[..4].try_into().expect("4 bytes"))),
        Scalar::U64 => Val::U64(u64::from_le_bytes(b[..8].try_into().expect("8 bytes"))),
        Scalar::Bf16 | Scalar::F16 => Val::H(u16::from_le_bytes(b[..2].try_into().expect("2 bytes"))),
        Scalar::Bool => Val::B(b[0] != 0),
    }
}

/// Writes `v` as type `elem` into `out` (little-endian).
fn encode(elem: Scalar, v: Val, out: &mut [u8]) {
    match elem {
        Scalar::F32 => out[..4].copy_from_slice(&v.f32().to_le_bytes()),
        Scalar::U32 | Scalar::I32 => out[..4].copy_from_slice(&v.u32().to_le_bytes()),
        Scalar::U64 => out[..8].copy_from_slice(&v.u64().to_le_bytes()),
        Scalar::Bf16 | Scalar::F16 => out[..2].copy_from_slice(&(v.u32() as u16).to_le_bytes()),
        Scalar::Bool => out[0] = v.bool() as u8,
    }
}

fn v4_bytes(v: [u32; 4]) -> [u8; 16] {
    let mut b = [0u8; 16];
    for (i, x) in v.iter().enumerate() {
        b[4 * i..4 * i + 4].copy_from_slice(&x.to_le_bytes());
    }
    b
}

fn bytes_v4(b: &[u8]) -> [u32; 4] {
    std::array::from_fn(|i| u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().expect("4 bytes")))
}

/// An index value as a signed number (so negative i32 indices are reported as such).
fn index_of(v: Val) -> i64 {
    match v {
        Val::I(x) => x as i64,
        Val::U64(x) => x.min(i64::MAX as u64) as i64,
        other => other.u32() as i64,
    }
}

impl<'k> Exec<'k, '_> {
    fn thread_xyz(&self, linear: u32) -> [u32; 3] {
        let [bx, by, _] = self.k.block;
        [linear % bx, (linear / bx) % by, linear / (bx * by)]
    }

    fn error(&self, th: &Thread, func: u32, loc: Loc, hazard: Hazard) -> InterpError {
        InterpError {
            kernel: self.k.symbol.clone(),
            function: self.k.funcs[func as usize].label.clone(),
            loc,
            block: self.block,
            thread: th.tid,
            hazard,
        }
    }

    /// Where a thread stands: its function, pc and the op's location.
    fn position(&self, th: &Thread) -> (u32, usize, Loc) {
        let f = th.top();
        (f.func, f.pc, self.k.funcs[f.func as usize].ops[f.pc].loc)
    }

    fn run_block(&mut self, block: [u32; 3], init: &[Val]) -> Result<(), InterpError> {
        self.block = block;
        self.mbars.clear();
        let n = self.k.block.iter().product::<u32>();
        let mut next = 0u64;
        self.shared = self
            .k
            .shared
            .iter()
            .map(|d| {
                let esize = d.elem.size() as usize;
                let base = next;
                next = (base + d.len * esize as u64).next_multiple_of(1024);
                // Garbage, as on the GPU; the shadow state catches reads of it.
                SharedMem {
                    base,
                    esize,
                    bytes: vec![0xa5; d.len as usize * esize],
                    shadow: vec![Shadow::default(); d.len as usize],
                }
            })
            .collect();
        self.epoch = 1;
        self.wsync = vec![0; n.div_ceil(32) as usize];
        let nslots = self.k.funcs[0].nslots;
        let mut threads: Vec<Thread> = (0..n)
            .map(|linear| {
                let mut slots = init.to_vec();
                slots.resize(nslots, Val::Void);
                Thread {
                    tid: self.thread_xyz(linear),
                    linear,
                    frames: vec![Frame {
                        func: 0,
                        pc: 0,
                        slots,
                        arrays: Vec::new(),
                        dst: None,
                    }],
                    status: Status::Running,
                    groups: Vec::new(),
                    open: Vec::new(),
                    waited: !self.k.places_grid_wait,
                }
            })
            .collect();
        loop {
            for th in threads.iter_mut() {
                if th.status == Status::Running {
                    self.run_thread(th)?;
                }
            }
            let mut progressed = false;
            for (w, lanes) in threads.chunks_mut(32).enumerate() {
                if lanes.iter().all(|t| t.status == Status::Warp) && !self.at_warpgroup_op(&lanes[0]) {
                    self.collective(w, lanes)?;
                    progressed = true;
                }
            }
            for group in threads.chunks_mut(128) {
                if group.len() == 128
                    && group
                        .iter()
                        .all(|t| t.status == Status::Warp && self.at_warpgroup_op(t))
                {
                    self.warpgroup(group)?;
                    progressed = true;
                }
            }
            // Threads blocked at an `mbar_wait` whose phase has completed since run again.
            for t in threads.iter_mut() {
                if let Status::Mbar(key, parity) = t.status {
                    if self.mbars[&key].phase % 2 != parity {
                        t.status = Status::Running;
                        progressed = true;
                    }
                }
            }
            if progressed {
                continue;
            }
            if threads.iter().all(|t| t.status == Status::Exited) {
                return Ok(());
            }
            if let Some(t) = threads.iter().find(|t| matches!(t.status, Status::Mbar(..))) {
                let (func, _, loc) = self.position(t);
                let Status::Mbar((arr, idx), parity) = t.status else {
                    unreachable!("found blocked")
                };
                let msg = format!(
                    "`mbar_wait` on `{}`[{idx}] for the phase of parity {parity}, which no thread can \
                     complete any more (every other thread is blocked, at a barrier or gone)",
                    self.k.shared[arr as usize].name
                );
                return Err(self.error(t, func, loc, Hazard::Deadlock(msg)));
            }
            if let Some(t) = threads
                .iter()
                .find(|t| t.status == Status::Warp && self.at_warpgroup_op(t))
            {
                let (func, _, loc) = self.position(t);
                let g = (t.linear / 128 * 128) as usize;
                let why = match threads[g..]
                    .iter()
                    .take(128)
                    .find(|o| o.status != Status::Warp || !self.at_warpgroup_op(o))
                {
                    Some(o) if o.status == Status::Exited => format!("thread {:?} of the warpgroup has exited", o.tid),
                    Some(o) => format!("thread {:?} of the warpgroup waits at {}", o.tid, self.position(o).2),
                    None => format!("the block has {} threads, not a multiple of 128", threads.len()),
                };
                let msg = format!("a warpgroup collective needs all 128 threads, but {why}");
                return Err(self.error(t, func, loc, Hazard::WarpDivergence(msg)));
            }
            if let Some(t) = threads.iter().find(|t| t.status == Status::Warp) {
                let (func, _, loc) = self.position(t);
                let w = t.linear / 32;
                let other = threads[(w * 32) as usize..]
                    .iter()
                    .take(32)
                    .find(|o| o.status != Status::Warp)
                    .expect("a lane is not at the collective");
                let why = match other.status {
                    Status::Exited => format!("thread {:?} of the warp has exited", other.tid),
                    _ => format!(
                        "thread {:?} of the warp waits at the barrier at {}",
                        other.tid,
                        self.position(other).2
                    ),
                };
                let msg = format!("a warp collective needs all 32 lanes, but {why}");
                return Err(self.error(t, func, loc, Hazard::WarpDivergence(msg)));
            }
            // Every thread is at a barrier or gone: release it, or report the divergence.
            let first = threads
                .iter()
                .find(|t| t.status == Status::Barrier)
                .expect("someone waits");
            let (func, pc, loc) = self.position(first);
            for t in &threads {
                let msg = match t.status {
                    Status::Exited => format!("thread {:?} exited while thread {:?} waits here", t.tid, first.tid),
                    _ if (t.top().func, t.top().pc) != (func, pc) => format!(
                        "thread {:?} waits at the barrier at {} while thread {:?} waits here",
                        t.tid,
                        self.position(t).2,
                        first.tid
                    ),
                    _ => continue,
                };
                return Err(self.error(first, func, loc, Hazard::BarrierDivergence(msg)));
            }
            self.epoch += 1;
            for t in threads.iter_mut() {
                t.status = Status::Running;
                t.top_mut().pc += 1;
            }
        }
    }

    /// Runs one thread until it waits at a barrier or collective, or exits.
    fn run_thread(&mut self, th: &mut Thread) -> Result<(), InterpError> {
        let k: &'k Lowered = self.k;
        loop {
            let (func, pc) = (th.top().func, th.top().pc);
            let at = &k.funcs[func as usize].ops[pc];
            self.steps += 1;
            if self.steps > STEP_LIMIT {
                return Err(self.error(th, func, at.loc, Hazard::StepLimit));
            }
            let r: Result<(), Hazard> = (|| {
                let mut next = pc + 1;
                match &at.op {
                    Op::Set(s, e) => {
                        let v = self.eval(th, e)?;
                        th.top_mut().slots[*s as usize] = v;
                    }
                    Op::SetLane(s, lane, e) => {
                        let v = self.eval(th, e)?.u32();
                        if let Val::V4(x) = &mut th.top_mut().slots[*s as usize] {
                            x[*lane as usize] = v;
                        }
                    }
                    Op::LocalArray { slot, len, fill } => {
                        let v = self.eval(th, fill)?;
                        let f = th.top_mut();
                        match f.slots[*slot as usize] {
                            Val::Local(i) => f.arrays[i as usize] = vec![v; *len as usize],
                            _ => {
                                f.arrays.push(vec![v; *len as usize]);
                                f.slots[*slot as usize] = Val::Local(f.arrays.len() as u32 - 1);
                            }
                        }
                    }
                    Op::SharedArray { slot, id } => th.top_mut().slots[*slot as usize] = Val::Shared(*id),
                    Op::Store(p, e) => {
                        let v = self.eval(th, e)?;
                        let (arr, idx) = self.resolve(th, p, true)?;
                        self.store(th, p, arr, idx, v)?;
                    }
                    Op::VecStore(p, e) => {
                        let Val::V4(v) = self.eval(th, e)? else {
                            unreachable!("vstore of a non-u32x4")
                        };
                        let (arr, idx) = self.resolve(th, p, true)?;
                        self.vec_access(th, p, arr, idx, Some(v4_bytes(v)))?;
                    }
                    Op::Eval(e) => {
                        self.eval(th, e)?;
                    }
                    Op::Jump(t) => next = *t,
                    Op::JumpIfNot(c, t) => {
                        if !self.eval(th, c)?.bool() {
                            next = *t;
                        }
                    }
                    Op::Call {
                        func: callee,
                        args,
                        dst,
                    } => {
                        let mut slots = Vec::with_capacity(k.funcs[*callee as usize].nslots);
                        for a in args {
                            slots.push(self.eval(th, a)?);
                        }
                        slots.resize(k.funcs[*callee as usize].nslots, Val::Void);
                        th.top_mut().pc = next;
                        th.frames.push(Frame {
                            func: *callee,
                            pc: 0,
                            slots,
                            arrays: Vec::new(),
                            dst: *dst,
                        });
                        return Ok(());
                    }
                    Op::Ret(v) => {
                        let v = match v {
                            Some(e) => self.eval(th, e)?,
                            None => Val::Void,
                        };
                        let f = th.frames.pop().expect("a frame to return from");
                        match th.frames.last_mut() {
                            Some(caller) => {
                                if let Some(d) = f.dst {
                                    caller.slots[d as usize] = v;
                                }
                            }
                            None => {
                                // The kernel is done: its copies in flight land.
                                let pending: Vec<CopyAsync> =
                                    th.groups.drain(..).flatten().chain(th.open.drain(..)).collect();
                                self.land(pending);
                                th.frames.push(f);
                                th.status = Status::Exited;
                            }
                        }
                        return Ok(());
                    }
                    Op::Barrier => {
                        th.status = Status::Barrier;
                        return Ok(());
                    }
                    Op::Warp { .. } => {
                        th.status = Status::Warp;
                        return Ok(());
                    }
                }
                if matches!(th.status, Status::Mbar(..)) {
                    // Blocked at an `mbar_wait` (a statement of its own): run it again later.
                    return Ok(());
                }
                th.top_mut().pc = next;
                Ok(())
            })();
            if let Err(h) = r {
                return Err(self.error(th, func, at.loc, h));
            }
            if th.status != Status::Running {
                return Ok(());
            }
        }
    }
}

fn write_before_grid_wait(p: &Place) -> Hazard {
    Hazard::WriteBeforeGridWait { buffer: p.name.clone() }
}
