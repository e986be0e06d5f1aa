//! Behaviour of `#[kernel]` expansions: compile-time branches, errors found when the IR is
//! built (located on the DSL source), the header, launch bounds and the prelude.

use ddtree_codegen::dsl::*;
use ddtree_codegen::Kernel;
use ddtree_macros::{device_fn, kernel, KernelParams};

#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub enum Mode {
    Plain,
    Scaled,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct Params {
    pub block: u32,
    pub mode: Mode,
    pub unroll: u32,
}

#[device_fn]
fn twice(v: f32) -> f32 {
    v * 2.0
}

#[kernel(block = p.block, space = [
    Params { block: 128, mode: Mode::Plain, unroll: 2 },
    Params { block: 64, mode: Mode::Scaled, unroll: 4 },
])]
pub fn scale(#[comptime] p: &Params, x: &[bf16], out: &mut [f32], n: u32) {
    let i = block_idx_x() * p.block + thread_idx_x();
    if i < n {
        let mut v = x[i] as f32;
        if p.mode == Mode::Scaled {
            v = twice(v);
        }
        #[unroll]
        for _k in 0..p.unroll {
            v += 1.0;
        }
        out[i] = v;
    }
}

#[test]
fn comptime_if_emits_only_the_taken_branch() {
    let plain = Scale::source(&Scale::space()[0]).unwrap();
    let scaled = Scale::source(&Scale::space()[1]).unwrap();
    assert!(!plain.contains("twice"), "{plain}");
    assert!(scaled.contains("v = twice(v);"), "{scaled}");
    assert!(
        scaled.contains("__device__ __forceinline__ float twice(const float v)"),
        "{scaled}"
    );
}

#[test]
fn header_symbol_and_launch_bounds() {
    let p = Scale::space()[1];
    let src = Scale::source(&p).unwrap();
    assert!(
        src.starts_with("// ddtree kernel `scale`\n// params: block = 64, mode = scaled, unroll = 4\n"),
        "{src}"
    );
    assert_eq!(Scale::symbol(&p), "scale__block64_mode_scaled_unroll4");
    assert!(
        src.contains("extern \"C\" __global__ void __launch_bounds__(64) scale__block64_mode_scaled_unroll4("),
        "{src}"
    );
    assert_eq!(
        Scale::id(&p, "sm_90a").to_string(),
        "scale__block64_mode_scaled_unroll4@sm_90a"
    );
    // Only what is used goes into the prelude: bf16 conversion, no mma/cp.async helpers.
    assert!(
        src.contains("bf16_to_f32") && !src.contains("mma_m16n8k16") && !src.contains("cp_async"),
        "{src}"
    );
    assert!(src.contains("#pragma unroll\n"), "{src}");
}

#[test]
fn same_params_give_identical_source() {
    let p = Scale::space()[0];
    assert_eq!(Scale::source(&p).unwrap(), Scale::source(&p).unwrap());
    assert_ne!(Scale::source(&p).unwrap(), Scale::source(&Scale::space()[1]).unwrap());
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct Block {
    pub block: u32,
}

#[kernel(block = p.block, space = [Block { block: 32 }])]
pub fn writes_input(#[comptime] p: &Block, x: &[f32]) {
    x[thread_idx_x()] = 1.0;
}

#[kernel(block = p.block, space = [Block { block: 32 }])]
pub fn mixes_types(#[comptime] p: &Block, out: &mut [f32], n: u32) {
    out[thread_idx_x()] = n;
}

#[kernel(block = p.block, space = vec![Block { block: 32 }])]
pub fn needs_warp_multiple(#[comptime] p: &Block, out: &mut [f32]) {
    comptime_assert!(p.block % 32 == 0, "block {} is not a multiple of 32", p.block);
    out[thread_idx_x()] = 0.0;
}

#[kernel(block = p.block, space = [Block { block: 2048 }])]
pub fn too_many_threads(#[comptime] p: &Block, out: &mut [f32]) {
    out[thread_idx_x()] = 0.0;
}

#[test]
fn ir_errors_name_the_kernel_and_the_dsl_location() {
    let e = WritesInput::ir(&Block { block: 32 }).unwrap_err();
    assert!(e.message.contains("cannot write through a `&[T]` slice"), "{e}");
    assert!(e.file.ends_with("dsl.rs") && e.kernel == "writes_input", "{e}");
    assert!(e.loc.line > 80, "location should point into this file: {e}");

    let e = MixesTypes::ir(&Block { block: 32 }).unwrap_err();
    assert!(e.message.contains("mismatched types: expected f32, found u32"), "{e}");
    assert!(e.to_string().contains("dsl.rs:"), "{e}");

    // A candidate outside the listed space is still checked when its IR is built.
    let e = NeedsWarpMultiple::ir(&Block { block: 48 }).unwrap_err();
    assert!(e.message.contains("block 48 is not a multiple of 32"), "{e}");
    assert!(NeedsWarpMultiple::ir(&Block { block: 32 }).is_ok());

    let e = TooManyThreads::ir(&Block { block: 2048 }).unwrap_err();
    assert!(e.message.contains("outside 1..=1024"), "{e}");
}

/// Reverses each block's slice of `x` through dynamic shared memory (one f32 per thread).
#[kernel(block = p.block, dyn_smem = p.block * 4, space = [Block { block: 64 }, Block { block: 128 }])]
pub fn reverse_dyn(#[comptime] p: &Block, x: &[f32], out: &mut [f32]) {
    let s = dyn_shared::<f32>();
    let t = thread_idx_x();
    s[t] = x[block_idx_x() * p.block + t];
    sync_threads();
    out[block_idx_x() * p.block + t] = s[p.block - 1 - t];
}

#[kernel(block = 32, dyn_smem = 256)]
pub fn two_dyn_views(out: &mut [f32]) {
    let a = dyn_shared::<f32>();
    let b = dyn_shared::<u32>();
    a[0] = 1.0;
    b[1] = 2;
    out[0] = a[0];
}

#[kernel(block = 32)]
pub fn dyn_without_size(out: &mut [f32]) {
    let a = dyn_shared::<f32>();
    a[0] = 1.0;
    out[0] = a[0];
}

#[test]
fn dynamic_shared_memory_is_extern_sized_by_the_launch_and_interpreted() {
    use ddtree_codegen::interp::{Buffer, HostArg, Program};
    let p = Block { block: 64 };
    let ir = ReverseDyn::ir(&p).unwrap();
    assert_eq!((ir.dyn_smem, ir.shared_bytes()), (256, 0));
    let src = ReverseDyn::source(&p).unwrap();
    assert!(src.contains("// dynamic shared memory: 256 bytes"), "{src}");
    assert!(src.contains("extern __shared__ __align__(16) float s[];"), "{src}");

    let xs: Vec<f32> = (0..128).map(|i| i as f32).collect();
    let x = Buffer::from_slice(&xs);
    let mut out = Buffer::from_slice(&[f32::NAN; 128]);
    Program::of::<ReverseDyn>(&p)
        .unwrap()
        .launch([2, 1, 1], &mut [HostArg::In(&x), HostArg::Out(&mut out)])
        .unwrap();
    let want: Vec<f32> = (0..128).map(|i| (64 * (i / 64) + 63 - i % 64) as f32).collect();
    assert_eq!(out.to_vec::<f32>(), want);

    let e = TwoDynViews::ir(&()).unwrap_err();
    assert!(e.message.contains("once per kernel"), "{e}");
    let e = DynWithoutSize::ir(&()).unwrap_err();
    assert!(e.message.contains("needs `dyn_smem"), "{e}");
}

/// Doubles `x`; its registers must allow `p.block / 16` blocks per SM.
#[kernel(block = p.block, min_blocks = p.block / 16, space = [Block { block: 64 }, Block { block: 1024 }])]
pub fn bounded(#[comptime] p: &Block, x: &mut [f32]) {
    let i = block_idx_x() * p.block + thread_idx_x();
    x[i] = 2.0 * x[i];
}

#[test]
fn min_blocks_is_the_second_launch_bound() {
    let src = Bounded::source(&Block { block: 64 }).unwrap();
    assert!(
        src.contains("__global__ void __launch_bounds__(64, 4) bounded__block64("),
        "{src}"
    );
    let e = Bounded::ir(&Block { block: 1024 }).unwrap_err();
    assert!(e.message.contains("min_blocks = 64 must be between 0 and 32"), "{e}");
    // Without `min_blocks`, one argument.
    let src = ReverseDyn::source(&Block { block: 64 }).unwrap();
    assert!(src.contains("__launch_bounds__(64) reverse_dyn__block64("), "{src}");
}

#[kernel(block = 32)]
pub fn small_copies(x: &[u32], out: &mut [u32]) {
    let s = shared::<u32>(128);
    let t = thread_idx_x();
    cp_async_8(&mut s[2 * t], &x[2 * t]);
    cp_async_4_zfill(&mut s[64 + t], &x[64 + t], t < 16);
    cp_async_commit();
    cp_async_wait(0);
    out[t] = s[2 * t] + s[64 + t];
}

#[test]
fn small_cp_async_copies_render_as_ca_with_their_size() {
    let src = SmallCopies::source(&()).unwrap();
    assert!(
        src.contains("cp.async.ca.shared.global [%0], [%1], 8;")
            && src.contains("cp.async.ca.shared.global [%0], [%1], 4, %2;"),
        "{src}"
    );
    assert!(src.contains("cp_async_8(&s[2u * t], &x[2u * t]);"), "{src}");
    assert!(
        src.contains("cp_async_4_zfill(&s[64u + t], &x[64u + t], t < 16u);"),
        "{src}"
    );
    // Only the helpers used: no 16-byte copies, commit and wait.
    assert!(
        !src.contains("cp_async_16") && src.contains("cp.async.commit_group"),
        "{src}"
    );
}

/// Loads its input before waiting for the previous kernel, then writes.
#[kernel(block = 32)]
pub fn waits_late(x: &[f32], out: &mut [f32]) {
    let t = thread_idx_x();
    let v = x[t];
    grid_wait();
    grid_launch_dependents();
    out[t] = v;
}

#[test]
fn kernels_wait_for_the_previous_kernel_first_unless_they_place_the_wait() {
    let dflt = Scale::source(&Scale::space()[0]).unwrap();
    let body = dflt.split_once("unsigned int n) {\n").expect("kernel signature").1;
    assert!(
        body.starts_with("    grid_wait();\n    grid_launch_dependents();\n"),
        "{dflt}"
    );
    assert!(dflt.contains("griddepcontrol.wait;"), "{dflt}");
    let late = WaitsLate::source(&()).unwrap();
    assert_eq!(late.matches("grid_wait();").count(), 1, "{late}");
    let (before, after) = late.split_once("grid_wait();").unwrap();
    assert!(
        before.contains("const float v = x[t];") && !before.contains("out["),
        "{late}"
    );
    assert!(after.starts_with("\n    grid_launch_dependents();\n"), "{late}");
}

/// Sub-slices: each block reads its 64 values of `x` through `xs`, copies them into the upper
/// half of shared memory through a shared sub-slice (with `cp.async`, reversed), and writes
/// `2 x + reversed x` through a sub-slice of `out`; `probe` reads one past `x` through `xs`.
#[kernel(block = 64, dyn_smem = 512)]
pub fn sub_slices(x: &[f32], out: &mut [f32], probe: u32) {
    let t = thread_idx_x();
    let base = block_idx_x() * 64;
    let xs = &x[base..];
    let os = &mut out[base..];
    let s = dyn_shared::<f32>();
    let hi = &mut s[64..];
    cp_async_4(&mut hi[63 - t], &xs[t]);
    cp_async_commit();
    cp_async_wait(0);
    sync_threads();
    os[t] = 2.0 * xs[t] + s[64 + t] + xs[probe];
    let v = xs.vload(4 * (t / 4));
    if t % 4 == 0 {
        os[t] += f32::from_bits(v.w) - xs[t + 3];
    }
}

#[kernel(block = 32)]
pub fn register_sub_slice(out: &mut [f32]) {
    let r = [0.0f32; 4];
    let v = &r[1..];
    out[0] = v[0];
}

#[kernel(block = 32)]
pub fn rebinds_sub_slice(out: &mut [f32]) {
    let mut v = &mut out[1..];
    v[0] = 1.0;
}

#[kernel(block = 32)]
pub fn writes_read_only_sub_slice(out: &mut [f32]) {
    let v = &out[1..];
    v[0] = 1.0;
}

#[test]
fn sub_slices_are_pointers_indexed_from_their_offset() {
    use ddtree_codegen::interp::{Buffer, HostArg, Program, Value};
    let src = SubSlices::source(&()).unwrap();
    for decl in [
        "const float* xs = x + base;",
        "float* os = out + base;",
        "float* hi = s + 64u;",
        "cp_async_4(&hi[63u - t], &xs[t]);",
    ] {
        assert!(src.contains(decl), "{decl} in:\n{src}");
    }
    let xs: Vec<f32> = (0..128).map(|i| (i * i % 97) as f32).collect();
    let x = Buffer::from_slice(&xs);
    let run = |probe: u32| {
        let mut out = Buffer::from_slice(&[f32::NAN; 128]);
        let r = Program::of::<SubSlices>(&()).unwrap().launch(
            [2, 1, 1],
            &mut [
                HostArg::In(&x),
                HostArg::Out(&mut out),
                HostArg::Scalar(Value::U32(probe)),
            ],
        );
        r.map(|_| out.to_vec::<f32>()).map_err(|e| e.to_string())
    };
    let got = run(5).unwrap();
    let want: Vec<f32> = (0..128)
        .map(|i| {
            let (b, t) = (i / 64 * 64, i % 64);
            2.0 * xs[i] + xs[b + 63 - t] + xs[b + 5]
        })
        .collect();
    assert_eq!(got, want);
    // One past the end of `x`, through block 1's sub-slice: caught against `x`.
    let e = run(64).unwrap_err();
    assert!(
        e.contains("out-of-bounds read of global buffer `x` at index 128"),
        "{e}"
    );

    let e = RegisterSubSlice::ir(&()).unwrap_err();
    assert!(e.message.contains("register arrays have no sub-slices"), "{e}");
    let e = RebindsSubSlice::ir(&()).unwrap_err();
    assert!(e.message.contains("with `let`, not `let mut`"), "{e}");
    let e = WritesReadOnlySubSlice::ir(&()).unwrap_err();
    assert!(e.message.contains("cannot write through a read-only sub-slice"), "{e}");
}
