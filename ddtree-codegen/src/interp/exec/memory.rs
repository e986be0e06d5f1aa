//! Memory accesses of the interpreter: places, loads and stores, shared-memory hazards,
//! async copies and mbarriers.

#[allow(unused_imports)]
use super::*;

impl<'k> Exec<'k, '_> {
    /// The buffer/array and flat element index of a place, bounds-checked.
    pub(super) fn resolve(&mut self, th: &mut Thread, p: &Place, write: bool) -> Result<(u32, u64), Hazard> {
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

    pub(super) fn load(&mut self, th: &mut Thread, p: &Place, arr: u32, idx: u64) -> Result<Val, Hazard> {
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

    pub(super) fn store(&mut self, th: &mut Thread, p: &Place, arr: u32, idx: u64, v: Val) -> Result<(), Hazard> {
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
    pub(super) fn vec_access(
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
    pub(super) fn aligned_access(
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
    pub(super) fn warp_synced(&self, other: u32, t: u32, at: u32) -> bool {
        other / 32 == t / 32 && self.wsync[(t / 32) as usize] > at
    }

    /// Reads (`data == None`) or writes `n` bytes at `byte` of shared array `arr` on behalf of
    /// thread `t`, checking and recording the hazard state of every element touched.
    pub(super) fn shared_access(
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
    pub(super) fn copy_async(
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
    pub(super) fn mbar(&mut self, p: &Place, r: Ref) -> Result<&mut Mbar, Hazard> {
        self.mbars
            .get_mut(&(r.arr, r.idx))
            .ok_or_else(|| Hazard::Unsupported(format!("mbarrier `{}`[{}] used before `mbar_init`", p.name, r.idx)))
    }

    /// Completes the mbarrier's phase once every arrival is made and every byte counted: its
    /// copies land and the next phase starts.
    pub(super) fn mbar_complete(&mut self, key: (u32, u64)) {
        let m = self.mbars.get_mut(&key).expect("an initialized mbarrier");
        if m.pending == 0 && m.tx == 0 {
            let copies = std::mem::take(&mut m.copies);
            m.phase += 1;
            m.pending = m.count;
            self.land(copies);
        }
    }

    pub(super) fn land(&mut self, copies: Vec<CopyAsync>) {
        for c in copies {
            let m = &mut self.shared[c.arr as usize];
            m.bytes[c.byte..c.byte + c.len].copy_from_slice(&c.data[..c.len]);
            for e in c.byte / m.esize..(c.byte + c.len).div_ceil(m.esize) {
                m.shadow[e].pending = false;
                m.shadow[e].init = true;
            }
        }
    }
}
