//! Safetensors checkpoints: `model.safetensors.index.json` + memory-mapped shards (or a single
//! `model.safetensors`), or shards embedded in the binary.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::Metadata;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::error::{EngineError, Result};

/// Name of the shard index file.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Name of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";

/// The bytes of one shard.
enum ShardBytes {
    Mapped(Mmap),
    Static(&'static [u8]),
}

impl std::ops::Deref for ShardBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Self::Mapped(m) => m,
            Self::Static(s) => s,
        }
    }
}

struct Shard {
    path: PathBuf,
    bytes: ShardBytes,
    /// Offset of the data section (after the 8-byte length and the JSON header).
    data_start: usize,
    metadata: Metadata,
}

impl Shard {
    fn parse(path: PathBuf, bytes: ShardBytes) -> Result<Self> {
        let (header_len, metadata) = SafeTensors::read_metadata(&bytes).map_err(|e| EngineError::Safetensors {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        Ok(Self {
            path,
            bytes,
            data_start: 8 + header_len,
            metadata,
        })
    }
}

/// A read-only view of one tensor in a checkpoint.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a> {
    /// Tensor name.
    pub name: &'a str,
    /// The shard file holding it.
    pub file: &'a Path,
    /// On-disk dtype.
    pub dtype: Dtype,
    /// On-disk shape.
    pub shape: &'a [usize],
    /// Raw little-endian bytes.
    pub data: &'a [u8],
}

impl TensorRef<'_> {
    /// Fails with a shape error unless the shape is `expected`.
    pub fn expect_shape(&self, expected: &[usize]) -> Result<()> {
        if self.shape == expected {
            Ok(())
        } else {
            Err(EngineError::Shape {
                file: self.file.to_path_buf(),
                tensor: self.name.to_string(),
                expected: expected.to_vec(),
                got: self.shape.to_vec(),
            })
        }
    }

    /// Fails with a dtype error unless the dtype is one of `accepted`.
    pub fn expect_dtype(&self, accepted: &[Dtype]) -> Result<()> {
        if accepted.contains(&self.dtype) {
            Ok(())
        } else {
            let names: Vec<String> = accepted.iter().map(|d| format!("{d:?}")).collect();
            Err(EngineError::Dtype {
                file: self.file.to_path_buf(),
                tensor: self.name.to_string(),
                expected: names.join(" or "),
                got: format!("{:?}", self.dtype),
            })
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Converts a BF16/F16/F32 tensor to f32; with `check_finite`, NaN or infinity is an error.
    pub fn to_f32(&self, check_finite: bool) -> Result<Vec<f32>> {
        self.expect_dtype(&FLOAT_DTYPES)?;
        let values: Vec<f32> = match self.dtype {
            Dtype::BF16 => self
                .data
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F16 => self
                .data
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            _ => self
                .data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        };
        if check_finite {
            if let Some((index, &value)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(EngineError::NonFinite {
                    file: self.file.to_path_buf(),
                    tensor: self.name.to_string(),
                    index,
                    value,
                });
            }
        }
        Ok(values)
    }

    /// Reinterprets an I32/U32 tensor as `u32` words.
    pub fn to_u32_words(&self) -> Result<Vec<u32>> {
        self.expect_dtype(&[Dtype::I32, Dtype::U32])?;
        Ok(self
            .data
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// Reads an integer tensor (I32/I64/U32/U64) as `i64` values.
    pub fn to_i64(&self) -> Result<Vec<i64>> {
        self.expect_dtype(&[Dtype::I32, Dtype::I64, Dtype::U32, Dtype::U64])?;
        Ok(match self.dtype {
            Dtype::I32 => self
                .data
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as i64)
                .collect(),
            Dtype::U32 => self
                .data
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes(b.try_into().unwrap()) as i64)
                .collect(),
            Dtype::I64 => self
                .data
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                .collect(),
            _ => self
                .data
                .chunks_exact(8)
                .map(|b| u64::from_le_bytes(b.try_into().unwrap()) as i64)
                .collect(),
        })
    }
}

/// Dtypes accepted for floating-point weights.
pub const FLOAT_DTYPES: [Dtype; 3] = [Dtype::BF16, Dtype::F16, Dtype::F32];

/// A set of safetensors shards with a tensor-name routing table.
pub struct Checkpoint {
    location: PathBuf,
    shards: Vec<Shard>,
    routing: HashMap<String, usize>,
}

impl Checkpoint {
    /// Opens the checkpoint in `dir`: `model.safetensors.index.json` and its shards if the index
    /// exists, else `model.safetensors`. Shards are memory-mapped.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join(INDEX_FILE);
        let index = if index_path.exists() {
            Some(std::fs::read_to_string(&index_path).map_err(|e| EngineError::io(&index_path, e))?)
        } else {
            None
        };
        Self::assemble(dir, index.as_deref(), |name| {
            let path = dir.join(name);
            if !path.is_file() {
                return Ok(None);
            }
            let file = File::open(&path).map_err(|e| EngineError::io(&path, e))?;
            // SAFETY: the map is read-only and checkpoint files are not modified while loaded;
            // every access is bounds-checked against the validated safetensors header.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| EngineError::io(&path, e))?;
            Ok(Some((path, ShardBytes::Mapped(map))))
        })
    }

    /// A checkpoint whose files are static byte slices (a model embedded in the binary).
    /// `location` names it in messages; `files` maps file names to contents.
    pub fn from_static(location: &Path, index: Option<&str>, files: &[(&str, &'static [u8])]) -> Result<Self> {
        Self::assemble(location, index, |name| {
            Ok(files
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(n, bytes)| (location.join(n), ShardBytes::Static(bytes))))
        })
    }

    fn assemble(
        location: &Path,
        index: Option<&str>,
        mut open: impl FnMut(&str) -> Result<Option<(PathBuf, ShardBytes)>>,
    ) -> Result<Self> {
        let mut shards = Vec::new();
        let mut routing = HashMap::new();
        let Some(index) = index else {
            let (path, bytes) = open(SINGLE_FILE)?.ok_or_else(|| EngineError::Io {
                path: location.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("neither {INDEX_FILE} nor {SINGLE_FILE} found"),
                ),
            })?;
            let shard = Shard::parse(path, bytes)?;
            for name in shard.metadata.tensors().keys() {
                routing.insert(name.clone(), 0);
            }
            shards.push(shard);
            return Ok(Self {
                location: location.to_path_buf(),
                shards,
                routing,
            });
        };
        let index_path = location.join(INDEX_FILE);
        let value: Value = serde_json::from_str(index).map_err(|source| EngineError::Json {
            path: index_path.clone(),
            source,
        })?;
        let bad_field = |reason: &str| EngineError::Config {
            path: index_path.clone(),
            field: "weight_map".into(),
            reason: reason.into(),
        };
        let map = value
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| bad_field("missing or not an object"))?;
        let mut by_file: HashMap<&str, usize> = HashMap::new();
        for (tensor, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| bad_field(&format!("entry for `{tensor}` is not a file name")))?;
            if file.contains('/') || file.contains('\\') || file.starts_with('.') {
                return Err(bad_field(&format!(
                    "entry for `{tensor}` is not a plain file name: {file:?}"
                )));
            }
            let shard = match by_file.get(file) {
                Some(&i) => i,
                None => {
                    let (path, bytes) = open(file)?.ok_or_else(|| EngineError::MissingShard {
                        index: index_path.clone(),
                        file: file.to_string(),
                        tensor: tensor.clone(),
                    })?;
                    shards.push(Shard::parse(path, bytes)?);
                    by_file.insert(file, shards.len() - 1);
                    shards.len() - 1
                }
            };
            routing.insert(tensor.clone(), shard);
        }
        Ok(Self {
            location: index_path,
            shards,
            routing,
        })
    }

    /// Whether the checkpoint routes `name` to a shard.
    pub fn contains(&self, name: &str) -> bool {
        self.routing.contains_key(name)
    }

    /// Looks a tensor up; a name the index routes to a shard that lacks it is also "missing".
    pub fn tensor(&self, name: &str) -> Result<TensorRef<'_>> {
        let missing = |location: &Path| EngineError::MissingTensor {
            location: location.to_path_buf(),
            tensor: name.to_string(),
        };
        let (key, &shard_index) = self
            .routing
            .get_key_value(name)
            .ok_or_else(|| missing(&self.location))?;
        let shard = &self.shards[shard_index];
        let info = shard.metadata.info(name).ok_or_else(|| missing(&shard.path))?;
        let (start, end) = info.data_offsets;
        Ok(TensorRef {
            name: key,
            file: &shard.path,
            dtype: info.dtype,
            shape: &info.shape,
            data: &shard.bytes[shard.data_start + start..shard.data_start + end],
        })
    }

    /// Where the checkpoint was loaded from (index file, single file's directory, or embedded name).
    pub fn location(&self) -> &Path {
        &self.location
    }

    /// Total bytes of all shards.
    pub fn total_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.bytes.len() as u64).sum()
    }
}
