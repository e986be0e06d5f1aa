//! The registry: every kernel of the crate, listed once, grouped by the check suite that covers
//! it. [`crate::catalogue`] (the snapshot and NVRTC tests), [`crate::check::run_all`] (the
//! `kernel-check` binary) and the interpreter tests (`tests/interp.rs`, one test per suite) all
//! come from [`for_each_suite!`](crate::for_each_suite).
//!
//! Adding a kernel: one line in the macro below, in the entry of the suite that checks it (or a
//! new entry with its suite). A kernel marked `#[wgmma]` is only checked where `wgmma` runs (the
//! interpreter, an sm_90 GPU); `#[unchecked]` names a kernel of the catalogue the suite runs
//! without asserting that every one of its candidates was checked. The kernels after
//! `elsewhere` have their own tests (`tests/tree_interp.rs`).

use ddtree_codegen::Kernel;
use rand::rngs::StdRng;

use crate::check::{CheckError, CheckResult, Sizes, Suite, Target};

/// Calls the macro `$cb` with the registry:
/// `suites { name: [#[flag] Kernel, ..] => suite; .. } elsewhere [Kernel, ..]`.
#[macro_export]
macro_rules! for_each_suite {
    ($cb:ident) => {
        $cb! {
            suites {
                rms_norm: [$crate::RmsNorm] => $crate::check::rms_norm_suite;
                silu_mul: [$crate::SiluMul] => $crate::check::silu_mul_suite;
                silu_mul_split: [$crate::SiluMulSplit] => $crate::check::silu_mul_split_suite;
                rope: [$crate::RopeInterleaved] => $crate::check::rope_suite;
                embedding: [$crate::Embedding] => $crate::check::embedding_suite;
                vocab: [$crate::EmbeddingSlice, $crate::RankArgmax] => $crate::check::vocab_suite;
                add_assign: [$crate::AddAssign] => $crate::check::add_suite;
                copy_rows: [$crate::CopyRows] => $crate::check::copy_rows_suite;
                topk: [$crate::RowTopk] => $crate::check::topk_suite;
                topk_split: [$crate::RowTopkSplit] => $crate::check::topk_split_suite;
                gemm_bf16: [$crate::GemmBf16] => $crate::check::gemm_suite;
                fills: [$crate::FillRandomBf16, $crate::FillRandomF32, $crate::FillRandomU32] => $crate::check::fill_suite;
                w4a16: [
                    $crate::w4a16::W4a16Gemm,
                    #[wgmma] $crate::w4a16::W4a16GemmWg,
                    $crate::w4a16::W4a16Reduce,
                    $crate::w4a16::W4a16Repack,
                    $crate::w4a16::MoeAlign,
                    $crate::w4a16::MoeSum
                ] => $crate::w4a16::check::suite;
                w4a16_gemv: [$crate::w4a16::W4a16Gemv] => $crate::w4a16::check::gemv_suite;
                mla_kv_append: [$crate::MlaKvAppend] => $crate::attention::check::kv_append_suite;
                mla_attention: [$crate::MlaAttention] => $crate::attention::check::mla_attention_suite;
                gqa_attention: [$crate::GqaAttention] => $crate::attention::check::gqa_attention_suite;
                verify_attention: [
                    $crate::tree::MlaVerifySplit,
                    $crate::tree::MlaVerifyWide,
                    #[wgmma] $crate::tree::MlaVerifyWg,
                    #[wgmma] $crate::tree::MlaVerifyNarrow,
                    #[unchecked] $crate::tree::MlaVerifyCombine,
                    $crate::tree::MlaCombineOutput,
                    #[unchecked] $crate::tree::MlaVerifyNaive
                ] => $crate::tree::check::verify_suite;
                moe_route: [$crate::MoeRoute, $crate::MoeLocalize] => $crate::check::moe_route_suite;
                add_rms_norm: [$crate::AddRmsNorm] => $crate::check::add_rms_norm_suite;
                cast_bf16_f32: [$crate::CastBf16F32] => $crate::check::cast_bf16_f32_suite;
                cast_f32_bf16: [$crate::CastF32Bf16] => $crate::check::cast_f32_bf16_suite;
                copy_rows_f32: [$crate::CopyRowsF32] => $crate::check::copy_rows_f32_suite;
                gemv: [$crate::GemvBf16, $crate::GemvBf16F32] => $crate::check::gemv_suite;
                gemv_split: [$crate::GemvSplitBf16, $crate::GemvSplitF32] => $crate::check::gemv_split_suite;
                gemv_gate_up_silu: [$crate::GemvGateUpSilu] => $crate::check::gemv_gate_up_suite;
                gemv_split_gate_up_silu: [$crate::GemvSplitGateUpSilu] => $crate::check::gemv_split_gate_up_suite;
                gemv_rms_norm: [$crate::GemvRmsNormBf16] => $crate::check::gemv_rms_norm_suite;
                mla_absorb_query: [$crate::MlaAbsorbQuery] => $crate::attention::check::mla_absorb_query_suite;
                mla_absorb_output: [$crate::MlaAbsorbOutput] => $crate::attention::check::mla_absorb_output_suite;
                w4a16_sk: [
                    #[wgmma] $crate::w4a16::W4a16GemmSk,
                    #[wgmma] $crate::w4a16::W4a16ActTiles,
                    #[wgmma] $crate::w4a16::W4a16RepackFragment
                ] => $crate::w4a16::check::sk_suite;
            }
            elsewhere [
                $crate::tree::TreeBuild,
                $crate::tree::TreeAccept,
                $crate::tree::TreeStage,
                $crate::tree::TreeSample,
                $crate::tree::CompactRows
            ]
        }
    };
}

/// One kernel of a suite's entry.
#[derive(Clone, Copy, Debug)]
pub struct Covered {
    /// Kernel name.
    pub name: &'static str,
    /// The symbols of its candidates.
    pub symbols: fn() -> Vec<String>,
    /// Only checked where `wgmma` runs.
    pub wgmma: bool,
    /// Whether the suite must check every candidate.
    pub checked: bool,
}

/// The symbols of every candidate of `K`.
pub fn symbols<K: Kernel>() -> Vec<String> {
    K::space().iter().map(K::symbol).collect()
}

/// One check suite and the kernels it covers.
#[derive(Clone, Copy, Debug)]
pub struct Entry {
    /// Its name (the interpreter test's name).
    pub name: &'static str,
    /// The suite.
    pub suite: Suite,
    /// The kernels it covers.
    pub kernels: &'static [Covered],
}

#[doc(hidden)]
#[macro_export]
macro_rules! __registry_flag {
    (wgmma wgmma) => {
        true
    };
    (unchecked unchecked) => {
        true
    };
    ($want:ident $($other:ident)?) => {
        false
    };
}

macro_rules! entries {
    (suites { $( $name:ident: [ $( $(#[$flag:ident])? $k:path ),+ ] => $suite:path; )* } elsewhere [ $($o:path),* ]) => {
        /// Every check suite with the kernels it covers, in `run_all` order.
        pub static ENTRIES: &[Entry] = &[$(
            Entry {
                name: stringify!($name),
                suite: $suite,
                kernels: &[$(Covered {
                    name: <$k as Kernel>::NAME,
                    symbols: symbols::<$k>,
                    wgmma: $crate::__registry_flag!(wgmma $($flag)?),
                    checked: !$crate::__registry_flag!(unchecked $($flag)?),
                }),+],
            },
        )*];
    };
}
crate::for_each_suite!(entries);

impl Entry {
    /// The entry named `name`.
    pub fn named(name: &str) -> Option<&'static Entry> {
        ENTRIES.iter().find(|e| e.name == name)
    }

    /// Whether the suite runs on `t`: not when every kernel it covers needs `wgmma` and `t`
    /// has none.
    pub fn runs_on(&self, t: &Target<'_>) -> bool {
        t.runs_wgmma() || self.kernels.iter().any(|k| !k.wgmma)
    }

    /// Runs the suite on `t` (nothing where [`Entry::runs_on`] says no).
    pub fn run(&self, t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
        if !self.runs_on(t) {
            return Ok(Vec::new());
        }
        (self.suite)(t, sizes, rng)
    }

    /// The candidates of the kernels this suite must check on `t` that no result names (a
    /// pipeline's results name its variants joined by ` + `).
    pub fn unchecked(&self, t: &Target<'_>, results: &[CheckResult]) -> Vec<String> {
        let named = |s: &str| results.iter().any(|r| r.symbol.split(" + ").any(|x| x == s));
        self.kernels
            .iter()
            .filter(|k| k.checked && (!k.wgmma || t.runs_wgmma()))
            .flat_map(|k| (k.symbols)())
            .filter(|s| !named(s))
            .collect()
    }
}
