use ddtree_macros::{kernel, KernelParams};

#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct P {
    pub block: u32,
    pub vec: bool,
}

#[kernel(block = p.block, space = [P { block: 256, vec: true }])]
pub fn k(#[comptime] p: &P, x: &[f64], out: &mut [f32]) {
    out[0] = 1.0;
}

fn main() {}
