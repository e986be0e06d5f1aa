use ddtree_macros::{kernel, KernelParams};

#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct P {
    pub block: u32,
    pub vec: bool,
}

#[kernel(block = p.block, space = [P { block: 256, vec: true }])]
pub fn k(#[comptime] p: &P, x: &mut [f32]) {
    let v = x[0] as f64;
    x[1] = 2.5f64;
}

fn main() {}
