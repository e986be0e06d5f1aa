//! Warp collectives and warpgroup operations: convergence, shuffles and votes, `wgmma` and
//! `ldmatrix`.

#[allow(unused_imports)]
use super::*;

impl<'k> Exec<'k, '_> {
    /// The position every thread of `lanes` waits at (a `what`), or the divergence.
    pub(super) fn converged(&self, lanes: &[Thread], what: &str) -> Result<(u32, usize, Loc), InterpError> {
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
    pub(super) fn collective(&mut self, w: usize, lanes: &mut [Thread]) -> Result<(), InterpError> {
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
    pub(super) fn at_warpgroup_op(&self, th: &Thread) -> bool {
        let (func, pc, _) = self.position(th);
        matches!(&self.k.funcs[func as usize].ops[pc].op, Op::Warp { op, .. } if is_warpgroup(*op))
    }

    /// Executes the `wgmma` all 128 threads of a warpgroup wait at (shared operands read
    /// now, on behalf of the warpgroup's first thread).
    pub(super) fn warpgroup(&mut self, lanes: &mut [Thread]) -> Result<(), InterpError> {
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
    pub(super) fn ldmatrix_row(&mut self, t: u32, p: &Place, r: Ref) -> Result<[u8; 16], Hazard> {
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
