//! Expression evaluation: operators, intrinsics and atomics.

#[allow(unused_imports)]
use super::*;

impl<'k> Exec<'k, '_> {
    pub(super) fn eval(&mut self, th: &mut Thread, e: &CExpr) -> Result<Val, Hazard> {
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
    pub(super) fn intrinsic(
        &mut self,
        th: &mut Thread,
        i: Intrinsic,
        a: &[Val],
        exprs: &[CExpr],
    ) -> Result<Val, Hazard> {
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

    pub(super) fn atomic_load(&mut self, th: &mut Thread, p: &Place, r: Ref) -> Result<Val, Hazard> {
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

    pub(super) fn atomic_store(&mut self, p: &Place, r: Ref, v: Val) {
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
}
