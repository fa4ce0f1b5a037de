//! The manifest parser on arbitrary UTF-8. What it accepts must check its root digest without
//! panicking, diff against itself as all unchanged, and survive a TOML round trip.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tarfa_manifest::{diff, Manifest};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(m) = Manifest::parse(text) else {
        return;
    };
    let _ = m.check_root();
    let _ = m.compute_root_digest();
    let d = diff(&m, &m);
    assert!(d.is_empty(), "a manifest differs from itself: {d:?}");
    assert_eq!(
        d.unchanged,
        m.files.len() + m.tensors.len() + m.experts.len()
    );
    let mut back = Manifest::parse(&m.to_toml()).expect("a manifest's own TOML parses");
    // The fuzzer's text need not be in the serialiser's form: the bytes after the root line,
    // and so their digest, can differ; every field must survive.
    back.computed_root = m.computed_root.clone();
    assert_eq!(back, m);
});
