//! The facts about Mixture-of-Experts families that the converter and the runtime share, so that a
//! checkpoint the runtime would refuse is refused before a conversion writes its first byte.
//!
//! - [`config`]: a Hugging Face `config.json` parsed and validated into [`config::MoeConfig`];
//!   every feature the runtime does not implement (YaRN, sliding windows, another activation) is
//!   an error naming its key.
//! - [`model`]: family descriptions ([`model::Family`], one small file each) resolved into an
//!   [`model::ArchSpec`] (which layers are dense, which biases and norms exist, tensor names).
//! - [`shapes`]: the shape rules: every tensor a config implies, with its expected shape and
//!   whether the runtime needs it, and every expert matrix's shape.
//! - [`tokenizer`]: whether a `tokenizer.json` loads and fits the model's vocabulary.
//!
//! It will grow into the home of the numerics contract and the step types when the runtime is
//! split into crates; for now it holds config, families and shape rules.
//!
//! What it must never do: I/O beyond parsing what it is handed (text, bytes, a tensor table),
//! backend code, or arithmetic on weights. Callers read files; this crate only judges them.

pub mod config;
pub mod model;
pub mod shapes;
pub mod tokenizer;
