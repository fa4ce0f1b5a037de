//! Writes seed corpora for the fuzz targets in `fuzz/`: valid JNF files, header JSONs and
//! manifests, built with the same library code the converter uses, so every seed is accepted.
//!
//! ```sh
//! cargo run -p tarfa-verify --example fuzz_seeds -- fuzz/corpus
//! ```
//! writes `fuzz/corpus/{jnf_header,jnf_header_json,manifest,jnf_v2_extents}/seed-*` (format
//! version 2's encoded extents among them: files, header JSONs, manifests and lone extents).

use std::fs;
use std::path::{Path, PathBuf};

use jnf_format::{Dtype, ExtentCodec, Header, LayoutPlan, MatrixSpec, SourceRef, TensorSpec};
use tarfa_manifest::hash::{blake3_hex, sha256_hex};
use tarfa_manifest::{
    ExpertRecord, FileRecord, HeaderRecord, Manifest, MatrixRecord, ShardRecord, TensorRecord,
    CONTRACT_VERSION, MANIFEST_VERSION, MANIFEST_VERSION_CODECS,
};

struct Shape {
    layers: u32,
    experts: u32,
    hidden: u64,
    inter: u64,
    tensors: Vec<(&'static str, Dtype, Vec<u64>)>,
    mixtral: bool,
    source: bool,
}

fn plan(s: &Shape) -> Header {
    let mut plan = LayoutPlan::new();
    let src = |i: u64| {
        s.source.then(|| SourceRef {
            shard: format!("model-0000{}-of-00002.safetensors", 1 + i % 2),
            offset: 8 + 64 * i,
        })
    };
    for (i, (name, dtype, shape)) in s.tensors.iter().enumerate() {
        plan.add_tensor(TensorSpec {
            name: name.to_string(),
            dtype: *dtype,
            shape: shape.clone(),
            source: src(i as u64),
        });
    }
    let (module, mats) = if s.mixtral {
        ("block_sparse_moe.experts", ["w1", "w3", "w2"])
    } else {
        ("mlp.experts", ["gate_proj", "up_proj", "down_proj"])
    };
    let shapes = [
        vec![s.inter, s.hidden],
        vec![s.inter, s.hidden],
        vec![s.hidden, s.inter],
    ];
    for l in 0..s.layers {
        for e in 0..s.experts {
            let prefix = format!("model.layers.{l}.{module}.{e}");
            let specs = [0, 1, 2].map(|i| MatrixSpec {
                name: format!("{prefix}.{}.weight", mats[i]),
                dtype: Dtype::BF16,
                shape: shapes[i].clone(),
                source: src(u64::from(l * 100 + e * 3) + i as u64),
            });
            plan.add_expert(l, e, prefix, specs);
        }
    }
    plan.set_metadata("converter", "fuzz_seeds");
    plan.finish().expect("a valid plan")
}

/// The whole file (header, then deterministic nonzero data, zero padding).
fn file(h: &Header) -> Vec<u8> {
    let mut f = h.encode().unwrap();
    f.resize(h.file_size as usize, 0);
    for t in &h.tensors {
        for i in 0..t.length {
            f[(t.offset + i) as usize] = (i % 251) as u8 + 1;
        }
    }
    for e in &h.experts {
        for i in 0..e.length {
            f[(e.offset + i) as usize] = (i % 239) as u8 + 1;
        }
    }
    f
}

/// Weight-like BF16 bytes (few exponents), so that their encoding pays.
fn weights(n: usize, mut s: u64) -> Vec<u8> {
    (0..n)
        .flat_map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (0x3C00 | (s as u16 & 0x81FF)).to_le_bytes()
        })
        .collect()
}

/// `h` (a raw plan) as format version 2: every expert's weight-like bytes encoded, except the
/// last expert's, kept raw. Returns the header, the file, and each extent's decoded bytes.
fn encoded(h: &Header) -> (Header, Vec<u8>, Vec<Vec<u8>>) {
    let bytes: Vec<Vec<u8>> = h
        .experts
        .iter()
        .enumerate()
        .map(|(i, e)| weights(e.length as usize / 2, 1 + i as u64))
        .collect();
    let mut plan = LayoutPlan::from_header(h);
    let last = h.experts.len().saturating_sub(1);
    for (i, (e, b)) in h.experts.iter().zip(&bytes).enumerate() {
        let (codec, n) = if i == last {
            (ExtentCodec::Raw, e.length)
        } else {
            let n = jnf_codec::encode(b).unwrap().len() as u64;
            (ExtentCodec::ExponentPlaneZstd, n)
        };
        plan.set_extent_storage(e.layer, e.expert, codec, n);
    }
    let h2 = plan.finish().expect("a valid version-2 plan");
    let mut f = h2.encode().unwrap();
    f.resize(h2.file_size as usize, 0);
    for t in &h2.tensors {
        for i in 0..t.length {
            f[(t.offset + i) as usize] = (i % 251) as u8 + 1;
        }
    }
    for (e, b) in h2.experts.iter().zip(&bytes) {
        let stored = if e.is_encoded() {
            jnf_codec::encode(b).unwrap()
        } else {
            b.clone()
        };
        f[e.offset as usize..][..stored.len()].copy_from_slice(&stored);
    }
    (h2, f, bytes)
}

fn header_json(h: &Header) -> Vec<u8> {
    let enc = h.encode().unwrap();
    let len = u64::from_le_bytes(enc[16..24].try_into().unwrap()) as usize;
    let mut out = h.file_size.to_le_bytes().to_vec();
    out.extend_from_slice(&enc[24..24 + len]);
    out
}

fn manifest(h: &Header, data: &[u8], shards: bool) -> Manifest {
    manifest_of(h, data, shards, None)
}

/// The manifest of `h` over `data`; for a version-2 header, `decoded` holds each extent's
/// decoded bytes (the stored ones are in `data`).
fn manifest_of(h: &Header, data: &[u8], shards: bool, decoded: Option<&[Vec<u8>]>) -> Manifest {
    let bytes = |off: u64, len: u64| &data[off as usize..(off + len) as usize];
    let extent = |i: usize, e: &jnf_format::ExpertExtent| -> Vec<u8> {
        match decoded {
            Some(d) => d[i].clone(),
            None => bytes(e.offset, e.length).to_vec(),
        }
    };
    let v2 = decoded.is_some();
    let mut m = Manifest {
        root_digest: String::new(),
        computed_root: String::new(),
        manifest_version: if v2 {
            MANIFEST_VERSION_CODECS
        } else {
            MANIFEST_VERSION
        },
        format_version: format!("{}.{}", h.major, h.minor),
        contract_version: CONTRACT_VERSION,
        converter: "fuzz_seeds".into(),
        header: HeaderRecord::of_container_prefix(&h.encode().unwrap()).unwrap(),
        source: [("kind".to_string(), "synthetic".to_string())].into(),
        shards: Vec::new(),
        files: vec![FileRecord {
            name: "config.json".into(),
            size: 2,
            sha256: sha256_hex(b"{}"),
        }],
        tensors: h
            .tensors
            .iter()
            .map(|t| TensorRecord {
                name: t.name.clone(),
                dtype: t.dtype.as_str().into(),
                shape: t.shape.clone(),
                offset: t.offset,
                length: t.length,
                sha256: sha256_hex(bytes(t.offset, t.length)),
                blake3: blake3_hex(bytes(t.offset, t.length)),
                nonfinite: 0,
            })
            .collect(),
        experts: h
            .experts
            .iter()
            .enumerate()
            .map(|(i, e)| ExpertRecord {
                relayout: None,
                sources: Vec::new(),
                codec: v2.then(|| e.codec.as_str().to_string()),
                stored_length: v2.then_some(e.stored_length),
                stored_blake3: v2.then(|| blake3_hex(bytes(e.offset, e.stored_length))),
                name: e.prefix.clone(),
                layer: e.layer,
                expert: e.expert,
                offset: e.offset,
                length: e.length,
                padded_length: e.padded_length,
                sha256: sha256_hex(&extent(i, e)),
                blake3: blake3_hex(&extent(i, e)),
                nonfinite: 0,
                matrices: e
                    .matrices
                    .iter()
                    .map(|mm| MatrixRecord {
                        role: mm.role,
                        name: mm.name.clone(),
                        dtype: mm.dtype.as_str().into(),
                        shape: mm.shape.clone(),
                        offset: mm.offset,
                        length: mm.length,
                    })
                    .collect(),
            })
            .collect(),
    };
    if shards {
        for i in 1..=2 {
            m.shards.push(ShardRecord {
                name: format!("model-0000{i}-of-00002.safetensors"),
                size: 1000 * i,
                sha256: sha256_hex(&[i as u8]),
            });
        }
    }
    m.seal();
    m
}

fn main() {
    let out = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "fuzz/corpus".into()),
    );
    let small = |layers, experts, mixtral, source| Shape {
        layers,
        experts,
        hidden: 4,
        inter: 2,
        tensors: vec![
            ("model.embed_tokens.weight", Dtype::BF16, vec![8, 4]),
            ("model.norm.weight", Dtype::F32, vec![4]),
            ("lm_head.weight", Dtype::F16, vec![8, 4]),
            (
                "model.layers.0.mlp.gate.weight",
                Dtype::F64,
                vec![experts as u64, 4],
            ),
        ],
        mixtral,
        source,
    };
    let shapes = [
        // No data at all: the smallest valid file is one page.
        Shape {
            layers: 0,
            experts: 0,
            hidden: 0,
            inter: 0,
            tensors: vec![],
            mixtral: false,
            source: false,
        },
        // Zero-length tensors: every region starts at data_start, the file is one page.
        Shape {
            layers: 0,
            experts: 0,
            hidden: 0,
            inter: 0,
            tensors: vec![
                ("a", Dtype::BF16, vec![0]),
                ("b", Dtype::F32, vec![3, 0]),
                ("c", Dtype::F64, vec![]),
            ],
            mixtral: false,
            source: true,
        },
        small(1, 1, false, false),
        small(1, 2, false, true),
        small(2, 2, true, true),
        small(2, 3, false, false),
    ];
    let dirs = [
        "jnf_header",
        "jnf_header_json",
        "manifest",
        "jnf_v2_extents",
    ]
    .map(|d| out.join(d));
    for d in &dirs {
        fs::create_dir_all(d).expect("create corpus dir");
    }
    let write = |dir: &Path, i: usize, bytes: &[u8]| {
        fs::write(dir.join(format!("seed-{i}")), bytes).expect("write seed");
    };
    for (i, s) in shapes.iter().enumerate() {
        let h = plan(s);
        let f = file(&h);
        assert_eq!(Header::parse(&f, f.len() as u64).as_ref(), Ok(&h));
        // Big files slow every execution down; the JSON target covers large layouts.
        if f.len() <= 64 * 1024 {
            write(&dirs[0], i, &f);
        }
        write(&dirs[1], i, &header_json(&h));
        let m = manifest(&h, &f, s.source);
        let text = m.to_toml();
        assert_eq!(Manifest::parse(&text).as_ref(), Ok(&m));
        write(&dirs[2], i, text.as_bytes());
    }

    // Format version 2: a layer of two encoded experts and a raw one (3 x [32, 64] BF16).
    let mut v2 = small(1, 3, false, true);
    (v2.hidden, v2.inter) = (64, 32);
    let (h, f, decoded) = encoded(&plan(&v2));
    assert_eq!(Header::parse(&f, f.len() as u64).as_ref(), Ok(&h));
    let n = shapes.len();
    write(&dirs[0], n, &f);
    write(&dirs[1], n, &header_json(&h));
    let m = manifest_of(&h, &f, true, Some(&decoded));
    let text = m.to_toml();
    assert_eq!(Manifest::parse(&text).as_ref(), Ok(&m));
    write(&dirs[2], n, text.as_bytes());
    // jnf_v2_extents: the whole file (selector 0); and lone extents (selector 3: encoded, 1:
    // raw), each a decoded length and its stored bytes
    write(&dirs[3], 0, &[&[0u8][..], &f].concat());
    for (i, e) in h.experts.iter().enumerate() {
        let sel: u8 = if e.is_encoded() { 3 } else { 1 };
        let stored = &f[e.offset as usize..][..e.stored_length as usize];
        let len = (e.length as u32).to_le_bytes();
        write(&dirs[3], 1 + i, &[&[sel][..], &len, stored].concat());
    }
    println!("seeds written under {}", out.display());
}
