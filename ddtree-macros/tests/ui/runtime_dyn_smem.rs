use ddtree_macros::kernel;

#[kernel(block = 128, dyn_smem = n * 4)]
pub fn k(x: &mut [f32], n: u32) {
    let tile = dyn_shared::<f32>();
    tile[0] = 1.0;
    x[0] = tile[0] + n as f32;
}

fn main() {}
