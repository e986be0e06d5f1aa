//! Compile-fail tests: unsupported syntax and invalid parameter combinations are errors spanned
//! on the user's tokens (stderr pinned in tests/ui/*.stderr; regenerate with TRYBUILD=overwrite).

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
