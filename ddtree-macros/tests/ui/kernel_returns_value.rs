use ddtree_macros::{kernel, KernelParams};

#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct P {
    pub block: u32,
    pub vec: bool,
}

#[kernel(block = p.block, space = [P { block: 256, vec: true }])]
pub fn k(#[comptime] p: &P, x: &[f32]) -> f32 {
    x[0]
}

fn main() {}
