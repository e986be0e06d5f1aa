//! A planted bug of each hazard class, caught by the interpreter with its DSL location.

use ddtree_codegen::dsl::*;
use ddtree_codegen::interp::{Buffer, Hazard, HostArg, InterpError, Program, RaceKind};
use ddtree_codegen::{Kernel, Space};
use ddtree_macros::kernel;

/// Reads one element past the end: no `i < n` guard.
#[kernel(block = 64)]
pub fn oob_global(x: &[f32], out: &mut [f32]) {
    let i = block_idx_x() * 64 + thread_idx_x();
    out[i] = x[i] * 2.0f32; // HAZARD oob_global
}

/// Indexes a 32-element shared array with a 64-thread block.
#[kernel(block = 64)]
pub fn oob_shared(out: &mut [f32]) {
    let s = shared::<f32>(32);
    s[thread_idx_x()] = 1.0f32; // HAZARD oob_shared
    sync_threads();
    out[thread_idx_x()] = s[0];
}

/// Only half the threads fill the shared array everyone reads.
#[kernel(block = 64)]
pub fn uninit_shared(out: &mut [f32]) {
    let s = shared::<f32>(64);
    let t = thread_idx_x();
    if t < 32 {
        s[t] = t as f32;
    }
    sync_threads();
    out[t] = s[63 - t]; // HAZARD uninit_shared
}

/// Every thread writes the same element.
#[kernel(block = 64)]
pub fn write_write(out: &mut [f32]) {
    let s = shared::<f32>(1);
    s[0] = thread_idx_x() as f32; // HAZARD write_write
    sync_threads();
    out[thread_idx_x()] = s[0];
}

/// Reads the neighbour's element with no barrier after writing.
#[kernel(block = 64)]
pub fn read_after_write(out: &mut [f32]) {
    let s = shared::<f32>(64);
    let t = thread_idx_x();
    s[t] = 0.0f32;
    sync_threads();
    s[t] = t as f32;
    out[t] = s[(t + 63) % 64]; // HAZARD read_after_write
}

/// Overwrites an element a neighbour reads, with no barrier between.
#[kernel(block = 64)]
pub fn write_after_read(out: &mut [f32]) {
    let s = shared::<f32>(64);
    let t = thread_idx_x();
    s[t] = t as f32;
    sync_threads();
    let v = s[(t + 1) % 64];
    s[t] = v; // HAZARD write_after_read
    out[t] = v;
}

/// Half the block skips the barrier and exits.
#[kernel(block = 64)]
pub fn barrier_exit(out: &mut [f32]) {
    let t = thread_idx_x();
    if t < 32 {
        sync_threads(); // HAZARD barrier_exit
    }
    out[t] = 1.0f32;
}

/// The two halves of the block wait at different barriers.
#[kernel(block = 64)]
pub fn barrier_mismatch(out: &mut [f32]) {
    let t = thread_idx_x();
    if t < 32 {
        sync_threads(); // HAZARD barrier_mismatch
        out[t] = 1.0f32;
    } else {
        sync_threads();
        out[t] = 2.0f32;
    }
}

/// A shuffle only half the warp reaches.
#[kernel(block = 32)]
pub fn partial_shuffle(out: &mut [f32]) {
    let t = thread_idx_x();
    let mut v = t as f32;
    if t < 16 {
        v = shfl_xor(v, 1u32); // HAZARD partial_shuffle
    }
    out[t] = v;
}

/// Reads a cp.async destination before waiting for it.
#[kernel(block = 32)]
pub fn cp_async_no_wait(x: &[bf16], out: &mut [f32]) {
    let s = shared::<bf16>(256);
    let t = thread_idx_x();
    cp_async_16(&mut s[t * 8], &x[t * 8]);
    cp_async_commit();
    out[t] = s[t * 8] as f32; // HAZARD cp_async_no_wait
    cp_async_wait(0);
}

/// A 128-bit load at an odd element.
#[kernel(block = 32)]
pub fn misaligned_vload(x: &[bf16], out: &mut [u32]) {
    let t = thread_idx_x();
    let v = x.vload(t * 8 + 1); // HAZARD misaligned_vload
    out[t] = v.x;
}

/// An 8-byte `cp.async` from an odd u32 index.
#[kernel(block = 32)]
pub fn misaligned_cp_async_8(x: &[u32], out: &mut [u32]) {
    let s = shared::<u32>(64);
    let t = thread_idx_x();
    cp_async_8(&mut s[2 * t], &x[2 * t + 1]); // HAZARD misaligned_cp_async_8
    cp_async_commit();
    cp_async_wait(0);
    out[t] = s[2 * t];
}

/// 8-byte copies of words `2t, 2t + 1`, then 4-byte zero-filling copies of word `32 + t`
/// (zeros from odd lanes); the data is read after the wait and a barrier.
#[kernel(block = 32)]
pub fn small_cp_async(x: &[u32], out: &mut [u32]) {
    let s = shared::<u32>(64);
    let t = thread_idx_x();
    if t < 16 {
        cp_async_8(&mut s[2 * t], &x[2 * t]);
    }
    cp_async_4_zfill(&mut s[32 + t], &x[32 + t], t % 2 == 0);
    cp_async_commit();
    cp_async_wait(0);
    sync_threads();
    out[t] = s[t];
    out[32 + t] = s[32 + t];
}

/// The same pipeline with the wait and barrier in place: no hazard, right values.
#[kernel(block = 32)]
pub fn cp_async_ok(x: &[bf16], out: &mut [f32]) {
    let s = shared::<bf16>(256);
    let t = thread_idx_x();
    cp_async_16(&mut s[t * 8], &x[t * 8]);
    cp_async_commit();
    cp_async_wait(0);
    sync_threads();
    out[t] = s[((t + 1) % 32) * 8] as f32;
}

/// Writes its output before waiting for the previous kernel (which may still read it).
#[kernel(block = 32)]
pub fn write_before_grid_wait(x: &[f32], out: &mut [f32]) {
    let t = thread_idx_x();
    let v = x[t] * 2.0f32;
    out[t] = v; // HAZARD write_before_grid_wait
    grid_wait();
    grid_launch_dependents();
}

/// The same with the write after the wait: no hazard (reads before it are allowed).
#[kernel(block = 32)]
pub fn write_after_grid_wait(x: &[f32], out: &mut [f32]) {
    let t = thread_idx_x();
    let v = x[t] * 2.0f32;
    grid_wait();
    grid_launch_dependents();
    out[t] = v;
}

/// Two 256-byte bulk copies (the halves of `x`), issued by lanes 0 and 1 on one mbarrier
/// whose phase lane 0 arms for 512 bytes; every lane waits for the phase, then reads.
#[kernel(block = 32)]
pub fn bulk_copy_ok(x: &[u32], out: &mut [u32]) {
    let s = shared::<u32>(128);
    let bar = shared::<u64>(1);
    let t = thread_idx_x();
    if t == 0 {
        mbar_init(&mut bar[0], 1u32);
    }
    sync_threads();
    if t == 0 {
        mbar_arrive_tx(&mut bar[0], 512u32);
    }
    if t < 2 {
        cp_async_bulk(&mut s[64 * t], &x[64 * t], 256u32, &mut bar[0]);
    }
    sync_threads();
    mbar_wait(&bar[0], 0u32);
    out[t] = s[127 - 4 * t];
}

/// Warp 0 waits on the mbarrier that warp 1, later in thread order, arms and fills.
#[kernel(block = 64)]
pub fn mbar_producer_warp(x: &[u32], out: &mut [u32]) {
    let s = shared::<u32>(64);
    let bar = shared::<u64>(1);
    let t = thread_idx_x();
    if t == 0 {
        mbar_init(&mut bar[0], 1u32);
    }
    sync_threads();
    if t == 32 {
        mbar_arrive_tx(&mut bar[0], 256u32);
        cp_async_bulk(&mut s[0], &x[0], 256u32, &mut bar[0]);
    }
    if t < 32 {
        mbar_wait(&bar[0], 0u32);
        out[t] = s[t];
        out[t + 32] = s[t + 32];
    }
}

/// Half the warpgroup asks `wgmma` to accumulate, half to overwrite.
#[kernel(block = 128)]
pub fn wgmma_accumulate_diverges(out: &mut [f32]) {
    let s = shared::<bf16>(1024);
    let t = thread_idx_x();
    let mut acc = [0.0f32; 4];
    let a = [0u32; 4];
    wgmma_fence();
    wgmma_bf16_rs(&mut acc, &a, wgmma_desc(&s[0]), t < 64); // HAZARD wgmma_accumulate_diverges
    wgmma_commit();
    wgmma_wait(0);
    out[t] = acc[0];
}

/// Waits on a phase nobody has armed yet.
#[kernel(block = 32)]
pub fn mbar_wait_first(x: &[u32], out: &mut [u32]) {
    let s = shared::<u32>(64);
    let bar = shared::<u64>(1);
    let t = thread_idx_x();
    if t == 0 {
        mbar_init(&mut bar[0], 1u32);
    }
    sync_threads();
    mbar_wait(&bar[0], 0u32); // HAZARD mbar_wait_first
    if t == 0 {
        mbar_arrive_tx(&mut bar[0], 256u32);
        cp_async_bulk(&mut s[0], &x[0], 256u32, &mut bar[0]);
    }
    out[t] = s[t];
}

/// The 1-based line of the statement marked `// HAZARD name` in this file.
fn marked_line(name: &str) -> u32 {
    let marker = format!("// HAZARD {name}");
    let i = include_str!("hazards.rs")
        .lines()
        .position(|l| l.trim_end().ends_with(&marker))
        .expect("marker");
    i as u32 + 1
}

/// Runs kernel `K` over `grid` with `args` and returns its hazard.
fn hazard_of<K: Kernel<Params = ()>>(grid: u32, args: &mut [HostArg<'_>]) -> InterpError {
    let prog = Program::of::<K>(&()).expect("lowers");
    let e = prog.launch([grid, 1, 1], args).expect_err("the planted bug is caught");
    assert_eq!(e.loc.line, marked_line(K::NAME), "{e}");
    eprintln!("{e}");
    e
}

#[test]
fn out_of_bounds_global_read() {
    let x = Buffer::from_slice(&[1.0f32; 100]);
    let mut out = Buffer::from_slice(&[0.0f32; 128]);
    let e = hazard_of::<OobGlobal>(2, &mut [HostArg::In(&x), HostArg::Out(&mut out)]);
    assert_eq!(e.block, [1, 0, 0]);
    assert_eq!(e.thread, [36, 0, 0]);
    let want = Hazard::OutOfBounds {
        buffer: "x".into(),
        space: Space::Global,
        index: 100,
        len: 100,
        write: false,
    };
    assert_eq!(e.hazard, want);
}

#[test]
fn out_of_bounds_shared_write() {
    let mut out = Buffer::from_slice(&[0.0f32; 64]);
    let e = hazard_of::<OobShared>(1, &mut [HostArg::Out(&mut out)]);
    assert_eq!(e.thread, [32, 0, 0]);
    let want = Hazard::OutOfBounds {
        buffer: "s".into(),
        space: Space::Shared,
        index: 32,
        len: 32,
        write: true,
    };
    assert_eq!(e.hazard, want);
}

#[test]
fn uninitialised_shared_read() {
    let mut out = Buffer::from_slice(&[0.0f32; 64]);
    let e = hazard_of::<UninitShared>(1, &mut [HostArg::Out(&mut out)]);
    assert_eq!(e.thread, [0, 0, 0]);
    assert_eq!(
        e.hazard,
        Hazard::UninitializedRead {
            buffer: "s".into(),
            index: 63
        }
    );
}

#[test]
fn two_threads_write_one_shared_element() {
    let mut out = Buffer::from_slice(&[0.0f32; 64]);
    let e = hazard_of::<WriteWrite>(1, &mut [HostArg::Out(&mut out)]);
    let want = Hazard::Race {
        kind: RaceKind::WriteWrite,
        buffer: "s".into(),
        index: 0,
        other: [0, 0, 0],
    };
    assert_eq!((e.thread, e.hazard), ([1, 0, 0], want));
}

#[test]
fn read_of_another_threads_write_without_barrier() {
    let mut out = Buffer::from_slice(&[0.0f32; 64]);
    let e = hazard_of::<ReadAfterWrite>(1, &mut [HostArg::Out(&mut out)]);
    let want = Hazard::Race {
        kind: RaceKind::ReadAfterWrite,
        buffer: "s".into(),
        index: 0,
        other: [0, 0, 0],
    };
    assert_eq!((e.thread, e.hazard), ([1, 0, 0], want));
}

#[test]
fn write_over_another_threads_read_without_barrier() {
    let mut out = Buffer::from_slice(&[0.0f32; 64]);
    let e = hazard_of::<WriteAfterRead>(1, &mut [HostArg::Out(&mut out)]);
    let want = Hazard::Race {
        kind: RaceKind::WriteAfterRead,
        buffer: "s".into(),
        index: 1,
        other: [0, 0, 0],
    };
    assert_eq!((e.thread, e.hazard), ([1, 0, 0], want));
}

#[test]
fn barrier_with_exited_threads() {
    let mut out = Buffer::from_slice(&[0.0f32; 64]);
    let e = hazard_of::<BarrierExit>(1, &mut [HostArg::Out(&mut out)]);
    assert!(
        matches!(&e.hazard, Hazard::BarrierDivergence(m) if m.contains("exited")),
        "{e}"
    );
}

#[test]
fn threads_at_different_barriers() {
    let mut out = Buffer::from_slice(&[0.0f32; 64]);
    let e = hazard_of::<BarrierMismatch>(1, &mut [HostArg::Out(&mut out)]);
    assert!(
        matches!(&e.hazard, Hazard::BarrierDivergence(m) if m.contains("different") || m.contains("waits at the barrier at")),
        "{e}"
    );
}

#[test]
fn shuffle_reached_by_half_a_warp() {
    let mut out = Buffer::from_slice(&[0.0f32; 32]);
    let e = hazard_of::<PartialShuffle>(1, &mut [HostArg::Out(&mut out)]);
    assert!(matches!(e.hazard, Hazard::WarpDivergence(_)), "{e}");
}

#[test]
fn read_of_a_cp_async_destination_before_the_wait() {
    let x = Buffer::from_slice(&[bf16::ONE; 256]);
    let mut out = Buffer::from_slice(&[0.0f32; 32]);
    let e = hazard_of::<CpAsyncNoWait>(1, &mut [HostArg::In(&x), HostArg::Out(&mut out)]);
    assert_eq!(
        e.hazard,
        Hazard::ReadBeforeWait {
            buffer: "s".into(),
            index: 0
        }
    );
}

#[test]
fn misaligned_vector_load() {
    let x = Buffer::from_slice(&[bf16::ONE; 512]);
    let mut out = Buffer::from_slice(&[0u32; 32]);
    let e = hazard_of::<MisalignedVload>(1, &mut [HostArg::In(&x), HostArg::Out(&mut out)]);
    assert_eq!(
        e.hazard,
        Hazard::Misaligned {
            buffer: "x".into(),
            index: 1,
            bytes: 16
        }
    );
}

#[test]
fn misaligned_small_cp_async() {
    let x = Buffer::from_slice(&[1u32; 64]);
    let mut out = Buffer::from_slice(&[0u32; 64]);
    let e = hazard_of::<MisalignedCpAsync8>(1, &mut [HostArg::In(&x), HostArg::Out(&mut out)]);
    assert_eq!(
        e.hazard,
        Hazard::Misaligned {
            buffer: "x".into(),
            index: 1,
            bytes: 8
        }
    );
}

#[test]
fn small_cp_async_lands_at_the_wait() {
    let xs: Vec<u32> = (0..64).collect();
    let x = Buffer::from_slice(&xs);
    let mut out = Buffer::from_slice(&[u32::MAX; 64]);
    Program::of::<SmallCpAsync>(&())
        .expect("lowers")
        .launch([1, 1, 1], &mut [HostArg::In(&x), HostArg::Out(&mut out)])
        .expect("no hazard");
    // Words 2t, 2t + 1 by cp_async_8; odd lanes' zfill copies write zeros over word 32 + t.
    let want: Vec<u32> = (0..64)
        .map(|i| if i < 32 || (i - 32) % 2 == 0 { i } else { 0 })
        .collect();
    assert_eq!(out.to_vec::<u32>(), want);
}

#[test]
fn a_correct_cp_async_pipeline_passes() {
    let xs: Vec<bf16> = (0..256).map(|i| bf16::from_f32(i as f32)).collect();
    let x = Buffer::from_slice(&xs);
    let mut out = Buffer::from_slice(&[f32::NAN; 32]);
    Program::of::<CpAsyncOk>(&())
        .expect("lowers")
        .launch([1, 1, 1], &mut [HostArg::In(&x), HostArg::Out(&mut out)])
        .expect("no hazard");
    let want: Vec<f32> = (0..32).map(|t| (((t + 1) % 32) * 8) as f32).collect();
    assert_eq!(out.to_vec::<f32>(), want);
}

#[test]
fn global_write_before_grid_wait() {
    let x = Buffer::from_slice(&[1.5f32; 32]);
    let mut out = Buffer::from_slice(&[0.0f32; 32]);
    let e = hazard_of::<WriteBeforeGridWait>(1, &mut [HostArg::In(&x), HostArg::Out(&mut out)]);
    assert_eq!(e.thread, [0, 0, 0]);
    assert_eq!(e.hazard, Hazard::WriteBeforeGridWait { buffer: "out".into() });
    let prog = Program::of::<WriteAfterGridWait>(&()).expect("lowers");
    prog.launch([1, 1, 1], &mut [HostArg::In(&x), HostArg::Out(&mut out)])
        .expect("a write after the wait is fine");
    assert_eq!(out.to_vec::<f32>(), vec![3.0f32; 32]);
}

#[test]
fn bulk_copies_land_when_their_mbarrier_phase_completes() {
    let xs: Vec<u32> = (0..128).collect();
    let x = Buffer::from_slice(&xs);
    let mut out = Buffer::from_slice(&[u32::MAX; 32]);
    Program::of::<BulkCopyOk>(&())
        .expect("lowers")
        .launch([1, 1, 1], &mut [HostArg::In(&x), HostArg::Out(&mut out)])
        .expect("no hazard");
    let want: Vec<u32> = (0..32).map(|t| 127 - 4 * t).collect();
    assert_eq!(out.to_vec::<u32>(), want);
}

#[test]
fn mbarrier_wait_before_its_phase_is_armed() {
    let x = Buffer::from_slice(&[7u32; 64]);
    let mut out = Buffer::from_slice(&[0u32; 32]);
    let e = hazard_of::<MbarWaitFirst>(1, &mut [HostArg::In(&x), HostArg::Out(&mut out)]);
    assert!(
        matches!(&e.hazard, Hazard::Deadlock(m) if m.contains("`bar`[0]")),
        "{e}"
    );
}

#[test]
fn wgmma_accumulate_flag_differs_in_the_warpgroup() {
    let mut out = Buffer::from_slice(&[0.0f32; 128]);
    let e = hazard_of::<WgmmaAccumulateDiverges>(1, &mut [HostArg::Out(&mut out)]);
    assert!(
        matches!(&e.hazard, Hazard::WarpDivergence(m) if m.contains("accumulate")),
        "{e}"
    );
}

#[test]
fn mbarrier_wait_blocks_until_a_later_warp_copies() {
    let x: Vec<u32> = (0..64).map(|i| 3 * i + 1).collect();
    let xb = Buffer::from_slice(&x);
    let mut out = Buffer::from_slice(&[0u32; 64]);
    Program::of::<MbarProducerWarp>(&())
        .expect("lowers")
        .launch([1, 1, 1], &mut [HostArg::In(&xb), HostArg::Out(&mut out)])
        .expect("no hazard");
    assert_eq!(out.to_vec::<u32>(), x);
}
