use ddtree_macros::kernel;

#[kernel(block = 32)]
pub fn k(x: &[f32], out: &mut [f32]) {
    let v = &x[1..4];
    out[0] = v[0];
}

fn main() {}
