//! Where the forward gets its weights: the [`WeightSource`] trait, which yields verified host
//! buffers, and the types it yields.
//!
//! Non-expert tensors are asked for by name once, when a model is loaded. Expert matrices are
//! asked for per layer, for the set of experts one forward step needs, every step: that is the
//! seam where a verified bundle reader and an expert-streaming cache (tarfa-stream) plug in.
//! Two hints with resident defaults let a source with a memory budget cooperate: how to group
//! the experts ([`WeightSource::expert_batches`]) and which reads to start now
//! ([`WeightSource::prefetch`]); two more let it read the next layer's likely experts before
//! their routes are known ([`WeightSource::lookahead`]). Implementations must hand out bytes
//! that were verified in the very buffer returned (docs/EXACTNESS.md section 1) and must never
//! memory-map weights for compute.

pub mod fused;
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

/// A borrowed row-major BF16 matrix: `rows * cols` raw BF16 values.
#[derive(Clone, Copy, Debug)]
pub struct Bf16View<'a> {
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u16],
}

impl Bf16Matrix {
    /// The matrix as a view.
    pub fn view(&self) -> Bf16View<'_> {
        Bf16View {
            rows: self.rows,
            cols: self.cols,
            data: &self.data,
        }
    }
}

/// One expert's verified weights however they are held: owned matrices ([`ExpertWeights`]), or
/// views into the one buffer an extent was read and verified in (the streaming store, which
/// must not copy bytes after checking them). The forward only ever reads through this.
pub trait ExpertData: Send + Sync {
    /// `[gate, up, down]`: gate and up are `[I, H]`, down is `[H, I]`.
    fn matrices(&self) -> [Bf16View<'_>; 3];

    /// Bytes of weights of the expert.
    fn bytes(&self) -> u64 {
        self.matrices()
            .iter()
            .map(|m| 2 * m.data.len() as u64)
            .sum()
    }
}

impl ExpertData for ExpertWeights {
    fn matrices(&self) -> [Bf16View<'_>; 3] {
        [self.gate.view(), self.up.view(), self.down.view()]
    }
}

/// A shared handle on one expert's weights. A streaming source counts the bytes behind it
/// against its budget until the last handle is dropped, so callers drop handles as soon as the
/// expert's products are computed.
pub type ExpertHandle = Arc<dyn ExpertData>;

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
    /// An MXFP4 block of an expert has no exact BF16 widening (scale 255, or an overflow).
    #[error("tensor `{name}`, expert {expert}: {msg}; MXFP4 is widened exactly or refused")]
    Mxfp4 {
        name: String,
        expert: usize,
        msg: String,
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
    /// The directory holds no safetensors file.
    #[error("no .safetensors files in {0}")]
    NoFiles(String),
    /// The source behind the seam refused to hand out bytes: the bundle reader (verification
    /// failure, I/O error) or the expert-streaming store (the same, or a request larger than its
    /// budget). Their error types live in the crates that implement them, below which this one
    /// sits, so the error travels boxed and keeps its own exit code.
    #[error("{0}")]
    Source(Box<dyn SourceFailure>),
}

/// The error of a weight source implemented outside this crate (the bundle reader, the streaming
/// store), carried through [`WeightError::Source`].
pub trait SourceFailure: std::error::Error + Send + Sync + 'static {
    /// The documented exit code: 1 verification failure, 2 bad input, 3 environment.
    fn exit_code(&self) -> i32;

    /// The error itself, to downcast to the source's own type.
    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static);
}

impl WeightError {
    /// The documented exit code ([`crate::exit`]). A source's own error keeps its code; weights
    /// that do not fit their own config come from a broken bundle or checkpoint, which is a
    /// verification failure; an unreadable file is the environment's.
    pub fn exit_code(&self) -> i32 {
        match self {
            WeightError::Source(s) => s.exit_code(),
            WeightError::Io { .. } => crate::exit::ENVIRONMENT,
            WeightError::MissingTensor(_)
            | WeightError::MissingExpert { .. }
            | WeightError::UnsupportedDtype { .. }
            | WeightError::ExpertNotBf16 { .. }
            | WeightError::Mxfp4 { .. }
            | WeightError::ShapeMismatch { .. }
            | WeightError::LengthMismatch { .. }
            | WeightError::Duplicate(_)
            | WeightError::Safetensors { .. }
            | WeightError::NoFiles(_) => crate::exit::VERIFICATION_FAILED,
        }
    }

    /// The source's own error of type `E`, when this is a [`WeightError::Source`] holding one.
    pub fn source_error<E: std::error::Error + 'static>(&self) -> Option<&E> {
        match self {
            WeightError::Source(s) => s.as_error().downcast_ref::<E>(),
            _ => None,
        }
    }
}

/// Page-locks host memory for a GPU backend, so that copies from the warm tier's buffers to the
/// device are asynchronous DMA at the bus's speed instead of staged through the driver. The
/// store calls `pin` on each buffer once it is verified (on a reader thread) and `unpin` before
/// the buffer is unmapped. Pinning never changes a byte.
pub trait HostPin: Send + Sync {
    /// Page-locks `len` bytes at `ptr`; false when it could not (the buffer stays pageable).
    fn pin(&self, ptr: *mut u8, len: usize) -> bool;
    /// Undoes a successful `pin` of the buffer at `ptr`.
    fn unpin(&self, ptr: *mut u8);
}

/// What a source that reads ahead wants the forward to compute for it
/// ([`WeightSource::lookahead_input`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LookaheadInput {
    /// No look-ahead: no guess is computed, [`WeightSource::lookahead`] is not called.
    #[default]
    None,
    /// The source guesses by itself (from its heat ledger): the forward only says which MoE
    /// layer comes next, and how many experts the one before needed.
    LayerOnly,
    /// Also this step's residual through the next MoE layer's router: the experts it would
    /// choose now (an approximate guess; the residual still changes before that layer).
    Router,
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

    /// The experts `ids` of layer `layer`, in the order asked, as owned matrices (for callers
    /// that keep them, such as a backend uploading every expert). The CPU forward asks through
    /// [`WeightSource::expert_data`] instead, whose default calls this: once per MoE layer per
    /// step with the sorted set the step's tokens chose (or once per group, see
    /// [`WeightSource::expert_batches`]), so each expert is fetched once per layer per step.
    fn experts(&self, layer: usize, ids: &[usize]) -> Result<Vec<Arc<ExpertWeights>>, WeightError>;

    /// Batch-size hint: how the forward should group the sorted, distinct experts `ids` of
    /// `layer` that one step needs, and in which order to ask for the groups. Every id must
    /// appear in exactly one group (the forward checks). A source that can hand out all of them
    /// at once returns one group (the default); a source with a memory budget returns groups
    /// that fit, putting the experts it already holds first. Grouping never changes a bit: each
    /// expert's products are independent, and the forward mixes in ascending expert id.
    fn expert_batches(&self, layer: usize, ids: &[usize]) -> Vec<Vec<usize>> {
        let _ = layer;
        vec![ids.to_vec()]
    }

    /// Prefetch hint: the forward will ask for `batches` of `layer` next, in that order (what
    /// [`WeightSource::expert_batches`] returned). A streaming source starts reading them now,
    /// in parallel, as far as its budget allows. A resident source ignores it (the default). A
    /// later call replaces an earlier one's plan.
    fn prefetch(&self, layer: usize, batches: &[Vec<usize>]) {
        let _ = (layer, batches);
    }

    /// Use hint: the experts `ids` of `layer` were used by a step without being asked for,
    /// because a tier above this source (the GPU's hot tier) held them. A source that learns
    /// expert heat (the streaming store's ledger) counts them; nothing is read.
    fn record_uses(&self, layer: usize, ids: &[usize]) {
        let _ = (layer, ids);
    }

    /// Look-ahead hint: what the source wants from the forward to read the next MoE layer's
    /// likely experts while this one computes ([`LookaheadInput`]; `None` by default, and then
    /// the forward computes no guess and never calls [`WeightSource::lookahead`]).
    fn lookahead_input(&self) -> LookaheadInput {
        LookaheadInput::None
    }

    /// Look-ahead hint: MoE layer `layer` comes next in this step. `count` is how many distinct
    /// experts the layer before it needed (how many to guess, for a source guessing by itself);
    /// `router_guess` the experts this step's tokens would choose if their residual went
    /// through `layer`'s router now, most likely first (empty unless [`LookaheadInput::Router`]
    /// was asked for). A source may start reading some of them. A guess only decides what is
    /// read early: the forward still asks for exactly the experts the router chooses, and the
    /// source hands out only bytes verified as always. A later call replaces an earlier one.
    fn lookahead(&self, layer: usize, count: usize, router_guess: &[usize]) {
        let _ = (layer, count, router_guess);
    }

    /// Pinning hint: a GPU backend copies experts from the handles this source hands out;
    /// a source that allocates their buffers page-locks them with `pin` (the streaming store).
    fn use_host_pin(&self, pin: Arc<dyn HostPin>) {
        let _ = pin;
    }

    /// The experts `ids` of layer `layer`, in the order asked, as handles the forward computes
    /// from directly. The default hands out [`WeightSource::experts`]; a streaming source hands
    /// out views of the buffers it verified, without copying.
    fn expert_data(&self, layer: usize, ids: &[usize]) -> Result<Vec<ExpertHandle>, WeightError> {
        Ok(self
            .experts(layer, ids)?
            .into_iter()
            .map(|e| e as ExpertHandle)
            .collect())
    }
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
