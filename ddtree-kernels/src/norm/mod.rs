//! Normalization and the f32 residual stream: RMSNorm ([`rms_norm`]), the residual add fused with
//! the following RMSNorm and the residual-stream casts and f32 row copy ([`residual`]).

pub mod check;
pub mod op;
pub mod residual;
pub mod rms_norm;
pub mod tune;
