use ddtree_macros::kernel;

#[kernel(block = 128, min_blocks = n / 32)]
pub fn k(x: &mut [f32], n: u32) {
    x[0] = n as f32;
}

fn main() {}
