use ddtree_macros::{kernel, KernelParams};

#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct P {
    pub block: u32,
    pub vec: bool,
}

#[kernel(block = p.block, space = [P { block: 256, vec: true }])]
pub fn k(#[comptime] p: &P, x: &mut [f32], n: u32) {
    let i = thread_idx_x();
    x[i] = match n {
        0 => 1.0,
        _ => 2.0,
    };
}

fn main() {}
