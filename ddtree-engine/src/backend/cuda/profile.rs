//! Host-side op profiling of the CUDA backend (`DDTREE_HOST_PROFILE`).

#[allow(unused_imports)]
use super::*;

/// Set to `1` to time every backend op on the host (its enqueue cost), to `sync` to wait for the
/// GPU at the end of every op (each op's GPU time, serialized, launch latency included), or to
/// `gpu` to bracket every op with CUDA events (each op's GPU time in the steady stream, gaps
/// between kernels included, nothing serialized); the table, per op and per forward row count,
/// is printed to stderr when the backend is dropped.
pub const HOST_PROFILE_ENV: &str = "DDTREE_HOST_PROFILE";

/// How [`HostProfile`] times an op.
pub(super) enum ProfileMode {
    Host,
    Sync(Arc<CudaStream>),
    Events(Arc<CudaStream>),
}

/// Time per backend op and forward row count (see [`HOST_PROFILE_ENV`]).
pub(super) struct HostProfile {
    mode: Option<ProfileMode>,
    /// Rows of the forward in flight (set by the embedding, its first op).
    rows: std::sync::atomic::AtomicUsize,
    ops: Mutex<Vec<(&'static str, usize, u64, f64)>>,
    /// Event pairs not yet read back (events mode).
    pending: Mutex<Vec<(&'static str, usize, CudaEvent, CudaEvent)>>,
}

/// One op being timed; adds its time when dropped.
pub(super) struct Span<'a> {
    profile: &'a HostProfile,
    op: &'static str,
    rows: usize,
    start: std::time::Instant,
    event: Option<CudaEvent>,
}

/// Timing events (cudarc's default disables timing).
pub(super) const CU_EVENT_DEFAULT: ddtree_runtime::cudarc::driver::sys::CUevent_flags =
    ddtree_runtime::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;

/// Event pairs kept before they are read back (one synchronization per batch).
pub(super) const PROFILE_EVENT_BATCH: usize = 4096;

impl HostProfile {
    pub(super) fn from_env(stream: &Arc<CudaStream>) -> HostProfile {
        let mode = match std::env::var(HOST_PROFILE_ENV).unwrap_or_default().as_str() {
            "1" => Some(ProfileMode::Host),
            "sync" => Some(ProfileMode::Sync(stream.clone())),
            "gpu" => Some(ProfileMode::Events(stream.clone())),
            _ => None,
        };
        HostProfile {
            mode,
            rows: Default::default(),
            ops: Mutex::new(Vec::new()),
            pending: Mutex::new(Vec::new()),
        }
    }

    pub(super) fn span(&self, op: &'static str) -> Option<Span<'_>> {
        let mode = self.mode.as_ref()?;
        // A failed record only loses this op's time; the profile only measures.
        let event = match mode {
            ProfileMode::Events(s) => s.record_event(Some(CU_EVENT_DEFAULT)).ok(),
            _ => None,
        };
        Some(Span {
            profile: self,
            op,
            rows: self.rows.load(std::sync::atomic::Ordering::Relaxed),
            start: std::time::Instant::now(),
            event,
        })
    }

    /// Whether ops are being timed.
    pub(super) fn on(&self) -> bool {
        self.mode.is_some()
    }

    /// Marks the start of a forward of `rows` rows.
    pub(super) fn forward_rows(&self, rows: usize) {
        self.rows.store(rows, std::sync::atomic::Ordering::Relaxed);
    }

    pub(super) fn add(&self, op: &'static str, rows: usize, ms: f64) {
        let mut ops = self.ops.lock().expect("profile lock");
        match ops.iter_mut().find(|(o, r, ..)| *o == op && *r == rows) {
            Some((.., n, t)) => {
                *n += 1;
                *t += ms;
            }
            None => ops.push((op, rows, 1, ms)),
        }
    }

    /// Reads back every pending event pair.
    pub(super) fn fold_events(&self) {
        let pending = std::mem::take(&mut *self.pending.lock().expect("profile lock"));
        for (op, rows, start, end) in pending {
            if let Ok(ms) = start.elapsed_ms(&end) {
                self.add(op, rows, ms as f64);
            }
        }
    }
}

impl Drop for Span<'_> {
    fn drop(&mut self) {
        let p = self.profile;
        match &p.mode {
            Some(ProfileMode::Events(s)) => {
                if let (Some(start), Ok(end)) = (self.event.take(), s.record_event(Some(CU_EVENT_DEFAULT))) {
                    let full = {
                        let mut pending = p.pending.lock().expect("profile lock");
                        pending.push((self.op, self.rows, start, end));
                        pending.len() >= PROFILE_EVENT_BATCH
                    };
                    if full {
                        p.fold_events();
                    }
                }
                return;
            }
            Some(ProfileMode::Sync(s)) => {
                // A failed sync shows up at the next op; the profile only measures.
                let _ = s.synchronize();
            }
            _ => {}
        }
        p.add(self.op, self.rows, self.start.elapsed().as_secs_f64() * 1e3);
    }
}

impl Drop for HostProfile {
    fn drop(&mut self) {
        let what = match &self.mode {
            None => return,
            Some(ProfileMode::Host) => "host time",
            Some(ProfileMode::Sync(_)) => "GPU time (synchronized)",
            Some(ProfileMode::Events(_)) => "GPU time (events)",
        };
        self.fold_events();
        let mut ops = self.ops.lock().expect("profile lock").clone();
        ops.sort_by(|a, b| a.1.cmp(&b.1).then(b.3.total_cmp(&a.3)));
        eprintln!("{what} per CUDA backend op and forward rows ({HOST_PROFILE_ENV}):");
        eprintln!("| op | rows | calls | total ms | µs per call |");
        for (op, rows, n, ms) in ops {
            eprintln!("| {op} | {rows} | {n} | {ms:.1} | {:.1} |", ms * 1e3 / n as f64);
        }
    }
}
