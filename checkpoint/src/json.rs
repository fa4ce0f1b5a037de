//! Duplicate-key detection for JSON documents.
//!
//! `serde_json` (like Python's `json`) keeps the last of two equal keys in an object, silently.
//! Two readers that pick different duplicates see different checkpoints, so every JSON document
//! this crate reads is first walked once by [`first_duplicate_key`], which refuses any object,
//! at any depth, that names a key twice.

use std::cell::RefCell;
use std::collections::HashSet;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

/// Where a repeated key was found: the keys (and `[i]` array indices) leading to the object that
/// repeats it, then the key itself. `path[0]` is a key of the top-level object.
pub(crate) type KeyPath = Vec<String>;

/// Walks `text` and returns the path of the first repeated key, `Ok(None)` when every object's
/// keys are distinct, or the parse error when `text` is not JSON (serde_json's recursion limit
/// applies, so hostile nesting is an error, not a stack overflow).
pub(crate) fn first_duplicate_key(text: &str) -> Result<Option<KeyPath>, serde_json::Error> {
    let state = Walk {
        path: RefCell::new(Vec::new()),
        found: RefCell::new(None),
    };
    let mut de = serde_json::Deserializer::from_str(text);
    let walked = (&state).deserialize(&mut de).and_then(|()| de.end());
    if let Some(path) = state.found.into_inner() {
        return Ok(Some(path));
    }
    walked.map(|()| None)
}

/// Renders a key path for an error message, e.g. `weight_map."a.b"` or `[3].x`.
pub(crate) fn render_path(path: &[String]) -> String {
    let mut out = String::new();
    for part in path {
        if part.starts_with('[') {
            out.push_str(part);
        } else {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(&format!("{part:?}"));
        }
    }
    out
}

struct Walk {
    path: RefCell<Vec<String>>,
    found: RefCell<Option<KeyPath>>,
}

impl<'de> DeserializeSeed<'de> for &Walk {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for &Walk {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    // serde_json with `arbitrary_precision` (another crate in the build may turn it on) hands
    // numbers over as a one-entry map; that map's key cannot repeat, so the walk stays correct.

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut i = 0usize;
        loop {
            self.path.borrow_mut().push(format!("[{i}]"));
            let next = seq.next_element_seed(self);
            self.path.borrow_mut().pop();
            if next?.is_none() {
                return Ok(());
            }
            i += 1;
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                let mut path = self.path.borrow().clone();
                path.push(key);
                *self.found.borrow_mut() = Some(path);
                return Err(de::Error::custom("duplicate key"));
            }
            self.path.borrow_mut().push(key);
            let value = map.next_value_seed(self);
            self.path.borrow_mut().pop();
            value?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_keys_pass() {
        assert_eq!(
            first_duplicate_key(r#"{"a":1,"b":{"a":2},"c":[{"a":1},{"a":2}]}"#).unwrap(),
            None
        );
    }

    #[test]
    fn top_level_duplicate() {
        let p = first_duplicate_key(r#"{"a":1,"b":2,"a":1}"#)
            .unwrap()
            .unwrap();
        assert_eq!(p, vec!["a".to_string()]);
    }

    #[test]
    fn nested_duplicate_in_array() {
        let p = first_duplicate_key(r#"{"x":[{"k":1},{"k":1,"k":2}]}"#)
            .unwrap()
            .unwrap();
        assert_eq!(p, vec!["x".to_string(), "[1]".to_string(), "k".to_string()]);
        assert_eq!(render_path(&p), r#""x"[1]."k""#);
    }

    #[test]
    fn escaped_keys_compare_after_unescaping() {
        let p = first_duplicate_key(r#"{"a":1,"\u0061":2}"#)
            .unwrap()
            .unwrap();
        assert_eq!(p, vec!["a".to_string()]);
    }

    #[test]
    fn syntax_errors_are_errors() {
        assert!(first_duplicate_key(r#"{"a":1"#).is_err());
        assert!(first_duplicate_key(r#"{"a":1} x"#).is_err());
        assert!(first_duplicate_key(&"[".repeat(100_000)).is_err());
    }
}
