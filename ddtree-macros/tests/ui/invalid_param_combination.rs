use ddtree_macros::{kernel, KernelParams};

#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct P {
    pub block: u32,
    pub vec: bool,
}

#[kernel(block = p.block, space = [
    P { block: 256, vec: true },
    P { block: 100, vec: true },
])]
pub fn k(#[comptime] p: &P, x: &mut [f32]) {
    comptime_assert!(p.block % 32 == 0, "block must be a multiple of the warp size");
    x[thread_idx_x()] = 1.0;
}

fn main() {}
