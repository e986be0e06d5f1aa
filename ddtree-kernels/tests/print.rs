#[test]
fn print_all() {
    for v in ddtree_kernels::catalogue().unwrap() {
        println!("==== {}\n{}", v.symbol, v.source);
    }
}
