//! Stop strings over incrementally decoded text: a run ends where the generated text first
//! contains one of them, and the text up to it (the stop string excluded, as OpenAI's and vLLM's
//! `stop` do) is all that is ever released. Text that could still be the start of a stop string
//! is held back until the next piece decides it.
//!
//! This module only looks at text; it never changes which tokens are chosen.

/// The stop strings of one request and the generated text not yet released.
#[derive(Clone, Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    /// Decoded but unreleased: a suffix that may begin a stop string.
    pending: String,
    /// The stop string that ended the text, once one has.
    matched: Option<usize>,
}

impl StopStrings {
    /// Empty strings are ignored (they would stop every run before its first token).
    pub fn new(stops: &[String]) -> StopStrings {
        StopStrings {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
            matched: None,
        }
    }

    /// Takes the next piece of decoded text; returns what may be released now. After a stop
    /// string matched, [`StopStrings::stopped`] is true and nothing more is ever released.
    pub fn push(&mut self, piece: &str) -> String {
        if self.matched.is_some() {
            return String::new();
        }
        self.pending.push_str(piece);
        // The earliest match in the text wins; among stop strings matching at the same place,
        // the first given.
        let first = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.pending.find(s.as_str()).map(|at| (at, i)))
            .min();
        if let Some((at, i)) = first {
            self.matched = Some(i);
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return out;
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let mut keep_from = self.pending.len();
        for (at, _) in self.pending.char_indices() {
            let tail = &self.pending[at..];
            if self.stops.iter().any(|s| s.starts_with(tail)) {
                keep_from = at;
                break;
            }
        }
        let out = self.pending[..keep_from].to_string();
        self.pending.drain(..keep_from);
        out
    }

    /// Whether a stop string has matched.
    pub fn stopped(&self) -> bool {
        self.matched.is_some()
    }

    /// The stop string that matched.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    /// At the end of a run that no stop string ended: the text held back.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<String>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut s = StopStrings::new(&stops);
        let mut out = String::new();
        for p in pieces {
            out.push_str(&s.push(p));
            if s.stopped() {
                return (out, s.matched().map(str::to_string));
            }
        }
        out.push_str(&s.finish());
        (out, None)
    }

    #[test]
    fn a_stop_string_split_over_pieces_ends_the_text_before_it() {
        assert_eq!(
            run(&["\n\n"], &["def f():", "\n", "\n", "more"]),
            ("def f():".into(), Some("\n\n".into()))
        );
        assert_eq!(
            run(&["END"], &["abE", "N", "Dxyz"]),
            ("ab".into(), Some("END".into()))
        );
    }

    #[test]
    fn a_false_start_is_released_once_decided() {
        let stops = vec!["END".to_string()];
        let mut s = StopStrings::new(&stops);
        assert_eq!(s.push("abE"), "ab");
        assert_eq!(s.push("Nx"), "ENx");
        assert!(!s.stopped());
        assert_eq!(s.push("E"), "");
        assert_eq!(s.finish(), "E");
    }

    #[test]
    fn the_earliest_match_wins_and_multibyte_text_is_cut_on_characters() {
        assert_eq!(
            run(&["world", "lo"], &["hello world"]),
            ("hel".into(), Some("lo".into()))
        );
        assert_eq!(
            run(&["東京"], &["naïve 東", "京 x"]),
            ("naïve ".into(), Some("東京".into()))
        );
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), None));
        assert_eq!(
            run(&[""], &["a"]),
            ("a".into(), None),
            "empty stops are ignored"
        );
    }
}
