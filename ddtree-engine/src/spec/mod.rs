//! DDTree speculative decoding: drafters, the draft -> tree -> verify -> accept loop, sampling
//! and statistics, written against [`crate::Backend`] so every backend runs it unchanged.
//!
//! - [`drafter`]: the [`Drafter`] trait;
//! - [`dflash`]: the DFlash block-diffusion drafters of the z-lab package (v1 and v2);
//! - [`test_drafters`]: [`Oracle`] and [`Noisy`];
//! - [`ddtree`]: the loop, [`generate_speculative`];
//! - [`budget`]: the cost-aware budget of `auto`, [`CostModel`] and [`choose_budget`];
//! - [`sampling`]: greedy / temperature / top-p token choice shared with plain decoding;
//! - [`stats`]: the counters and timings, [`SpecStats`].

pub mod budget;
pub mod ddtree;
pub mod dflash;
pub mod drafter;
pub mod sampling;
pub mod stats;
pub mod test_drafters;

pub use budget::{choose_budget, CostModel, VerifyPoint};
pub use ddtree::{
    generate_speculative, generate_speculative_with_sink, Budget, SpecGeneration, SpecOptions, TreeSource,
    AUTO_BUILD_GROWTH, AUTO_MAX_BUDGET, AUTO_MIN_BUILD,
};
pub use dflash::DFlashDrafter;
pub use drafter::{DraftRequest, Drafter};
pub use sampling::Sampling;
pub use stats::SpecStats;
pub use test_drafters::{Noisy, Oracle};
