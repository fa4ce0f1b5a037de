//! The JNF header's JSON and every layout rule behind it, without the cost of a real file: the
//! input is an 8-byte little-endian file size followed by the header JSON, which is wrapped in a
//! valid preamble. `Header::parse` reads only the header bytes, so a claimed file size of
//! terabytes costs nothing and the validator's bounds arithmetic is reached directly.
#![no_main]

use jnf_format::{Header, MAGIC};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 {
        return;
    }
    let file_size = u64::from_le_bytes(data[..8].try_into().unwrap());
    let json = &data[8..];
    let mut buf = Vec::with_capacity(24 + json.len());
    buf.extend_from_slice(&MAGIC);
    buf.extend_from_slice(&1u16.to_le_bytes());
    buf.extend_from_slice(&0u16.to_le_bytes());
    buf.extend_from_slice(&0u32.to_le_bytes());
    buf.extend_from_slice(&(json.len() as u64).to_le_bytes());
    buf.extend_from_slice(json);
    if let Ok(h) = Header::parse(&buf, file_size) {
        assert_eq!(h.file_size, file_size);
        // Every accepted region lies inside the file.
        for t in &h.tensors {
            assert!(t.offset >= h.data_start && t.offset + t.length <= file_size);
        }
        for e in &h.experts {
            assert!(e.offset >= h.data_start && e.offset + e.padded_length <= file_size);
        }
        h.validate(file_size)
            .expect("an accepted header validates again");
    }
});
