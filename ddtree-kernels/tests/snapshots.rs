//! insta snapshots of the generated CUDA source: the first (default) and the last candidate of
//! every kernel, named by the variant symbol (name + every parameter), stored in the
//! workspace's `snapshots/` folder. Changing a kernel body without `cargo insta review` fails.

use std::collections::BTreeMap;

#[test]
fn generated_sources_match_snapshots() {
    let mut by_kernel: BTreeMap<&str, Vec<ddtree_kernels::Variant>> = BTreeMap::new();
    for v in ddtree_kernels::catalogue().expect("every candidate builds its IR") {
        by_kernel.entry(v.kernel).or_default().push(v);
    }
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../snapshots");
    for (_, variants) in by_kernel {
        let mut points = vec![&variants[0]];
        if variants.len() > 1 {
            points.push(&variants[variants.len() - 1]);
        }
        for v in points {
            insta::with_settings!({
                snapshot_path => dir,
                prepend_module_to_snapshot => false,
                omit_expression => true,
                description => format!("CUDA source of {}", v.symbol),
            }, {
                insta::assert_snapshot!(v.symbol.clone(), &v.source);
            });
        }
    }
}

#[test]
fn sources_are_deterministic() {
    let a = ddtree_kernels::catalogue().unwrap();
    let b = ddtree_kernels::catalogue().unwrap();
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.source, y.source, "{} renders differently on a second build", x.symbol);
    }
}
