//! Byte sizes on the command line (`--ram-budget 512M`) and in messages.
//!
//! K, M and G mean 2^10, 2^20 and 2^30 (as memory is sold and as `free -h` prints), and a bare
//! number is bytes. Decimal units (KB, MB) are refused rather than guessed at: a budget off by
//! 5% is the difference between fitting and not.

use super::StreamError;

/// Parses `4096`, `64K`, `512M`, `2G` (suffix case-insensitive, `KiB`/`MiB`/`GiB` accepted).
pub fn parse_size(text: &str) -> Result<u64, StreamError> {
    let bad = |why| StreamError::BadSize {
        text: text.to_string(),
        why,
    };
    let t = text.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits_end);
    if num.is_empty() {
        return Err(bad("no number"));
    }
    let n: u64 = num.parse().map_err(|_| bad("the number is too large"))?;
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        "t" | "tib" => 40,
        "kb" | "mb" | "gb" | "tb" => return Err(bad("decimal units are ambiguous; use K, M or G")),
        _ => return Err(bad("unknown unit")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| bad("the size is too large"))
}

/// `123456789` -> `117.7 MiB`.
pub fn format_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_as_powers_of_two() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("0").unwrap(), 0);
        assert_eq!(parse_size("64K").unwrap(), 65536);
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("512m").unwrap(), 512 << 20);
        assert_eq!(parse_size("3G").unwrap(), 3 << 30);
        assert_eq!(parse_size("3GiB").unwrap(), 3 << 30);
        assert_eq!(parse_size(" 7 ").unwrap(), 7);
        for bad in [
            "",
            "M",
            "1.5G",
            "-1",
            "12X",
            "5MB",
            "99999999999999999999",
            "17179869184G",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
        let e = parse_size("5MB").unwrap_err();
        assert_eq!(e.exit_code(), 2);
    }

    #[test]
    fn bytes_format_in_binary_units() {
        assert_eq!(format_bytes(17), "17 B");
        assert_eq!(format_bytes(1536), "1.5 KiB");
        assert_eq!(format_bytes(512 << 20), "512.0 MiB");
        assert_eq!(format_bytes(3 << 30), "3.0 GiB");
    }
}
