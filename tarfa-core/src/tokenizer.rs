//! Whether a `tokenizer.json` can serve a model: it must load with the `tokenizers` crate (as
//! `tarfa-run generate --prompt` loads it) and every id it can produce must be inside the
//! model's vocabulary, or a prompt could be encoded into ids the embedding has no row for.

/// A tokenizer that cannot serve the model. Messages leave the file's name to the caller, who
/// knows where the bytes came from.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TokenizerError {
    /// The bytes are not a tokenizer the `tokenizers` crate can load.
    #[error("does not load as a tokenizer: {0}")]
    Unloadable(String),
    /// The tokenizer has an id at or beyond the model's `vocab_size`.
    #[error("has token id {max_id} ({token:?}), outside the model's vocab_size {vocab_size}")]
    VocabTooLarge {
        max_id: u32,
        token: String,
        vocab_size: usize,
    },
}

/// Loads `bytes` as a tokenizer and checks that its ids fit `vocab_size`.
pub fn check_tokenizer(
    bytes: &[u8],
    vocab_size: usize,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let tok = tokenizers::Tokenizer::from_bytes(bytes)
        // The crate's messages can span lines; the first says what failed.
        .map_err(|e| {
            let msg = e.to_string();
            TokenizerError::Unloadable(msg.lines().next().unwrap_or("").to_string())
        })?;
    let highest = tok.get_vocab(true).into_iter().max_by_key(|(_, id)| *id);
    if let Some((token, max_id)) = highest {
        if max_id as usize >= vocab_size {
            return Err(TokenizerError::VocabTooLarge {
                max_id,
                token,
                vocab_size,
            });
        }
    }
    Ok(tok)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> Vec<u8> {
        let p = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../fixtures/oracle/qwen3moe-code/tokenizer.json"
        );
        std::fs::read(p).unwrap()
    }

    #[test]
    fn the_fixture_tokenizer_fits_its_model() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../fixtures/oracle/qwen3moe-code/config.json"
        ))
        .unwrap();
        let cfg = crate::config::MoeConfig::from_json_str(&text).unwrap();
        let tok = check_tokenizer(&fixture(), cfg.vocab_size).unwrap();
        assert!(tok.get_vocab_size(true) <= cfg.vocab_size);
    }

    #[test]
    fn a_tokenizer_larger_than_the_vocabulary_is_refused() {
        let tok = tokenizers::Tokenizer::from_bytes(fixture()).unwrap();
        let n = tok.get_vocab_size(true);
        assert!(matches!(
            check_tokenizer(&fixture(), n - 1),
            Err(TokenizerError::VocabTooLarge { vocab_size, .. }) if vocab_size == n - 1
        ));
    }

    #[test]
    fn garbage_is_refused_in_one_line() {
        for bytes in [&b"not json"[..], b"{}", b"{\"model\": 3}", &[0xff, 0xfe]] {
            let e = check_tokenizer(bytes, 100).unwrap_err();
            assert!(matches!(e, TokenizerError::Unloadable(_)), "{e:?}");
            assert!(!e.to_string().contains('\n'), "{e}");
        }
    }
}
