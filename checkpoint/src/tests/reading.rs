//! Reading tensors after open: bytes, offsets, maps, hashes, and files changed underneath.

use std::io::Write;
use std::path::Path;

use super::*;
use crate::{CheckpointError as E, ExpertMatrix::*};

#[test]
fn bytes_offsets_and_maps_agree() {
    for t in [Tiny::qwen3(), Tiny::mixtral().single()] {
        let c = opens(&t.write());
        let mut buf = Vec::new();
        for spec in &t.tensors {
            let expected = content(&spec.name, byte_len(&spec.dtype, &spec.shape));
            assert_eq!(
                c.read_tensor_bytes(&spec.name).unwrap(),
                expected,
                "{}",
                spec.name
            );
            c.read_tensor_into(&spec.name, &mut buf).unwrap();
            assert_eq!(buf, expected);
            let st = &c.tensors[&spec.name];
            assert_eq!(st.len as usize, expected.len());
            assert_eq!(st.shape, spec.shape);
            let map = c.map_shard(st.shard).unwrap();
            assert_eq!(map.tensor(st).unwrap(), &expected[..]);
            assert_eq!(map.bytes().len() as u64, c.shards[st.shard].size);
            let other = (st.shard + 1) % c.shards.len();
            if other != st.shard {
                assert!(c.map_shard(other).unwrap().tensor(st).is_none());
            }
        }
    }
}

#[test]
fn shard_offsets_match_the_safetensors_crate() {
    let c = opens(&Tiny::qwen2().write());
    for (i, shard) in c.shards.iter().enumerate() {
        let bytes = std::fs::read(&shard.path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in st.tensors() {
            let t = &c.tensors[&name];
            assert_eq!(t.shard, i);
            assert_eq!(
                &bytes[t.offset as usize..(t.offset + t.len) as usize],
                view.data()
            );
            assert_eq!(t.dtype, view.dtype());
        }
    }
}

#[test]
fn unknown_tensor() {
    let c = opens(&Tiny::qwen3().write());
    let e = c.read_tensor_bytes("model.layers.9.nope").unwrap_err();
    check_message(&e);
    assert_variant!(e, E::UnknownTensor { .. });
    assert_variant!(
        c.map_shard(99).unwrap_err(),
        E::UnknownShard { shard: 99, .. }
    );
}

#[test]
fn shard_changed_after_open() {
    let t = Tiny::qwen3();
    let dir = t.write();
    let c = opens(&dir);
    let name = qwen_expert(0, 0, Gate);
    let file = t.file_of(&name);
    std::fs::OpenOptions::new()
        .append(true)
        .open(dir.join(&file))
        .unwrap()
        .write_all(b"junk")
        .unwrap();
    let e = c.read_tensor_bytes(&name).unwrap_err();
    check_message(&e);
    assert_variant!(e, E::ShardChanged { file: ref f, .. } if f == Path::new(&file));
    let shard = c.tensors[&name].shard;
    assert_variant!(c.map_shard(shard).unwrap_err(), E::ShardChanged { .. });
    assert_variant!(c.shard_sha256s().unwrap_err(), E::ShardChanged { .. });
}

#[test]
fn reads_go_to_the_validated_file_even_if_the_name_is_replaced() {
    let t = Tiny::qwen3().single();
    let dir = t.write();
    let c = opens(&dir);
    // Replace the name with a different file of the same size: the open handle still reads the old one.
    let mut other = t.clone();
    other
        .tensors
        .iter_mut()
        .for_each(|s| s.name = s.name.replace("model.", "mODEL."));
    let replacement = safetensors_bytes(&other.tensors);
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), replacement).unwrap();
    let name = qwen_expert(1, 1, Up);
    assert_eq!(
        c.read_tensor_bytes(&name).unwrap(),
        content(&name, (INTER * HIDDEN * 2) as usize)
    );
}

#[test]
fn shard_hashes() {
    let c = opens(&Tiny::qwen3().write());
    let hashes = c.shard_sha256s().unwrap();
    let paths: Vec<_> = c.shards.iter().map(|s| s.path.clone()).collect();
    let direct = crate::sha256_files_parallel(&paths);
    for (h, d) in hashes.iter().zip(direct) {
        assert_eq!(*h, d.unwrap());
    }
}
