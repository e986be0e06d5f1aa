//! The scheduler and memories: threads as resumable states, barriers, warp collectives, and the
//! shadow state behind the shared-memory hazard checks.

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

    /// The buffer/array and flat element index of a place, bounds-checked.
    fn resolve(&mut self, th: &mut Thread, p: &Place, write: bool) -> Result<(u32, u64), Hazard> {
        let arr = match th.top().slots[p.root as usize] {
            Val::Buf(i) | Val::Shared(i) | Val::Local(i) => i,
            other => unreachable!("indexing a non-buffer {other:?}"),
        };
        let oob = |index: i64, len: u64| Hazard::OutOfBounds {
            buffer: p.name.clone(),
            space: p.space,
            index,
            len,
            write,
        };
        if p.dims.is_empty() {
            let i = index_of(self.eval(th, &p.indices[0])?);
            let len = self.globals[arr as usize].buffer().len() as u64;
            if i < 0 || i as u64 >= len {
                return Err(oob(i, len));
            }
            return Ok((arr, i as u64));
        }
        let mut flat = 0u64;
        for (ie, &d) in p.indices.iter().zip(&p.dims) {
            let i = index_of(self.eval(th, ie)?);
            if i < 0 || i >= d as i64 {
                return Err(oob(i, d as u64));
            }
            flat = flat * d as u64 + i as u64;
        }
        let rest: u64 = p.dims[p.indices.len()..].iter().map(|&d| d as u64).product();
        Ok((arr, flat * rest))
    }

    fn load(&mut self, th: &mut Thread, p: &Place, arr: u32, idx: u64) -> Result<Val, Hazard> {
        Ok(match p.space {
            Space::Global => {
                let b = self.globals[arr as usize].buffer();
                let es = p.elem.size() as usize;
                decode(p.elem, &b.bytes[idx as usize * es..])
            }
            Space::Shared => {
                let es = p.elem.size() as usize;
                let bytes = self.shared_access(th.linear, arr, idx as usize * es, es, None)?;
                decode(p.elem, &bytes)
            }
            Space::Local => th.top().arrays[arr as usize][idx as usize],
        })
    }

    fn store(&mut self, th: &mut Thread, p: &Place, arr: u32, idx: u64, v: Val) -> Result<(), Hazard> {
        let es = p.elem.size() as usize;
        if p.space == Space::Global && !th.waited {
            return Err(write_before_grid_wait(p));
        }
        match p.space {
            Space::Global => match &mut self.globals[arr as usize] {
                GBuf::Rw(b) => encode(p.elem, v, &mut b.bytes[idx as usize * es..]),
                _ => unreachable!("the type checker rejects writes to read-only slices"),
            },
            Space::Shared => {
                let mut bytes = [0u8; 16];
                encode(p.elem, v, &mut bytes);
                self.shared_access(th.linear, arr, idx as usize * es, es, Some(&bytes[..es]))?;
            }
            Space::Local => th.top_mut().arrays[arr as usize][idx as usize] = v,
        }
        Ok(())
    }

    /// A 16-byte load (`data == None`) or store at element `idx` of a place.
    fn vec_access(
        &mut self,
        th: &mut Thread,
        p: &Place,
        arr: u32,
        idx: u64,
        data: Option<[u8; 16]>,
    ) -> Result<[u8; 16], Hazard> {
        self.aligned_access(th, p, arr, idx, 16, data)
    }

    /// Like [`Self::vec_access`] for an aligned access of `n` (4, 8 or 16; local arrays: 16)
    /// bytes: the first `n` bytes of the result (or of `data`) are the ones accessed.
    fn aligned_access(
        &mut self,
        th: &mut Thread,
        p: &Place,
        arr: u32,
        idx: u64,
        n: u64,
        data: Option<[u8; 16]>,
    ) -> Result<[u8; 16], Hazard> {
        let es = p.elem.size() as u64;
        let byte = idx * es;
        let len = match p.space {
            Space::Global => self.globals[arr as usize].buffer().len() as u64,
            Space::Shared => self.shared[arr as usize].shadow.len() as u64,
            Space::Local => {
                if p.elem != Scalar::U32 {
                    return Err(Hazard::Unsupported("128-bit access to a non-u32 register array".into()));
                }
                th.top().arrays[arr as usize].len() as u64
            }
        };
        if byte % n != 0 {
            return Err(Hazard::Misaligned {
                buffer: p.name.clone(),
                index: idx,
                bytes: n as u32,
            });
        }
        let last = (byte + n).div_ceil(es) - 1;
        if last >= len {
            let write = data.is_some();
            return Err(Hazard::OutOfBounds {
                buffer: p.name.clone(),
                space: p.space,
                index: last as i64,
                len,
                write,
            });
        }
        let (b0, n) = (byte as usize, n as usize);
        if p.space == Space::Global && data.is_some() && !th.waited {
            return Err(write_before_grid_wait(p));
        }
        match p.space {
            Space::Global => match (&mut self.globals[arr as usize], data) {
                (GBuf::Rw(b), Some(d)) => {
                    b.bytes[b0..b0 + n].copy_from_slice(&d[..n]);
                    Ok(d)
                }
                (g, _) => {
                    let mut out = [0u8; 16];
                    out[..n].copy_from_slice(&g.buffer().bytes[b0..b0 + n]);
                    Ok(out)
                }
            },
            Space::Shared => self.shared_access(th.linear, arr, b0, n, data.as_ref().map(|d| &d[..n])),
            Space::Local => {
                debug_assert_eq!(n, 16, "only 128-bit accesses to register arrays");
                let a = &mut th.top_mut().arrays[arr as usize][idx as usize..idx as usize + 4];
                match data {
                    Some(d) => {
                        for (x, v) in a.iter_mut().zip(bytes_v4(&d)) {
                            *x = Val::U(v);
                        }
                        Ok(d)
                    }
                    None => Ok(v4_bytes(std::array::from_fn(|i| a[i].u32()))),
                }
            }
        }
    }

    /// Whether thread `t` is ordered after `other`'s access made at warp-sync count `at` (same
    /// warp, `sync_warp` since).
    fn warp_synced(&self, other: u32, t: u32, at: u32) -> bool {
        other / 32 == t / 32 && self.wsync[(t / 32) as usize] > at
    }

    /// Reads (`data == None`) or writes `n` bytes at `byte` of shared array `arr` on behalf of
    /// thread `t`, checking and recording the hazard state of every element touched.
    fn shared_access(
        &mut self,
        t: u32,
        arr: u32,
        byte: usize,
        n: usize,
        data: Option<&[u8]>,
    ) -> Result<[u8; 16], Hazard> {
        let (epoch, w) = (self.epoch, t / 32);
        let wsync = self.wsync[w as usize];
        let es = self.shared[arr as usize].esize;
        for e in byte / es..(byte + n).div_ceil(es) {
            let s = self.shared[arr as usize].shadow[e];
            let found = if data.is_none() {
                if s.pending {
                    Some((None, 0))
                } else if !s.init {
                    Some((Some(None), 0))
                } else if s.w_epoch == epoch && s.w_thread != t && !self.warp_synced(s.w_thread, t, s.w_wsync) {
                    Some((Some(Some(RaceKind::ReadAfterWrite)), s.w_thread))
                } else {
                    None
                }
            } else if s.w_epoch == epoch && s.w_thread != t && !self.warp_synced(s.w_thread, t, s.w_wsync) {
                Some((Some(Some(RaceKind::WriteWrite)), s.w_thread))
            } else {
                let other = if s.r_first != t { s.r_first } else { s.r_other };
                let foreign = s.r_first != t || s.r_many;
                let ordered = s.r_warp == w && wsync > s.r_wsync;
                (s.r_epoch == epoch && foreign && !ordered).then_some((Some(Some(RaceKind::WriteAfterRead)), other))
            };
            if let Some((what, other)) = found {
                let (buffer, index) = (self.k.shared[arr as usize].name.clone(), e as u64);
                return Err(match what {
                    None => Hazard::ReadBeforeWait { buffer, index },
                    Some(None) => Hazard::UninitializedRead { buffer, index },
                    Some(Some(kind)) => Hazard::Race {
                        kind,
                        buffer,
                        index,
                        other: self.thread_xyz(other),
                    },
                });
            }
            let s = &mut self.shared[arr as usize].shadow[e];
            if data.is_none() {
                if s.r_epoch != epoch {
                    *s = Shadow {
                        r_epoch: epoch,
                        r_first: t,
                        r_other: t,
                        r_many: false,
                        r_warp: w,
                        r_wsync: wsync,
                        ..*s
                    };
                } else {
                    if t != s.r_first {
                        s.r_many = true;
                        s.r_other = t;
                    }
                    if s.r_warp != w {
                        s.r_warp = MANY;
                    }
                    s.r_wsync = wsync;
                }
            } else {
                s.init = true;
                s.w_epoch = epoch;
                s.w_thread = t;
                s.w_wsync = wsync;
            }
        }
        let mem = &mut self.shared[arr as usize].bytes[byte..byte + n];
        let mut out = [0u8; 16];
        match data {
            Some(d) => mem.copy_from_slice(d),
            None => out[..n].copy_from_slice(mem),
        }
        Ok(out)
    }

    /// Delivers `cp.async` copies to shared memory.
    /// A copy of `n` bytes from `src` to shared `dst`, checked and recorded now; its data lands
    /// when the caller's completion mechanism (a `cp.async` wait, an mbarrier phase) says so.
    fn copy_async(
        &mut self,
        th: &mut Thread,
        (dp, dst): (&Place, Ref),
        (sp, src): (&Place, Ref),
        n: u64,
        pred: bool,
    ) -> Result<CopyAsync, Hazard> {
        let data = if pred {
            self.aligned_access(th, sp, src.arr, src.idx, n, None)?
        } else {
            [0u8; 16]
        };
        let es = dp.elem.size() as u64;
        let len = self.shared[dst.arr as usize].shadow.len() as u64;
        if dst.idx * es % n != 0 {
            return Err(Hazard::Misaligned {
                buffer: dp.name.clone(),
                index: dst.idx,
                bytes: n as u32,
            });
        }
        let end = (dst.idx * es + n).div_ceil(es);
        if end > len {
            let index = (end - 1) as i64;
            return Err(Hazard::OutOfBounds {
                buffer: dp.name.clone(),
                space: Space::Shared,
                index,
                len,
                write: true,
            });
        }
        let (byte, n) = ((dst.idx * es) as usize, n as usize);
        // Check and record the write now (it may land any time until it completes)...
        let old = self.shared[dst.arr as usize].bytes[byte..byte + n].to_vec();
        self.shared_access(th.linear, dst.arr, byte, n, Some(&old))?;
        // ...but deliver the data only then.
        let m = &mut self.shared[dst.arr as usize];
        for e in byte / m.esize..(byte + n).div_ceil(m.esize) {
            m.shadow[e].pending = true;
        }
        Ok(CopyAsync {
            arr: dst.arr,
            byte,
            len: n,
            data,
        })
    }

    /// The initialized mbarrier at `r`.
    fn mbar(&mut self, p: &Place, r: Ref) -> Result<&mut Mbar, Hazard> {
        self.mbars
            .get_mut(&(r.arr, r.idx))
            .ok_or_else(|| Hazard::Unsupported(format!("mbarrier `{}`[{}] used before `mbar_init`", p.name, r.idx)))
    }

    /// Completes the mbarrier's phase once every arrival is made and every byte counted: its
    /// copies land and the next phase starts.
    fn mbar_complete(&mut self, key: (u32, u64)) {
        let m = self.mbars.get_mut(&key).expect("an initialized mbarrier");
        if m.pending == 0 && m.tx == 0 {
            let copies = std::mem::take(&mut m.copies);
            m.phase += 1;
            m.pending = m.count;
            self.land(copies);
        }
    }

    fn land(&mut self, copies: Vec<CopyAsync>) {
        for c in copies {
            let m = &mut self.shared[c.arr as usize];
            m.bytes[c.byte..c.byte + c.len].copy_from_slice(&c.data[..c.len]);
            for e in c.byte / m.esize..(c.byte + c.len).div_ceil(m.esize) {
                m.shadow[e].pending = false;
                m.shadow[e].init = true;
            }
        }
    }

    fn eval(&mut self, th: &mut Thread, e: &CExpr) -> Result<Val, Hazard> {
        Ok(match e {
            CExpr::Const(v) => *v,
            CExpr::Slot(s) => th.top().slots[*s as usize],
            CExpr::Builtin(b) => Val::U(match b {
                Builtin::ThreadIdxX => th.tid[0],
                Builtin::ThreadIdxY => th.tid[1],
                Builtin::ThreadIdxZ => th.tid[2],
                Builtin::BlockIdxX => self.block[0],
                Builtin::BlockIdxY => self.block[1],
                Builtin::BlockIdxZ => self.block[2],
                Builtin::BlockDimX => self.k.block[0],
                Builtin::BlockDimY => self.k.block[1],
                Builtin::BlockDimZ => self.k.block[2],
                Builtin::GridDimX => self.grid[0],
                Builtin::GridDimY => self.grid[1],
                Builtin::GridDimZ => self.grid[2],
                Builtin::LaneId => th.tid[0] & 31,
                Builtin::WarpId => th.tid[0] >> 5,
            }),
            CExpr::Unary(op, ty, a) => unary(*op, *ty, self.eval(th, a)?),
            CExpr::Binary(op, ty, a, b) => {
                let (x, y) = (self.eval(th, a)?, self.eval(th, b)?);
                binary(*op, *ty, x, y)?
            }
            CExpr::And(a, b) => Val::B(self.eval(th, a)?.bool() && self.eval(th, b)?.bool()),
            CExpr::Or(a, b) => Val::B(self.eval(th, a)?.bool() || self.eval(th, b)?.bool()),
            CExpr::Cast(a, from, to) => cast(self.eval(th, a)?, *from, *to),
            CExpr::Bitcast(a, to) => {
                let bits = self.eval(th, a)?.u32();
                if *to == Scalar::F32 {
                    Val::F(f32::from_bits(bits))
                } else {
                    Val::U(bits)
                }
            }
            CExpr::Load(p) => {
                let (arr, idx) = self.resolve(th, p, false)?;
                self.load(th, p, arr, idx)?
            }
            CExpr::VecLoad(p) => {
                let (arr, idx) = self.resolve(th, p, false)?;
                Val::V4(bytes_v4(&self.vec_access(th, p, arr, idx, None)?))
            }
            CExpr::Field(a, l) => match self.eval(th, a)? {
                Val::V4(v) => Val::U(v[*l as usize]),
                other => unreachable!("lane of a non-u32x4 {other:?}"),
            },
            CExpr::AddrOf(p) => {
                let (arr, idx) = self.resolve(th, p, false)?;
                Val::Ref(Ref {
                    space: p.space,
                    arr,
                    idx,
                })
            }
            CExpr::Select(c, a, b) => {
                if self.eval(th, c)?.bool() {
                    self.eval(th, a)?
                } else {
                    self.eval(th, b)?
                }
            }
            CExpr::Math(name, ty, args) => {
                let mut v = [Val::Void; 3];
                for (slot, a) in v.iter_mut().zip(args) {
                    *slot = self.eval(th, a)?;
                }
                math(name, *ty, &v[..args.len()])
            }
            CExpr::Intrinsic(i, args) => {
                let mut v = [Val::Void; 4];
                for (slot, a) in v.iter_mut().zip(args) {
                    *slot = self.eval(th, a)?;
                }
                self.intrinsic(th, *i, &v[..args.len()], args)?
            }
        })
    }

    /// A per-thread intrinsic on evaluated arguments (`exprs` gives the places of references).
    fn intrinsic(&mut self, th: &mut Thread, i: Intrinsic, a: &[Val], exprs: &[CExpr]) -> Result<Val, Hazard> {
        use Intrinsic::*;
        let place = |k: usize| match &exprs[k] {
            CExpr::AddrOf(p) => p,
            _ => unreachable!("intrinsic reference argument is `&x[i]`"),
        };
        let r = |k: usize| match a[k] {
            Val::Ref(r) => r,
            other => unreachable!("expected a reference, got {other:?}"),
        };
        Ok(match i {
            PackBf16x2 => Val::U((f32_to_bf16(a[1].f32()) as u32) << 16 | f32_to_bf16(a[0].f32()) as u32),
            PackF16x2 => Val::U((f32_to_f16(a[1].f32()) as u32) << 16 | f32_to_f16(a[0].f32()) as u32),
            Bf16Lo => Val::F(bf16_to_f32(a[0].u32() as u16)),
            Bf16Hi => Val::F(bf16_to_f32((a[0].u32() >> 16) as u16)),
            F16Lo => Val::F(f16_to_f32(a[0].u32() as u16)),
            F16Hi => Val::F(f16_to_f32((a[0].u32() >> 16) as u16)),
            Lop3 => Val::U(lop3(a[0].u32(), a[1].u32(), a[2].u32(), a[3].u32())),
            Prmt => Val::U(prmt(a[0].u32(), a[1].u32(), a[2].u32())),
            // Blocks run one after another: every earlier write is already visible.
            ThreadFence => Val::Void,
            // Launches run one after another; only the order against global writes is checked.
            GridWait => {
                th.waited = true;
                Val::Void
            }
            GridLaunchDependents => Val::Void,
            // The wgmma below runs at its issue, so its fences, groups and waits have nothing
            // left to order.
            WgmmaFence | WgmmaCommit | WgmmaWait | FenceProxyAsync => Val::Void,
            WgmmaDesc => {
                let (p, x) = (place(0), r(0));
                let m = &self.shared[x.arr as usize];
                let byte = m.base + x.idx * m.esize as u64;
                if byte % 16 != 0 {
                    return Err(Hazard::Misaligned {
                        buffer: p.name.clone(),
                        index: x.idx,
                        bytes: 16,
                    });
                }
                if byte >> 4 > u64::from(DESC_ADDR) {
                    return Err(Hazard::Unsupported(format!(
                        "`wgmma_desc` of `{}`[{}]: byte {byte} of shared memory is past the 14-bit descriptor address",
                        p.name, x.idx
                    )));
                }
                Val::U((byte >> 4) as u32 | DESC_GROUPS)
            }
            FmaBf16x2 => Val::U(fma_bf16x2(a[0].u32(), a[1].u32(), a[2].u32())),
            Exp2Approx => Val::F(exp2_ftz(a[0].f32())),
            AtomicAdd | AtomicMax | AtomicMin | AtomicOr | AtomicAnd | AtomicExch | AtomicCas => {
                let (p, dst) = (place(0), r(0));
                if dst.space == Space::Global && !th.waited {
                    return Err(write_before_grid_wait(p));
                }
                let old = self.atomic_load(th, p, dst)?;
                let new = match (i, old) {
                    (AtomicAdd, Val::F(x)) => Val::F(x + a[1].f32()),
                    (AtomicAdd, Val::U64(x)) => Val::U64(x.wrapping_add(a[1].u64())),
                    (AtomicAdd, Val::I(x)) => Val::I(x.wrapping_add(a[1].i32())),
                    (AtomicAdd, x) => Val::U(x.u32().wrapping_add(a[1].u32())),
                    (AtomicMax | AtomicMin, x) => {
                        let lt = binary(crate::ir::BinOp::Lt, p.elem, x, a[1])?.bool();
                        if lt == (i == AtomicMax) {
                            a[1]
                        } else {
                            x
                        }
                    }
                    (AtomicOr, x) => binary(crate::ir::BinOp::BitOr, p.elem, x, a[1])?,
                    (AtomicAnd, x) => binary(crate::ir::BinOp::BitAnd, p.elem, x, a[1])?,
                    (AtomicExch, _) => a[1],
                    (_, x) => {
                        if x == a[1] {
                            a[2]
                        } else {
                            x
                        }
                    }
                };
                self.atomic_store(p, dst, new);
                old
            }
            CpAsync16 | CpAsync16Zfill | CpAsync8 | CpAsync8Zfill | CpAsync4 | CpAsync4Zfill => {
                let (n, zfill) = i.cp_async_bytes().expect("a cp.async copy");
                let pred = !zfill || a[2].bool();
                let c = self.copy_async(th, (place(0), r(0)), (place(1), r(1)), n as u64, pred)?;
                th.open.push(c);
                Val::Void
            }
            MbarInit => {
                let key = (r(0).arr, r(0).idx);
                let count = a[1].u32();
                self.mbars.insert(
                    key,
                    Mbar {
                        count,
                        pending: count,
                        tx: 0,
                        phase: 0,
                        copies: Vec::new(),
                    },
                );
                Val::Void
            }
            MbarArriveTx => {
                let m = self.mbar(place(0), r(0))?;
                if m.pending == 0 {
                    return Err(Hazard::Unsupported(format!(
                        "`mbar_arrive_tx` on `{}`[{}]: more arrivals than its count",
                        place(0).name,
                        r(0).idx
                    )));
                }
                m.pending -= 1;
                m.tx += i64::from(a[1].u32());
                self.mbar_complete((r(0).arr, r(0).idx));
                Val::Void
            }
            MbarWait => {
                let m = self.mbar(place(0), r(0))?;
                if m.phase % 2 == a[1].u32() % 2 {
                    // Not completed: the thread blocks here and runs the wait again once it has.
                    th.status = Status::Mbar((r(0).arr, r(0).idx), a[1].u32() % 2);
                }
                Val::Void
            }
            CpAsyncBulk => {
                let bytes = u64::from(a[2].u32());
                let (dp, sp) = (place(0), place(1));
                let (dst, src) = (r(0), r(1));
                if bytes % 16 != 0 {
                    return Err(Hazard::Misaligned {
                        buffer: sp.name.clone(),
                        index: src.idx,
                        bytes: 16,
                    });
                }
                self.mbar(place(3), r(3))?;
                let (de, se) = (dp.elem.size() as u64, sp.elem.size() as u64);
                let mut copies = Vec::new();
                for off in (0..bytes).step_by(16) {
                    let d = Ref {
                        idx: dst.idx + off / de,
                        ..dst
                    };
                    let s = Ref {
                        idx: src.idx + off / se,
                        ..src
                    };
                    copies.push(self.copy_async(th, (dp, d), (sp, s), 16, true)?);
                }
                // The copy is ordered for its readers by the mbarrier (a read before the phase
                // completes is `ReadBeforeWait`), not by this epoch's barrier: its write was
                // checked against this epoch's reads above, and reads after the wait are not
                // races with the issuing thread.
                for c in &copies {
                    let m = &mut self.shared[c.arr as usize];
                    for e in c.byte / m.esize..(c.byte + c.len).div_ceil(m.esize) {
                        m.shadow[e].w_epoch = 0;
                    }
                }
                let key = (r(3).arr, r(3).idx);
                let m = self.mbars.get_mut(&key).expect("checked above");
                m.copies.extend(copies);
                m.tx -= bytes as i64;
                self.mbar_complete(key);
                Val::Void
            }
            CpAsyncCommit => {
                let g = std::mem::take(&mut th.open);
                th.groups.push(g);
                Val::Void
            }
            CpAsyncWait => {
                let keep = a[0].u32() as usize;
                while th.groups.len() > keep {
                    let g = th.groups.remove(0);
                    self.land(g);
                }
                Val::Void
            }
            other => unreachable!("collective `{}` evaluated per thread", other.dsl_name()),
        })
    }

    fn atomic_load(&mut self, th: &mut Thread, p: &Place, r: Ref) -> Result<Val, Hazard> {
        let es = p.elem.size() as usize;
        Ok(match r.space {
            Space::Shared => {
                let s = self.shared[r.arr as usize].shadow[r.idx as usize];
                if !s.init {
                    return Err(Hazard::UninitializedRead {
                        buffer: p.name.clone(),
                        index: r.idx,
                    });
                }
                decode(p.elem, &self.shared[r.arr as usize].bytes[r.idx as usize * es..])
            }
            _ => self.load(th, p, r.arr, r.idx)?,
        })
    }

    fn atomic_store(&mut self, p: &Place, r: Ref, v: Val) {
        let es = p.elem.size() as usize;
        match r.space {
            // Atomics never race with each other: no hazard bookkeeping.
            Space::Shared => encode(p.elem, v, &mut self.shared[r.arr as usize].bytes[r.idx as usize * es..]),
            _ => {
                if let GBuf::Rw(b) = &mut self.globals[r.arr as usize] {
                    encode(p.elem, v, &mut b.bytes[r.idx as usize * es..]);
                }
            }
        }
    }

    /// The position every thread of `lanes` waits at (a `what`), or the divergence.
    fn converged(&self, lanes: &[Thread], what: &str) -> Result<(u32, usize, Loc), InterpError> {
        let (func, pc, loc) = self.position(&lanes[0]);
        for t in lanes.iter() {
            let (f2, p2, l2) = self.position(t);
            if (f2, p2) != (func, pc) {
                let msg = format!(
                    "thread {:?} is at the {what} at {l2} while thread {:?} is at the one at {loc}",
                    t.tid, lanes[0].tid
                );
                return Err(self.error(&lanes[0], func, loc, Hazard::WarpDivergence(msg)));
            }
        }
        Ok((func, pc, loc))
    }

    /// Executes the warp collective every lane of warp `w` waits at.
    fn collective(&mut self, w: usize, lanes: &mut [Thread]) -> Result<(), InterpError> {
        let k: &'k Lowered = self.k;
        let (func, pc, loc) = self.converged(lanes, "collective")?;
        let Op::Warp { op, args, dst } = &k.funcs[func as usize].ops[pc].op else {
            unreachable!("lanes wait at a collective")
        };
        debug_assert!(is_collective(*op));
        if lanes.len() < 32 {
            let msg = format!("`{}` in a partial warp of {} threads", op.dsl_name(), lanes.len());
            return Err(self.error(&lanes[0], func, loc, Hazard::WarpDivergence(msg)));
        }
        let mut vals = [[Val::Void; 3]; 32];
        for (l, th) in lanes.iter_mut().enumerate() {
            for (j, a) in args.iter().enumerate() {
                vals[l][j] = self.eval(th, a).map_err(|h| self.error(th, func, loc, h))?;
            }
        }
        let mut out = [Val::Void; 32];
        use Intrinsic::*;
        match op {
            SyncWarp => self.wsync[w] += 1,
            ShflXor | ShflDown | ShflUp | ShflIdx => {
                for (l, o) in out.iter_mut().enumerate() {
                    let x = vals[l][1].u32() as usize;
                    let src = match op {
                        ShflXor => (l ^ x) & 31,
                        ShflDown if l + x < 32 => l + x,
                        ShflUp if l >= x => l - x,
                        ShflIdx => x & 31,
                        _ => l,
                    };
                    *o = vals[src][0];
                }
            }
            Ballot | VoteAny | VoteAll => {
                let mask = (0..32).filter(|&l| vals[l][0].bool()).fold(0u32, |m, l| m | 1 << l);
                let v = match op {
                    Ballot => Val::U(mask),
                    VoteAny => Val::B(mask != 0),
                    _ => Val::B(mask == u32::MAX),
                };
                out = [v; 32];
            }
            MmaBf16 | MmaF16 => {
                let row = |th: &Thread, v: Val, n: usize| -> Vec<Val> {
                    let Val::Ref(r) = v else {
                        unreachable!("mma operands are register rows")
                    };
                    th.top().arrays[r.arr as usize][r.idx as usize..r.idx as usize + n].to_vec()
                };
                let mut d = [[0f32; 4]; 32];
                let mut a = [[0u32; 4]; 32];
                let mut b = [[0u32; 2]; 32];
                for (l, th) in lanes.iter().enumerate() {
                    for (j, x) in row(th, vals[l][0], 4).into_iter().enumerate() {
                        d[l][j] = x.f32();
                    }
                    for (j, x) in row(th, vals[l][1], 4).into_iter().enumerate() {
                        a[l][j] = x.u32();
                    }
                    for (j, x) in row(th, vals[l][2], 2).into_iter().enumerate() {
                        b[l][j] = x.u32();
                    }
                }
                mma_m16n8k16(&mut d, &a, &b, *op == MmaBf16);
                for (l, th) in lanes.iter_mut().enumerate() {
                    let Val::Ref(r) = vals[l][0] else { unreachable!() };
                    for (j, x) in d[l].iter().enumerate() {
                        th.top_mut().arrays[r.arr as usize][r.idx as usize + j] = Val::F(*x);
                    }
                }
            }
            _ => {
                // ldmatrix: lanes 8j..8j+7 give the row addresses of matrix j.
                let (n, trans) = match op {
                    LdmatrixX1 => (1, false),
                    LdmatrixX2 => (2, false),
                    LdmatrixX4 => (4, false),
                    LdmatrixX2Trans => (2, true),
                    _ => (4, true),
                };
                let CExpr::AddrOf(src) = &args[1] else {
                    unreachable!("ldmatrix reads `&shared[i]`")
                };
                let mut m = [[[0u16; 8]; 8]; 4];
                for (j, mat) in m.iter_mut().enumerate().take(n) {
                    for (rr, row) in mat.iter_mut().enumerate() {
                        let l = 8 * j + rr;
                        let Val::Ref(r) = vals[l][1] else { unreachable!() };
                        let bytes = self
                            .ldmatrix_row(lanes[l].linear, src, r)
                            .map_err(|h| self.error(&lanes[l], func, loc, h))?;
                        for (c, x) in row.iter_mut().enumerate() {
                            *x = u16::from_le_bytes([bytes[2 * c], bytes[2 * c + 1]]);
                        }
                    }
                }
                for (l, th) in lanes.iter_mut().enumerate() {
                    let (g, t) = (l / 4, l % 4);
                    let Val::Ref(r) = vals[l][0] else { unreachable!() };
                    for (j, mat) in m.iter().enumerate().take(n) {
                        let (lo, hi) = if trans {
                            (mat[2 * t][g], mat[2 * t + 1][g])
                        } else {
                            (mat[g][2 * t], mat[g][2 * t + 1])
                        };
                        th.top_mut().arrays[r.arr as usize][r.idx as usize + j] = Val::U((hi as u32) << 16 | lo as u32);
                    }
                }
            }
        }
        for (l, th) in lanes.iter_mut().enumerate() {
            let f = th.top_mut();
            if let Some(d) = dst {
                f.slots[*d as usize] = out[l];
            }
            f.pc += 1;
            th.status = Status::Running;
        }
        Ok(())
    }

    /// Whether thread `th` waits at a warpgroup collective.
    fn at_warpgroup_op(&self, th: &Thread) -> bool {
        let (func, pc, _) = self.position(th);
        matches!(&self.k.funcs[func as usize].ops[pc].op, Op::Warp { op, .. } if is_warpgroup(*op))
    }

    /// Executes the `wgmma` all 128 threads of a warpgroup wait at (shared operands read
    /// now, on behalf of the warpgroup's first thread).
    fn warpgroup(&mut self, lanes: &mut [Thread]) -> Result<(), InterpError> {
        let k: &'k Lowered = self.k;
        let (func, pc, loc) = self.converged(lanes, "warpgroup collective")?;
        let Op::Warp { op, args, .. } = &k.funcs[func as usize].ops[pc].op else {
            unreachable!("threads wait at a warpgroup collective")
        };
        let mut vals = Vec::with_capacity(128);
        for th in lanes.iter_mut() {
            let mut v = [Val::Void; 5];
            for (j, a) in args.iter().enumerate() {
                v[j] = self.eval(th, a).map_err(|h| self.error(th, func, loc, h))?;
            }
            vals.push(v);
        }
        let row = |v: Val| -> Ref {
            let Val::Ref(r) = v else {
                unreachable!("wgmma operands are register rows")
            };
            r
        };
        let ss = *op == Intrinsic::WgmmaBf16Ss;
        // B K-major (`ss`, `rs`) or N-major (`rs_mn`).
        let b_kmajor = ss || *op == Intrinsic::WgmmaBf16Rs;
        // `ss` and `rs` carry N as their last argument (from the accumulator row's type); `rs`
        // has its `accumulate` flag before it.
        let rs = *op == Intrinsic::WgmmaBf16Rs;
        let n = if b_kmajor {
            vals[0][if rs { 4 } else { 3 }].u32() as usize
        } else {
            64
        };
        let accumulate = !rs || vals[0][3].bool();
        let t0 = lanes[0].linear;
        let err = |s: &Self, h| s.error(&lanes[0], func, loc, h);
        if rs && vals.iter().any(|v| v[3].bool() != accumulate) {
            let msg = "`wgmma_bf16_rs`'s `accumulate` differs within the warpgroup".to_string();
            return Err(err(self, Hazard::WarpDivergence(msg)));
        }
        // The shared array and byte offset a descriptor (`wgmma_desc` plus offsets) points at.
        let operand = |s: &Self, a: usize| -> Result<(u32, u64), Hazard> {
            let d = vals[0][a].u32();
            let byte = u64::from(d & DESC_ADDR) << 4;
            let hit = s
                .shared
                .iter()
                .position(|m| byte >= m.base && byte < m.base + m.bytes.len() as u64);
            match hit {
                Some(arr) if d & !DESC_ADDR == DESC_GROUPS => Ok((arr as u32, byte - s.shared[arr].base)),
                _ => Err(Hazard::Unsupported(format!(
                    "`wgmma` operand descriptor {d:#x} does not point into shared memory (an offset \
                     carried out of its 14-bit address, or it is not from `wgmma_desc`)"
                ))),
            }
        };
        let ops = [1, 2]
            .map(|a| (a, ss || a == 2))
            .map(|(a, shared)| shared.then(|| operand(self, a)));
        // Operand element (row, col) of a swizzled operand: K-major rows (A, and B of `ss`) hold
        // 16 k values; N-major rows (B of `rs_mn`) hold 64 n values.
        let read = |s: &mut Self, a: usize, rr: usize, cc: usize, mn: bool| -> Result<f32, Hazard> {
            let (arr, base) = ops[a - 1].clone().expect("a shared operand")?;
            let name = || s.k.shared[arr as usize].name.clone();
            let ok = if mn {
                base % 1024 == 0
            } else {
                base % 32 == 0 && base % 1024 < 128
            };
            if !ok {
                return Err(Hazard::Misaligned {
                    buffer: name(),
                    index: base / 2,
                    bytes: if mn { 1024 } else { 32 },
                });
            }
            let lin = base + 1024 * (rr as u64 / 8) + 128 * (rr as u64 % 8) + 2 * cc as u64;
            let phys = lin ^ (((lin >> 7) & 7) << 4);
            let len = s.shared[arr as usize].shadow.len() as u64;
            if phys / 2 >= len {
                return Err(Hazard::OutOfBounds {
                    buffer: name(),
                    space: Space::Shared,
                    index: (phys / 2) as i64,
                    len,
                    write: false,
                });
            }
            let b = s.shared_access(t0, arr, phys as usize, 2, None)?;
            Ok(bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
        };
        let mut am = vec![[0f32; 16]; 64];
        let mut bm = vec![[0f32; 16]; n];
        for (m, arow) in am.iter_mut().enumerate() {
            for (kk, x) in arow.iter_mut().enumerate() {
                *x = if ss {
                    read(self, 1, m, kk, false).map_err(|h| err(self, h))?
                } else {
                    // A in registers: warp m / 16, the mma.m16n8k16 A fragment.
                    let (w, r, c) = (m / 16, m % 16, kk);
                    let lane = (r % 8) * 4 + (c % 8) / 2;
                    let reg = (r / 8) + 2 * (c / 8);
                    let ar = row(vals[w * 32 + lane][1]);
                    let v = lanes[w * 32 + lane].top().arrays[ar.arr as usize][ar.idx as usize + reg].u32();
                    bf16_to_f32(if c % 2 == 0 { v as u16 } else { (v >> 16) as u16 })
                };
            }
        }
        for (j, brow) in bm.iter_mut().enumerate() {
            for (kk, x) in brow.iter_mut().enumerate() {
                *x = if b_kmajor {
                    read(self, 2, j, kk, false)
                } else {
                    read(self, 2, kk, j, true)
                }
                .map_err(|h| err(self, h))?;
            }
        }
        for (l, th) in lanes.iter_mut().enumerate() {
            let (w, g, q) = (l / 32, (l % 32) / 4, l % 4);
            let dr = row(vals[l][0]);
            for j in 0..n / 8 {
                for e in 0..4 {
                    let (m, c) = (16 * w + g + 8 * (e / 2), 8 * j + 2 * q + e % 2);
                    // Products of bf16 values are exact in f32; sum them, then accumulate.
                    let dot: f32 = (0..16).map(|kk| am[m][kk] * bm[c][kk]).sum();
                    let slot = &mut th.top_mut().arrays[dr.arr as usize][dr.idx as usize + 4 * j + e];
                    *slot = Val::F(if accumulate { slot.f32() + dot } else { dot });
                }
            }
        }
        for th in lanes.iter_mut() {
            th.top_mut().pc += 1;
            th.status = Status::Running;
        }
        Ok(())
    }

    /// One 16-byte `ldmatrix` row read by thread `t`.
    fn ldmatrix_row(&mut self, t: u32, p: &Place, r: Ref) -> Result<[u8; 16], Hazard> {
        let es = p.elem.size() as u64;
        let len = self.shared[r.arr as usize].shadow.len() as u64;
        if r.idx * es % 16 != 0 {
            return Err(Hazard::Misaligned {
                buffer: p.name.clone(),
                index: r.idx,
                bytes: 16,
            });
        }
        if r.idx + 16 / es > len {
            let index = (r.idx + 16 / es - 1) as i64;
            return Err(Hazard::OutOfBounds {
                buffer: p.name.clone(),
                space: Space::Shared,
                index,
                len,
                write: false,
            });
        }
        self.shared_access(t, r.arr, (r.idx * es) as usize, 16, None)
    }
}

fn write_before_grid_wait(p: &Place) -> Hazard {
    Hazard::WriteBeforeGridWait { buffer: p.name.clone() }
}
