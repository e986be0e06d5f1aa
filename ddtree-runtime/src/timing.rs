//! Timing device work with CUDA events.

use std::sync::Arc;

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaSlice, CudaStream};

use crate::{Gpu, RuntimeError};

/// Runs `f` `warmup` times, then times `reps` runs one by one with CUDA events on `stream` and
/// returns the median in microseconds. `f` gets the repetition index (to rotate input buffers).
pub fn median_us(
    stream: &Arc<CudaStream>,
    warmup: usize,
    reps: usize,
    f: impl FnMut(usize) -> Result<(), RuntimeError>,
) -> Result<f64, RuntimeError> {
    median_us_flushed(stream, warmup, reps, None, f)
}

/// [`median_us`], but when `flush` is given it is overwritten before each timed run, outside
/// the timed span, so that the run starts with a cold L2 (pass a buffer of about twice the L2
/// size).
pub fn median_us_flushed(
    stream: &Arc<CudaStream>,
    warmup: usize,
    reps: usize,
    flush: Option<&mut CudaSlice<u8>>,
    f: impl FnMut(usize) -> Result<(), RuntimeError>,
) -> Result<f64, RuntimeError> {
    median_us_batched(stream, warmup, reps, 1, flush, f)
}

/// [`median_us_flushed`] with `per_sample` calls of `f` back to back in each timed sample (`f`
/// gets consecutive indices), returning the median time per call: for work of a few
/// microseconds, whose single-launch time is mostly launch latency and noise, the queued calls
/// keep the GPU busy and the sample measures device time. `flush` runs once per sample.
pub fn median_us_batched(
    stream: &Arc<CudaStream>,
    warmup: usize,
    reps: usize,
    per_sample: usize,
    mut flush: Option<&mut CudaSlice<u8>>,
    mut f: impl FnMut(usize) -> Result<(), RuntimeError>,
) -> Result<f64, RuntimeError> {
    let per_sample = per_sample.max(1);
    for i in 0..warmup {
        f(i)?;
    }
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut times = Vec::with_capacity(reps);
    for i in 0..reps.max(1) {
        if let Some(buf) = flush.as_deref_mut() {
            stream
                .memset_zeros(buf)
                .map_err(RuntimeError::driver("flushing the L2"))?;
        }
        let start = stream
            .record_event(flags)
            .map_err(RuntimeError::driver("recording an event"))?;
        for j in 0..per_sample {
            f(warmup + i * per_sample + j)?;
        }
        let end = stream
            .record_event(flags)
            .map_err(RuntimeError::driver("recording an event"))?;
        end.synchronize()
            .map_err(RuntimeError::driver("waiting for an event"))?;
        times.push(
            start
                .elapsed_ms(&end)
                .map_err(RuntimeError::driver("reading an event timer"))? as f64
                * 1e3
                / per_sample as f64,
        );
    }
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[times.len() / 2])
}

/// Device time per call of `f` as a CUDA graph replay sees it, without the host's per-launch
/// overhead: `per_graph` calls (`f` gets `0..per_graph`, to rotate inputs) are captured back to
/// back into one graph, which is replayed `warmup` times and then timed `reps` times one by one
/// with CUDA events; returns the median replay divided by `per_graph`, in microseconds. `f`
/// must only enqueue work (no host synchronisation, no host-to-device copies), and the capture
/// needs cudarc's event tracking off (`CudaContext::disable_event_tracking`).
pub fn graph_us(
    stream: &Arc<CudaStream>,
    per_graph: usize,
    warmup: usize,
    reps: usize,
    f: impl FnMut(usize) -> Result<(), RuntimeError>,
) -> Result<f64, RuntimeError> {
    graph_us_flushed(stream, per_graph, warmup, reps, None, f)
}

/// [`graph_us`], but when `flush` is given it is overwritten before each timed replay, outside
/// the timed span (as [`median_us_flushed`]).
pub fn graph_us_flushed(
    stream: &Arc<CudaStream>,
    per_graph: usize,
    warmup: usize,
    reps: usize,
    flush: Option<&mut CudaSlice<u8>>,
    mut f: impl FnMut(usize) -> Result<(), RuntimeError>,
) -> Result<f64, RuntimeError> {
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(RuntimeError::driver("starting a CUDA graph capture"))?;
    let captured = (0..per_graph.max(1)).try_for_each(&mut f);
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .map_err(RuntimeError::driver("ending a CUDA graph capture"))?;
    captured?;
    let graph = graph.ok_or_else(|| RuntimeError::Launch {
        kernel: "a CUDA graph".into(),
        reason: "the capture was empty".into(),
    })?;
    let us = median_us_flushed(stream, warmup, reps, flush, |_| {
        graph.launch().map_err(RuntimeError::driver("launching a CUDA graph"))
    })?;
    Ok(us / per_graph.max(1) as f64)
}

/// Device-to-device copy bandwidth in GB/s (bytes read + written), median of 10 copies of 1 GiB.
pub fn copy_bandwidth(gpu: &Gpu) -> Result<f64, RuntimeError> {
    let s = gpu.stream();
    let n = 1usize << 30;
    let src = s.alloc_zeros::<u8>(n).map_err(RuntimeError::driver("allocating"))?;
    let mut dst = s.alloc_zeros::<u8>(n).map_err(RuntimeError::driver("allocating"))?;
    let us = median_us(s, 3, 10, |_| {
        s.memcpy_dtod(&src, &mut dst).map_err(RuntimeError::driver("copying"))
    })?;
    Ok(2.0 * n as f64 / (us * 1e-6) / 1e9)
}
