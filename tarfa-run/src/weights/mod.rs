//! Where the forward gets its weights: the [`WeightSource`] trait, which yields verified host
//! buffers, and the types it yields.
//!
//! Non-expert tensors are asked for by name once, when a model is loaded. Expert matrices are
//! asked for per layer, for the set of experts one forward step needs, every step: that is the
//! seam where a verified bundle reader and an expert-streaming cache plug in without the forward
//! changing. Implementations must hand out bytes that were verified in the very buffer returned
//! (docs/EXACTNESS.md section 1) and must never memory-map weights for compute.

pub mod memory;
pub mod safetensors_dir;

use std::sync::Arc;

use crate::numerics::AlignedVec;

pub use memory::InMemorySource;
pub use safetensors_dir::load_safetensors_dir;

/// Element type of a tensor the runtime computes with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    /// bfloat16, widened exactly to f32 when used.
    Bf16,
    /// IEEE binary32, used as it is.
    F32,
}

/// The elements of a host tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum TensorData {
    /// Raw BF16 bits.
    Bf16(AlignedVec<u16>),
    /// F32 values.
    F32(AlignedVec<f32>),
}

impl TensorData {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            TensorData::Bf16(_) => DType::Bf16,
            TensorData::F32(_) => DType::F32,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            TensorData::Bf16(v) => v.len(),
            TensorData::F32(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A verified, owned tensor in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Elements, row-major.
    pub data: TensorData,
}

/// A row-major BF16 matrix (expert weights are always BF16: contract section 1).
#[derive(Clone, Debug, PartialEq)]
pub struct Bf16Matrix {
    /// Output rows.
    pub rows: usize,
    /// Columns (input length).
    pub cols: usize,
    /// `rows * cols` raw BF16 values.
    pub data: AlignedVec<u16>,
}

impl Bf16Matrix {
    /// Bytes of weights.
    pub fn bytes(&self) -> u64 {
        2 * self.data.len() as u64
    }
}

/// One expert's three matrices: `gate` and `up` are `[I, H]`, `down` is `[H, I]`.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertWeights {
    pub gate: Bf16Matrix,
    pub up: Bf16Matrix,
    pub down: Bf16Matrix,
}

impl ExpertWeights {
    /// Bytes of weights of the expert.
    pub fn bytes(&self) -> u64 {
        self.gate.bytes() + self.up.bytes() + self.down.bytes()
    }
}

/// A weight that cannot be had or used.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    /// The source has no tensor of that name.
    #[error("tensor `{0}` is not in the weights")]
    MissingTensor(String),
    /// The source has no weights for that expert.
    #[error("expert {expert} of layer {layer} is not in the weights (missing `{name}`)")]
    MissingExpert {
        layer: usize,
        expert: usize,
        name: String,
    },
    /// A tensor's element type is not BF16 or F32.
    #[error("tensor `{name}` has dtype {dtype}; only BF16 and F32 are computed with")]
    UnsupportedDtype { name: String, dtype: String },
    /// An expert tensor is not BF16.
    #[error("expert tensor `{name}` has dtype {dtype}; expert weights must be BF16")]
    ExpertNotBf16 { name: String, dtype: String },
    /// A tensor's shape is not what the config implies.
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    /// The element count does not match the shape.
    #[error("tensor `{name}`: {len} elements do not fill shape {shape:?}")]
    LengthMismatch {
        name: String,
        shape: Vec<usize>,
        len: usize,
    },
    /// The same tensor name appears twice.
    #[error("tensor `{0}` appears in more than one file")]
    Duplicate(String),
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A safetensors file is malformed.
    #[error("{path} is not a valid safetensors file: {msg}")]
    Safetensors { path: String, msg: String },
    /// The bundle refused to hand out bytes (verification failure, I/O error).
    #[error(transparent)]
    Bundle(#[from] crate::bundle::BundleError),
    /// The directory holds no safetensors file.
    #[error("no .safetensors files in {0}")]
    NoFiles(String),
}

/// A provider of verified weights.
///
/// `Send + Sync`: one source serves all threads and sessions.
pub trait WeightSource: Send + Sync {
    /// A non-expert tensor by its checkpoint name.
    fn tensor(&self, name: &str) -> Result<Arc<HostTensor>, WeightError>;

    /// Whether a non-expert tensor of that name exists (for optional ones, like `lm_head` under
    /// tied embeddings).
    fn contains(&self, name: &str) -> bool;

    /// The experts `ids` of layer `layer`, in the order asked. The forward calls this once per
    /// MoE layer per step with the sorted set the step's tokens chose, so a streaming source
    /// fetches each expert once per layer per step.
    fn experts(&self, layer: usize, ids: &[usize]) -> Result<Vec<Arc<ExpertWeights>>, WeightError>;
}

impl HostTensor {
    /// Checks that the element count fills the shape.
    pub fn new(name: &str, shape: Vec<usize>, data: TensorData) -> Result<HostTensor, WeightError> {
        let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if n != Some(data.len()) {
            return Err(WeightError::LengthMismatch {
                name: name.to_string(),
                shape,
                len: data.len(),
            });
        }
        Ok(HostTensor { shape, data })
    }

    /// Bytes of the elements.
    pub fn bytes(&self) -> u64 {
        match &self.data {
            TensorData::Bf16(v) => 2 * v.len() as u64,
            TensorData::F32(v) => 4 * v.len() as u64,
        }
    }
}
