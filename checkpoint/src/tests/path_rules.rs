//! Path safety: names from the index, symbolic links, the Hub cache layout, special files.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use serde_json::json;

use super::*;
use crate::hash::{git_blob_sha1_bytes, sha256_bytes, to_hex};
use crate::{CheckpointError as E, HubBlob, NameProblem, OpenOptions};

/// Points every tensor of shard 0 at `name` in the index.
fn rename_shard0_in_index(dir: &Path, t: &Tiny, name: &str) {
    let mut index = t.index();
    for v in index["weight_map"].as_object_mut().unwrap().values_mut() {
        if *v == json!(Tiny::shard_name(0, 3)) {
            *v = json!(name);
        }
    }
    std::fs::write(
        dir.join(crate::INDEX_FILE),
        serde_json::to_string(&index).unwrap(),
    )
    .unwrap();
}

#[test]
fn unsafe_shard_names() {
    let cases = [
        (
            "../model-00001-of-00003.safetensors",
            NameProblem::ParentDir,
        ),
        ("sub/../../x.safetensors", NameProblem::ParentDir),
        ("/etc/model.safetensors", NameProblem::Absolute),
        ("..\\model.safetensors", NameProblem::Backslash),
        ("model\0.safetensors", NameProblem::Nul),
        ("model\u{1b}[2J.safetensors", NameProblem::ControlChar),
        ("", NameProblem::Empty),
        ("./model-00001-of-00003.safetensors", NameProblem::NotNormal),
        ("sub//model.safetensors", NameProblem::NotNormal),
        ("config.json", NameProblem::NotSafetensors),
    ];
    let t = Tiny::qwen3();
    for (name, problem) in cases {
        let dir = t.write();
        rename_shard0_in_index(&dir, &t, name);
        let e = fails(&dir);
        assert_variant!(e, E::UnsafeName { name: ref n, problem: p, ref file } if n == name && p == problem && file == Path::new(crate::INDEX_FILE));
    }
}

#[test]
fn shard_in_a_subdirectory_is_fine() {
    let t = Tiny::qwen3();
    let dir = t.write();
    std::fs::create_dir(dir.join("sub")).unwrap();
    std::fs::rename(
        dir.join(Tiny::shard_name(0, 3)),
        dir.join("sub/first.safetensors"),
    )
    .unwrap();
    rename_shard0_in_index(&dir, &t, "sub/first.safetensors");
    let c = opens(&dir);
    assert_eq!(c.shards[2].name, "sub/first.safetensors");
}

#[test]
fn symlink_inside_the_directory_is_fine() {
    let t = Tiny::qwen3();
    let dir = t.write();
    std::fs::rename(dir.join(Tiny::shard_name(0, 3)), dir.join("real.bin")).unwrap();
    symlink("real.bin", dir.join(Tiny::shard_name(0, 3))).unwrap();
    let c = opens(&dir);
    assert_eq!(c.shards[0].path, c.root.join("real.bin"));
}

#[test]
fn symlink_out_of_the_directory() {
    let t = Tiny::qwen3();
    let outside = scratch_dir("outside");
    // A shard.
    let dir = t.write();
    let shard = Tiny::shard_name(1, 3);
    std::fs::rename(dir.join(&shard), outside.join("stolen.safetensors")).unwrap();
    symlink(outside.join("stolen.safetensors"), dir.join(&shard)).unwrap();
    let e = assert_variant!(fails(&dir), E::SymlinkEscape { .. });
    assert_eq!(e.file(), Path::new(&shard));
    // config.json, relative link.
    let dir = t.write();
    std::fs::write(
        outside.join("config.json"),
        serde_json::to_string(&t.config).unwrap(),
    )
    .unwrap();
    std::fs::remove_file(dir.join("config.json")).unwrap();
    symlink(
        Path::new("..")
            .join(outside.file_name().unwrap())
            .join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    assert_variant!(fails(&dir), E::SymlinkEscape { ref file, .. } if file == Path::new("config.json"));
    // A directory link on the way.
    let dir = t.write();
    symlink(&outside, dir.join("sub")).unwrap();
    std::fs::copy(
        dir.join(Tiny::shard_name(0, 3)),
        outside.join("x.safetensors"),
    )
    .unwrap();
    rename_shard0_in_index(&dir, &t, "sub/x.safetensors");
    assert_variant!(fails(&dir), E::SymlinkEscape { .. });
    // An extra file.
    let dir = t.write();
    symlink("/etc/hostname", dir.join("tokenizer.json")).unwrap();
    assert_variant!(fails(&dir), E::SymlinkEscape { ref file, .. } if file == Path::new("tokenizer.json"));
}

#[test]
fn symlink_loop_is_bad_input_not_an_io_error() {
    let dir = Tiny::qwen3().single().write();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    symlink("model.safetensors", dir.join("model.safetensors")).unwrap();
    assert_variant!(fails(&dir), E::SymlinkLoop { ref file } if file == Path::new("model.safetensors"));
    // config.json, through two links pointing at each other.
    let dir = Tiny::qwen3().write();
    std::fs::remove_file(dir.join("config.json")).unwrap();
    symlink("b.json", dir.join("config.json")).unwrap();
    symlink("config.json", dir.join("b.json")).unwrap();
    assert_variant!(fails(&dir), E::SymlinkLoop { ref file } if file == Path::new("config.json"));
}

#[test]
fn dangling_symlink_is_missing() {
    let t = Tiny::qwen3();
    let dir = t.write();
    std::fs::remove_file(dir.join(Tiny::shard_name(2, 3))).unwrap();
    symlink("nowhere.bin", dir.join(Tiny::shard_name(2, 3))).unwrap();
    assert_variant!(fails(&dir), E::IndexMissingShard { .. });
}

#[test]
fn not_a_regular_file() {
    let dir = Tiny::qwen3().single().write();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    std::fs::create_dir(dir.join("model.safetensors")).unwrap();
    assert_variant!(fails(&dir), E::NotAFile { .. });

    let dir = Tiny::qwen3().write();
    let shard = dir.join(Tiny::shard_name(0, 3));
    std::fs::remove_file(&shard).unwrap();
    let made = std::process::Command::new("mkfifo").arg(&shard).status();
    if made.is_ok_and(|s| s.success()) {
        // Opening a FIFO would block forever; it must be refused before that.
        assert_variant!(fails(&dir), E::NotAFile { .. });
    }

    let dir = Tiny::qwen3().write();
    std::fs::create_dir(dir.join("tokenizer.json")).unwrap();
    assert_variant!(fails(&dir), E::NotAFile { ref file } if file == Path::new("tokenizer.json"));
}

#[test]
fn source_dir_must_exist_and_be_a_directory() {
    let dir = scratch_dir("nodir");
    assert_variant!(fails(&dir.join("absent")), E::SourceDir { .. });
    std::fs::write(dir.join("file"), b"x").unwrap();
    assert_variant!(fails(&dir.join("file")), E::SourceDir { .. });
}

// ---- Hub cache layout ---------------------------------------------------------------------

struct Hub {
    repo: PathBuf,
    snapshot: PathBuf,
}

impl Hub {
    fn blob_of(&self, name: &str) -> PathBuf {
        std::fs::canonicalize(self.snapshot.join(name)).unwrap()
    }

    /// Overwrites a blob's content in place, keeping its name.
    fn corrupt(&self, name: &str, edit: impl FnOnce(&mut Vec<u8>)) {
        let blob = self.blob_of(name);
        let mut bytes = std::fs::read(&blob).unwrap();
        edit(&mut bytes);
        std::fs::write(&blob, bytes).unwrap();
    }
}

/// Lays `t` out as `huggingface-cli download` does: content in `blobs/<hash>`, and
/// `snapshots/<rev>/<name> -> ../../blobs/<hash>`. `.safetensors` files are LFS (SHA-256
/// names), the rest are plain git files (git blob SHA-1 names).
fn hubify(t: &Tiny, extras: &[(&str, &[u8])]) -> Hub {
    let staging = t.write();
    for (name, bytes) in extras {
        std::fs::write(staging.join(name), bytes).unwrap();
    }
    let repo = scratch_dir("hub").join("models--tarfa--tiny");
    let snapshot = repo.join("snapshots").join("0123abcd");
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(&snapshot).unwrap();
    for entry in std::fs::read_dir(&staging).unwrap() {
        let entry = entry.unwrap();
        let bytes = std::fs::read(entry.path()).unwrap();
        let name = entry.file_name().into_string().unwrap();
        let hash = if name.ends_with(".safetensors") {
            to_hex(&sha256_bytes(&bytes))
        } else {
            to_hex(&git_blob_sha1_bytes(&bytes))
        };
        std::fs::write(repo.join("blobs").join(&hash), &bytes).unwrap();
        symlink(format!("../../blobs/{hash}"), snapshot.join(&name)).unwrap();
    }
    Hub { repo, snapshot }
}

#[test]
fn hub_snapshot_opens_and_records_blobs() {
    let t = Tiny::qwen3();
    let hub = hubify(&t, &[("tokenizer.json", b"{\"model\":{}}")]);
    let c = opens(&hub.snapshot);
    for s in &c.shards {
        let expected = to_hex(&sha256_bytes(&std::fs::read(&s.path).unwrap()));
        assert_eq!(s.hub_blob, Some(HubBlob::Sha256(expected.clone())));
        assert_eq!(s.hub_blob_sha256(), Some(expected.as_str()));
        assert_eq!(s.sha256.map(|h| to_hex(&h)), Some(expected));
        assert!(s
            .path
            .starts_with(hub.repo.join("blobs").canonicalize().unwrap()));
    }
    assert!(matches!(
        c.extra_files[0].hub_blob,
        Some(HubBlob::GitSha1(_))
    ));
    assert_eq!(c.extra_files[1].name, "tokenizer.json");
    assert!(matches!(
        c.index.as_ref().unwrap().hub_blob,
        Some(HubBlob::GitSha1(_))
    ));
    let hashes = c.shard_sha256s().unwrap();
    for (s, h) in c.shards.iter().zip(hashes) {
        assert_eq!(crate::sha256_file(&s.path).unwrap(), h);
    }
    // The tensors still read correctly through the links.
    let name = qwen_expert(1, 2, crate::ExpertMatrix::Down);
    assert_eq!(
        c.read_tensor_bytes(&name).unwrap(),
        content(&name, (HIDDEN * INTER * 2) as usize)
    );
}

#[test]
fn hub_blob_content_mismatch() {
    let t = Tiny::qwen3();
    // A shard (SHA-256 name): flip one data byte.
    let hub = hubify(&t, &[]);
    let shard = Tiny::shard_name(1, 3);
    hub.corrupt(&shard, |b| *b.last_mut().unwrap() ^= 1);
    let e = assert_variant!(
        fails(&hub.snapshot),
        E::HubBlobMismatch {
            algorithm: "SHA-256",
            ..
        }
    );
    assert_eq!(e.file(), Path::new(&shard));
    // With verification off the names are still checked, the content is not, and hashing
    // the shards later catches it.
    let c = crate::open_with(
        &hub.snapshot,
        &OpenOptions {
            verify_hub_blobs: false,
        },
    )
    .unwrap();
    assert!(c.shards.iter().all(|s| s.sha256.is_none()));
    let e = c.shard_sha256s().unwrap_err();
    let e = assert_variant!(e, E::HubBlobMismatch { ref file, .. } if file == Path::new(&shard));
    check_message(&e);
    // config.json (git SHA-1 name).
    let hub = hubify(&t, &[]);
    hub.corrupt("config.json", |b| b.push(b' '));
    assert_variant!(fails(&hub.snapshot), E::HubBlobMismatch { algorithm: "git blob SHA-1", ref file, .. } if file == Path::new("config.json"));
    // An extra file.
    let hub = hubify(&t, &[("tokenizer.json", b"{}")]);
    hub.corrupt("tokenizer.json", |b| b[0] = b'[');
    assert_variant!(fails(&hub.snapshot), E::HubBlobMismatch { ref file, .. } if file == Path::new("tokenizer.json"));
}

#[test]
fn hub_blob_with_a_name_that_is_not_a_hash() {
    let t = Tiny::qwen3();
    let hub = hubify(&t, &[]);
    let link = hub.snapshot.join("config.json");
    let blob = hub.blob_of("config.json");
    std::fs::rename(&blob, hub.repo.join("blobs/config")).unwrap();
    std::fs::remove_file(&link).unwrap();
    symlink("../../blobs/config", &link).unwrap();
    assert_variant!(fails(&hub.snapshot), E::HubBlobBadName { ref blob, .. } if blob == "config");
}

#[test]
fn hub_links_elsewhere_are_escapes() {
    let t = Tiny::qwen3();
    // Into another repository's blobs.
    let hub = hubify(&t, &[]);
    let other = hubify(&t, &[]);
    let shard = Tiny::shard_name(0, 3);
    let target = other.blob_of(&shard);
    std::fs::remove_file(hub.snapshot.join(&shard)).unwrap();
    symlink(&target, hub.snapshot.join(&shard)).unwrap();
    assert_variant!(fails(&hub.snapshot), E::SymlinkEscape { .. });
    // Into a subfolder of blobs/.
    let hub = hubify(&t, &[]);
    let blob = hub.blob_of(&shard);
    let nested = hub.repo.join("blobs/sub");
    std::fs::create_dir(&nested).unwrap();
    std::fs::rename(&blob, nested.join(blob.file_name().unwrap())).unwrap();
    std::fs::remove_file(hub.snapshot.join(&shard)).unwrap();
    symlink(
        nested.join(blob.file_name().unwrap()),
        hub.snapshot.join(&shard),
    )
    .unwrap();
    assert_variant!(fails(&hub.snapshot), E::SymlinkEscape { .. });
    // The same links from a directory that is not under `snapshots/`.
    let hub = hubify(&t, &[]);
    let elsewhere = hub.repo.join("not-snapshots");
    std::fs::rename(hub.repo.join("snapshots"), &elsewhere).unwrap();
    assert_variant!(fails(&elsewhere.join("0123abcd")), E::SymlinkEscape { .. });
}

#[test]
fn a_fifo_as_config_is_refused_without_blocking() {
    let dir = Tiny::qwen3().write();
    std::fs::remove_file(dir.join("config.json")).unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(dir.join("config.json"))
        .status();
    if made.is_ok_and(|s| s.success()) {
        assert_variant!(fails(&dir), E::NotAFile { ref file } if file == Path::new("config.json"));
    }
}

#[test]
fn a_hub_repository_folder_names_the_snapshot_refs_main_points_to() {
    let t = Tiny::qwen3();
    let hub = hubify(&t, &[]);
    std::fs::create_dir_all(hub.repo.join("refs")).unwrap();
    std::fs::write(hub.repo.join("refs/main"), "0123abcd\n").unwrap();
    std::fs::create_dir(hub.repo.join("snapshots/ffff0000")).unwrap();
    let e = fails(&hub.repo);
    assert_variant!(&e, E::HubRepository { main: Some(m), snapshots, .. } if m == "0123abcd" && snapshots.len() == 2);
    let msg = e.to_string();
    assert!(
        msg.contains("snapshots/0123abcd (the snapshot refs/main points to)"),
        "{msg}"
    );
    assert!(msg.contains("other snapshots: [\"ffff0000\"]"), "{msg}");

    // refs/main naming no snapshot (or absent, or a FIFO): every snapshot is listed.
    std::fs::write(hub.repo.join("refs/main"), "deadbeef").unwrap();
    let e = fails(&hub.repo);
    assert_variant!(&e, E::HubRepository { main: None, .. });
    assert!(
        e.to_string()
            .contains("snapshots: [\"0123abcd\", \"ffff0000\"]"),
        "{e}"
    );
    std::fs::remove_file(hub.repo.join("refs/main")).unwrap();
    if std::process::Command::new("mkfifo")
        .arg(hub.repo.join("refs/main"))
        .status()
        .is_ok_and(|s| s.success())
    {
        assert_variant!(fails(&hub.repo), E::HubRepository { main: None, .. });
    }

    // A plain folder without config.json is still just that.
    let dir = Tiny::qwen3().write();
    std::fs::remove_file(dir.join("config.json")).unwrap();
    assert_variant!(fails(&dir), E::ConfigMissing { .. });
}
