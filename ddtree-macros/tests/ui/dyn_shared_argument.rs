use ddtree_macros::{kernel, KernelParams};

#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct P {
    pub block: u32,
}

#[kernel(block = p.block, dyn_smem = p.block * 64, space = [P { block: 256 }])]
pub fn k(#[comptime] p: &P, x: &mut [f32], n: u32) {
    let tile = dyn_shared::<f32>(n);
    tile[0] = 1.0;
    x[0] = tile[0];
}

fn main() {}
