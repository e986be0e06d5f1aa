//! Every candidate of every kernel on the CPU interpreter (and on the GPU when one is present)
//! against its CPU reference, at small ragged sizes; plus the interpreter's speed on a tile GEMM.
#![allow(clippy::result_large_err)]

use std::time::Instant;

use ddtree_codegen::Kernel;
use ddtree_kernels::check::{self, CheckResult, Sizes, Suite, Target};
use ddtree_kernels::w4a16::{self, MoeAlign, MoeSum, W4a16Gemm, W4a16GemmWg, W4a16Reduce, W4a16Repack};
use ddtree_kernels::{
    AddAssign, AddRmsNorm, CastBf16F32, CastF32Bf16, CopyRows, CopyRowsF32, Embedding, FillRandomBf16, FillRandomF32,
    FillRandomU32, GemmBf16, GemvBf16, GemvBf16F32, GemvGateUpSilu, GemvRmsNormBf16, GemvSplitBf16, GemvSplitF32,
    GemvSplitGateUpSilu, GqaAttention, MlaAbsorbOutput, MlaAbsorbQuery, MlaAttention, MlaKvAppend, MoeRoute, RmsNorm,
    RopeInterleaved, RowTopk, RowTopkSplit, SiluMul, SiluMulSplit,
};
use rand::rngs::StdRng;
use rand::SeedableRng;

/// Runs `suite` on every target and checks it covered every candidate of `K`.
fn every_candidate<K: Kernel>(suite: Suite) {
    check::on_each_target(|t, rng| {
        let results = suite(t, Sizes::Small, rng)?;
        assert_covers::<K>(&results);
        Ok(results)
    });
}

/// Every candidate of `K` appears in a result's symbol (a pipeline's results name its
/// variants joined by ` + `).
fn assert_covers<K: Kernel>(results: &[CheckResult]) {
    for p in K::space() {
        let s = K::symbol(&p);
        let named = |r: &CheckResult| r.symbol.split(" + ").any(|x| x == s);
        assert!(results.iter().any(named), "candidate {s} was not checked");
    }
}

#[test]
fn verify_attention() {
    check::on_each_target(|t, rng| {
        let results = ddtree_kernels::tree::check::verify_suite(t, Sizes::Small, rng)?;
        assert_covers::<ddtree_kernels::tree::MlaVerifySplit>(&results);
        assert_covers::<ddtree_kernels::tree::MlaVerifyWide>(&results);
        if t.runs_wgmma() {
            assert_covers::<ddtree_kernels::tree::MlaVerifyWg>(&results);
            assert_covers::<ddtree_kernels::tree::MlaVerifyNarrow>(&results);
        }
        assert_covers::<ddtree_kernels::tree::MlaCombineOutput>(&results);
        Ok(results)
    });
}

#[test]
fn rms_norm() {
    every_candidate::<RmsNorm>(check::rms_norm_suite);
}

#[test]
fn silu_mul() {
    every_candidate::<SiluMul>(check::silu_mul_suite);
}

#[test]
fn silu_mul_split() {
    every_candidate::<SiluMulSplit>(check::silu_mul_split_suite);
}

#[test]
fn rope() {
    every_candidate::<RopeInterleaved>(check::rope_suite);
}

#[test]
fn embedding() {
    every_candidate::<Embedding>(check::embedding_suite);
}

#[test]
fn add_assign() {
    every_candidate::<AddAssign>(check::add_suite);
}

#[test]
fn copy_rows() {
    every_candidate::<CopyRows>(check::copy_rows_suite);
}

#[test]
fn topk() {
    every_candidate::<RowTopk>(check::topk_suite);
}

/// Every part variant with the merge variant of its `k`, so every candidate of both passes.
#[test]
fn topk_split() {
    every_candidate::<RowTopkSplit>(check::topk_split_suite);
}

#[test]
fn gemm_bf16() {
    every_candidate::<GemmBf16>(check::gemm_suite);
}

#[test]
fn mla_kv_append() {
    every_candidate::<MlaKvAppend>(ddtree_kernels::attention::check::kv_append_suite);
}

#[test]
fn mla_attention() {
    every_candidate::<MlaAttention>(ddtree_kernels::attention::check::mla_attention_suite);
}

#[test]
fn gqa_attention() {
    every_candidate::<GqaAttention>(ddtree_kernels::attention::check::gqa_attention_suite);
}

#[test]
fn moe_route() {
    every_candidate::<MoeRoute>(check::moe_route_suite);
}

#[test]
fn add_rms_norm() {
    every_candidate::<AddRmsNorm>(check::add_rms_norm_suite);
}

#[test]
fn cast_bf16_f32() {
    every_candidate::<CastBf16F32>(check::cast_bf16_f32_suite);
}

#[test]
fn cast_f32_bf16() {
    every_candidate::<CastF32Bf16>(check::cast_f32_bf16_suite);
}

#[test]
fn copy_rows_f32() {
    every_candidate::<CopyRowsF32>(check::copy_rows_f32_suite);
}

/// The GEMV suite covers both output types.
#[test]
fn gemv() {
    check::on_each_target(|t, rng| {
        let results = check::gemv_suite(t, Sizes::Small, rng)?;
        assert_covers::<GemvBf16>(&results);
        assert_covers::<GemvBf16F32>(&results);
        Ok(results)
    });
}

/// The fill suite covers the three random fills.
#[test]
fn fills() {
    check::on_each_target(|t, rng| {
        let results = check::fill_suite(t, Sizes::Small, rng)?;
        assert_covers::<FillRandomBf16>(&results);
        assert_covers::<FillRandomF32>(&results);
        assert_covers::<FillRandomU32>(&results);
        Ok(results)
    });
}

/// The W4A16 suite covers the GEMM, its reduce, the repack and the MoE block's kernels.
#[test]
fn w4a16() {
    check::on_each_target(|t, rng| {
        let results = w4a16::check::suite(t, Sizes::Small, rng)?;
        assert_covers::<W4a16Gemm>(&results);
        assert_covers::<W4a16Reduce>(&results);
        assert_covers::<W4a16Repack>(&results);
        if t.runs_wgmma() {
            assert_covers::<W4a16GemmWg>(&results);
        }
        assert_covers::<MoeAlign>(&results);
        assert_covers::<MoeSum>(&results);
        Ok(results)
    });
}

/// The stream-K W4A16 GEMM, its activation tiles and its weights' repack (Hopper kernels: the interpreter, or an
/// sm_90 GPU).
#[test]
fn w4a16_sk() {
    check::on_each_target(|t, rng| {
        if !t.runs_wgmma() {
            println!("w4a16_sk: skipped on this GPU (no wgmma)");
            return Ok(Vec::new());
        }
        let results = w4a16::check::sk_suite(t, Sizes::Small, rng)?;
        assert_covers::<w4a16::W4a16GemmSk>(&results);
        assert_covers::<w4a16::W4a16ActTiles>(&results);
        assert_covers::<w4a16::W4a16RepackFragment>(&results);
        Ok(results)
    });
}

/// The small-token W4A16 path: dense GEMV and the routed gate_up / down pairs.
#[test]
fn w4a16_gemv() {
    every_candidate::<w4a16::W4a16Gemv>(w4a16::check::gemv_suite);
}

/// The budget: a 64x64x64 tile GEMM interprets in a few seconds in a debug build.
#[test]
fn a_64_cubed_tile_gemm_interprets_in_seconds() {
    let p = GemmBf16::space()
        .into_iter()
        .find(|p| p.bm == 64 && p.bn == 64 && p.bk == 64)
        .expect("a 64x64x64 tile");
    let start = Instant::now();
    let r = check::gemm(&Target::Interp, &p, 64, 64, 64, &mut StdRng::seed_from_u64(1)).expect("runs");
    let secs = start.elapsed().as_secs_f64();
    assert!(r.passed, "{:?}", r.comparison);
    eprintln!(
        "64x64x64 tile GEMM ({}) on the interpreter: {secs:.2} s",
        GemmBf16::symbol(&p)
    );
    assert!(secs < 10.0, "interpreting a 64x64x64 GEMM took {secs:.1} s");
}

#[test]
fn mla_absorb_query() {
    every_candidate::<MlaAbsorbQuery>(ddtree_kernels::attention::check::mla_absorb_query_suite);
}

#[test]
fn mla_absorb_output() {
    every_candidate::<MlaAbsorbOutput>(ddtree_kernels::attention::check::mla_absorb_output_suite);
}

#[test]
fn gemv_split() {
    check::on_each_target(|t, rng| {
        let results = check::gemv_split_suite(t, Sizes::Small, rng)?;
        assert_covers::<GemvSplitBf16>(&results);
        assert_covers::<GemvSplitF32>(&results);
        Ok(results)
    });
}

#[test]
fn gemv_rms_norm() {
    every_candidate::<GemvRmsNormBf16>(check::gemv_rms_norm_suite);
}

#[test]
fn gemv_gate_up_silu() {
    every_candidate::<GemvGateUpSilu>(check::gemv_gate_up_suite);
}

#[test]
fn gemv_split_gate_up_silu() {
    every_candidate::<GemvSplitGateUpSilu>(check::gemv_split_gate_up_suite);
}
