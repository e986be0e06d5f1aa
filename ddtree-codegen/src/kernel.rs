//! The [`Kernel`] trait every `#[kernel]` implements, compile-time parameter sets, and stable ids.

use std::fmt;

use crate::error::Result;
use crate::ir::KernelIr;

/// One compile-time parameter's value, as it appears in headers, symbols and ids.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ParamValue {
    /// An integer.
    Int(i64),
    /// A flag.
    Bool(bool),
    /// A fieldless enum variant, in snake_case.
    Variant(&'static str),
}

impl fmt::Display for ParamValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParamValue::Int(v) => write!(f, "{v}"),
            ParamValue::Bool(b) => write!(f, "{b}"),
            ParamValue::Variant(v) => f.write_str(v),
        }
    }
}

/// A type usable as a field of a params struct (`#[derive(KernelParams)]` implements it for
/// fieldless enums).
pub trait ParamField {
    /// The value.
    fn param_value(&self) -> ParamValue;
}

macro_rules! param_int {
    ($($t:ty),*) => {$(
        impl ParamField for $t {
            fn param_value(&self) -> ParamValue { ParamValue::Int(*self as i64) }
        }
    )*};
}
param_int!(u8, u16, u32, u64, usize, i8, i16, i32, i64);

impl ParamField for bool {
    fn param_value(&self) -> ParamValue {
        ParamValue::Bool(*self)
    }
}

/// A kernel's compile-time parameter set (derive it with `#[derive(KernelParams)]`).
pub trait KernelParams: Clone + fmt::Debug + PartialEq + Send + Sync + 'static {
    /// Every field as (name, value), in declaration order.
    fn fields(&self) -> Vec<(&'static str, ParamValue)>;
}

/// Kernels without compile-time parameters use `()`.
impl KernelParams for () {
    fn fields(&self) -> Vec<(&'static str, ParamValue)> {
        Vec::new()
    }
}

/// The `extern "C"` symbol of a kernel variant: the name, then each parameter
/// (`rms_norm__block256_vec8`, enums as `unpack_interleaved`, flags as `fused_true`).
pub fn symbol(name: &str, fields: &[(&'static str, ParamValue)]) -> String {
    if fields.is_empty() {
        return name.to_string();
    }
    let parts: Vec<String> = fields
        .iter()
        .map(|(k, v)| match v {
            ParamValue::Int(i) if *i < 0 => format!("{k}m{}", -i),
            ParamValue::Int(i) => format!("{k}{i}"),
            ParamValue::Bool(b) => format!("{k}_{b}"),
            ParamValue::Variant(s) => format!("{k}_{s}"),
        })
        .collect();
    format!("{name}__{}", parts.join("_"))
}

/// A stable kernel identity: the variant symbol (name + every parameter) and the target arch.
/// It keys the compile cache and the tune cache.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KernelId {
    /// The variant's `extern "C"` symbol.
    pub symbol: String,
    /// Target architecture, e.g. `sm_90a`.
    pub arch: String,
}

impl fmt::Display for KernelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.symbol, self.arch)
    }
}

/// A kernel written with `#[kernel]`: a family of CUDA kernels, one per parameter set.
pub trait Kernel: Send + Sync + 'static {
    /// Its compile-time parameters.
    type Params: KernelParams;
    /// The DSL function name.
    const NAME: &'static str;

    /// The candidates the autotuner tries; index 0 is the safe default.
    fn space() -> Vec<Self::Params>;

    /// Builds the IR for one parameter set.
    fn ir(params: &Self::Params) -> Result<KernelIr>;

    /// The CUDA C source for one parameter set.
    fn source(params: &Self::Params) -> Result<String> {
        Ok(crate::render::render(&Self::ir(params)?))
    }

    /// The `extern "C"` symbol for one parameter set.
    fn symbol(params: &Self::Params) -> String {
        symbol(Self::NAME, &params.fields())
    }

    /// The stable id for one parameter set on one architecture.
    fn id(params: &Self::Params, arch: &str) -> KernelId {
        KernelId {
            symbol: Self::symbol(params),
            arch: arch.to_string(),
        }
    }

    /// The safe default: the first candidate.
    fn default_params() -> Self::Params {
        Self::space()
            .into_iter()
            .next()
            .expect("a kernel's parameter space is never empty")
    }
}
