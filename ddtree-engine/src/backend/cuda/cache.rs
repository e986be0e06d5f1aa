//! The latent KV cache on the GPU: allocation from the spare pool, appends, truncation and the
//! compaction of accepted tree rows.

#[allow(unused_imports)]
use super::*;
use ddtree_kernels::tree::op::CompactRowsOp;

impl CudaBackend {
    /// [`Backend::kv_fill_random`] on the GPU.
    pub(super) fn kv_fill_random(&self, cache: &mut CudaKvCache, len: usize, seed: u64) -> Result<()> {
        let _span = self.profile.span("kv_fill_random");
        if len > cache.capacity {
            return Err(fail(format!(
                "kv_fill_random: {len} rows exceed the capacity {}",
                cache.capacity
            )));
        }
        let n = cache.buf().len();
        self.fill_bf16(cache.buf_mut(), n, -1.0, 1.0, seed)?;
        cache.lens.iter_mut().for_each(|l| *l = len);
        Ok(())
    }

    /// [`Backend::new_kv_cache`] on the GPU.
    pub(super) fn new_kv_cache(&self, layers: usize, row_width: usize, capacity: usize) -> Result<CudaKvCache> {
        let _span = self.profile.span("new_kv_cache");
        if row_width == 0 {
            return Err(fail("KV cache rows must not be empty".into()));
        }
        {
            let mut st = self.state();
            st.max_capacity = st.max_capacity.max(capacity);
        }
        let n = (layers * capacity * row_width).max(1);
        let spare = {
            let mut pool = self.caches.lock().expect("cache pool lock");
            pool.iter().position(|b| b.len() == n).map(|i| pool.swap_remove(i))
        };
        let buf = match spare {
            Some(mut buf) => {
                self.stream()
                    .memset_zeros(&mut buf)
                    .map_err(drv("clearing the KV cache"))?;
                buf
            }
            None => {
                // Free a spare of another size first: caches are the largest buffers.
                self.caches.lock().expect("cache pool lock").clear();
                self.stream()
                    .alloc_zeros::<bf16>(n)
                    .map_err(drv("allocating the KV cache"))?
            }
        };
        Ok(CudaKvCache {
            width: row_width,
            capacity,
            lens: vec![0; layers],
            buf: Some(buf),
            pool: self.caches.clone(),
            _live: crate::backend::LiveCache::new(),
        })
    }

    /// [`Backend::kv_append`] on the GPU.
    pub(super) fn kv_append(&self, cache: &mut CudaKvCache, layer: usize, rows: &CudaTensor) -> Result<()> {
        let _span = self.profile.span("kv_append");
        if layer >= cache.lens.len() || rows.cols != cache.width {
            return Err(fail(format!("kv_append: bad layer {layer} or width {}", rows.cols)));
        }
        let start = cache.lens[layer];
        if start + rows.rows > cache.capacity {
            return Err(EngineError::Forward(format!(
                "cache full: {start} + {} rows exceed its capacity of {}",
                rows.rows, cache.capacity
            )));
        }
        let idx = self.identity(rows.rows)?;
        let w = cache.width;
        let mut layer_rows = cache.layer_mut(layer);
        let mut dst = layer_rows.slice_mut(start * w..);
        self.copy_rows(rows.bf16("kv_append")?, &idx, &mut dst, rows.rows, w, (w, 0), (w, 0))?;
        cache.lens[layer] = start + rows.rows;
        Ok(())
    }

    /// [`Backend::kv_len`] on the GPU.
    pub(super) fn kv_len(&self, cache: &CudaKvCache) -> usize {
        cache.lens.first().copied().unwrap_or(0)
    }

    /// [`Backend::kv_truncate`] on the GPU.
    pub(super) fn kv_truncate(&self, cache: &mut CudaKvCache, len: usize) -> Result<()> {
        let _span = self.profile.span("kv_truncate");
        cache.lens.iter_mut().for_each(|l| *l = (*l).min(len));
        Ok(())
    }

    /// [`Backend::kv_compact`] on the GPU.
    pub(super) fn kv_compact(&self, cache: &mut CudaKvCache, base: usize, keep: &[usize]) -> Result<()> {
        let _span = self.profile.span("kv_compact");
        let len = self.kv_len(cache);
        let ascending = keep.windows(2).all(|w| w[0] < w[1]);
        if !ascending || keep.last().is_some_and(|&k| base + k >= len) {
            return Err(EngineError::Forward(format!(
                "kv_compact: keep list {keep:?} after row {base} must ascend and stay below {len}"
            )));
        }
        let moved: Vec<u32> = keep.iter().map(|&k| k as u32).collect();
        if moved.iter().enumerate().any(|(i, &k)| k as usize != i) {
            let accepted = self.upload(&moved)?;
            let count = self.upload(&[moved.len() as u32])?;
            let k = self.variant::<tree::CompactRows>(&())?;
            let layers = cache.lens.len();
            check_u32("kv_compact", cache.capacity * cache.width)?;
            let op = CompactRowsOp {
                layers,
                base,
                row_len: cache.width,
                layer_stride: cache.capacity * cache.width,
                buf: cache.buf_mut(),
                accepted: &accepted,
                accept_len: &count,
            };
            // SAFETY: every kept row is below len; rows move down in ascending order.
            unsafe { op.launch(&k, self.stream())? };
        }
        cache.lens.iter_mut().for_each(|l| *l = base + keep.len());
        Ok(())
    }
}
