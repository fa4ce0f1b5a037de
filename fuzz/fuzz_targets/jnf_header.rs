//! The JNF header parser on arbitrary bytes taken as a whole file. It must return `Ok` or a
//! `JnfError`, never panic, and what it accepts must survive re-encoding.
#![no_main]

use jnf_format::{Header, PREAMBLE_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(h) = Header::parse(data, data.len() as u64) else {
        return;
    };
    // A re-encoded header that lands on the same data_start must parse back to the same header.
    // Re-encoding may not fit before data_start (then it is an error, never a truncation).
    let Ok(enc) = h.encode() else {
        return;
    };
    let len = u64::from_le_bytes(enc[16..24].try_into().unwrap());
    if jnf_format::align_up(PREAMBLE_LEN + len) == Some(h.data_start) {
        let mut file = enc;
        file.extend_from_slice(&data[h.data_start as usize..]);
        let again = Header::parse(&file, file.len() as u64).expect("a re-encoded header parses");
        assert_eq!(again, h);
    }
});
