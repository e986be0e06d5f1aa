//! The INT4 host code against vectors made by the `compressed-tensors` package itself
//! (`scripts/make_int4_vectors.py`): packing, unpacking, Kimi's quantizer and dequantization.

use ddtree_kernels::w4a16::layout::{pack, quantize, unpack, PackedInt4};
use half::bf16;

struct Vectors {
    n: usize,
    k: usize,
    group: usize,
    weight: Vec<bf16>,
    scales: Vec<bf16>,
    codes: Vec<i8>,
    packed: Vec<u32>,
    dequant: Vec<bf16>,
}

fn load() -> Vectors {
    let text = include_str!("data/int4_vectors.txt");
    let field = |name: &str| -> Vec<i64> {
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .expect(name);
        line.split_whitespace()
            .skip(1)
            .map(|v| v.parse().expect("integer"))
            .collect()
    };
    let bf = |name: &str| field(name).into_iter().map(|b| bf16::from_bits(b as u16)).collect();
    let shape = field("shape");
    Vectors {
        n: shape[0] as usize,
        k: shape[1] as usize,
        group: shape[2] as usize,
        weight: bf("weight_bf16"),
        scales: bf("weight_scale_bf16"),
        codes: field("codes").into_iter().map(|c| c as i8).collect(),
        packed: field("weight_packed_u32").into_iter().map(|w| w as u32).collect(),
        dequant: bf("dequant_bf16"),
    }
}

#[test]
fn packing_matches_compressed_tensors() {
    let v = load();
    assert_eq!(pack(&v.codes, v.k), v.packed);
    assert_eq!(unpack(&v.packed), v.codes);
}

#[test]
fn quantizer_matches_kimi_rule_in_compressed_tensors() {
    let v = load();
    let p = quantize(&v.weight, v.n, v.k, v.group, 1);
    assert_eq!(p.scales, v.scales);
    assert_eq!(p.packed, v.packed);
}

#[test]
fn dequantization_matches_compressed_tensors() {
    let v = load();
    let p = PackedInt4 {
        packed: v.packed,
        scales: v.scales,
        n: v.n,
        k: v.k,
        group: v.group,
        experts: 1,
    };
    // compressed-tensors dequantizes in bf16: our exact f32 product rounds to the same value.
    let ours: Vec<bf16> = p.dequantize().iter().map(|&x| bf16::from_f32(x)).collect();
    assert_eq!(ours, v.dequant);
}
