//! Kernel-mapping regular expressions with Go's (RE2) meaning, on Rust's `regex` engine.
//!
//! The two engines share RE2's syntax; the differences that matter for specs written for
//! upstream KMM are that Go's Perl classes are ASCII-only (`\d` is `[0-9]`, Rust's is
//! Unicode) and that Go's character classes do not nest (a `[` inside a class is literal,
//! and so are `&&`, `--` and `~~`). Patterns are rewritten to Go's meaning before compiling.

use regex::{Regex, RegexBuilder};

/// Upper bound on the compiled size of one mapping's regexp: mappings come from users.
const SIZE_LIMIT: usize = 1 << 20;

/// Compiles `pattern` with Go's semantics; the error text is the engine's own.
pub fn compile(pattern: &str) -> Result<Regex, regex::Error> {
    RegexBuilder::new(&translate(pattern))
        .size_limit(SIZE_LIMIT)
        .build()
}

/// The Rust spelling of a Perl class escape, outside a bracket expression.
fn perl_class(c: char) -> Option<&'static str> {
    Some(match c {
        'd' => "[0-9]",
        'D' => "[^0-9]",
        'w' => "[0-9A-Za-z_]",
        'W' => "[^0-9A-Za-z_]",
        's' => r"[\t\n\x0C\r ]",
        'S' => r"[^\t\n\x0C\r ]",
        'b' => r"(?-u:\b)",
        'B' => r"(?-u:\B)",
        _ => return None,
    })
}

/// The Rust spelling of a Perl class escape inside a bracket expression. Rust classes nest,
/// so a negated class becomes a nested negated class, which unions like Go's.
fn perl_class_in_brackets(c: char) -> Option<&'static str> {
    Some(match c {
        'd' => "0-9",
        'D' => "[^0-9]",
        'w' => "0-9A-Za-z_",
        'W' => "[^0-9A-Za-z_]",
        's' => r"\t\n\x0C\r ",
        'S' => r"[^\t\n\x0C\r ]",
        _ => return None,
    })
}

fn translate(pattern: &str) -> String {
    let mut out = String::with_capacity(pattern.len() + 16);
    let mut chars = pattern.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(e) => match perl_class(e) {
                    Some(rust) => out.push_str(rust),
                    None => {
                        out.push('\\');
                        out.push(e);
                    }
                },
                None => out.push('\\'),
            },
            '[' => {
                out.push('[');
                translate_class(&mut chars, &mut out);
            }
            _ => out.push(c),
        }
    }
    out
}

/// Copies one bracket expression (after its `[`) up to and including its `]`.
fn translate_class(chars: &mut std::iter::Peekable<std::str::Chars<'_>>, out: &mut String) {
    if chars.peek() == Some(&'^') {
        out.push('^');
        chars.next();
    }
    // A `]` first in the class is a literal, in both dialects.
    if chars.peek() == Some(&']') {
        out.push_str(r"\]");
        chars.next();
    }
    let mut previous = None;
    while let Some(c) = chars.next() {
        match c {
            ']' => {
                out.push(']');
                return;
            }
            '\\' => match chars.next() {
                Some(e) => match perl_class_in_brackets(e) {
                    Some(rust) => out.push_str(rust),
                    None => {
                        out.push('\\');
                        out.push(e);
                    }
                },
                None => out.push('\\'),
            },
            '[' if chars.peek() == Some(&':') => {
                // POSIX class `[:alpha:]`: same meaning in both dialects.
                out.push('[');
                for p in chars.by_ref() {
                    out.push(p);
                    if p == ']' {
                        break;
                    }
                }
            }
            '[' => out.push_str(r"\["),
            '&' | '~' if previous == Some(c) => {
                out.push('\\');
                out.push(c);
            }
            '-' if previous == Some('-') => out.push_str(r"\-"),
            _ => out.push(c),
        }
        previous = Some(c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matches(pattern: &str, text: &str) -> bool {
        compile(pattern).expect("compiles").is_match(text)
    }

    #[test]
    fn perl_classes_are_ascii_like_go() {
        assert!(matches(r"^\d+$", "123"));
        assert!(
            !matches(r"^\d+$", "١٢٣"),
            "Arabic-Indic digits are not \\d in Go"
        );
        assert!(!matches(r"^\w+$", "é"));
        assert!(matches(r"^\W$", "é"));
        assert!(!matches(r"^\s$", "\u{a0}"));
        assert!(!matches(r"^\s$", "\u{b}"), "Go's \\s excludes vertical tab");
        assert!(matches(r"\bel9\b", "5.14.0-1.el9.x86_64"));
        assert!(
            matches(r"a\bé", "aé"),
            "é is not a word character for Go's \\b"
        );
    }

    #[test]
    fn perl_classes_inside_brackets() {
        assert!(matches(r"^[\d.]+$", "6.1.0"));
        assert!(!matches(r"^[\d.]+$", "٣"));
        assert!(matches(r"^[^\d]+$", "abc"));
        assert!(matches(r"^[a\D]$", "x"));
        assert!(!matches(r"^[a\D]$", "5"));
    }

    #[test]
    fn classes_do_not_nest_like_go() {
        assert!(matches(r"^[[]$", "["));
        assert!(matches(r"^[]a]+$", "]a"));
        assert!(matches(r"^[a&&b]+$", "&ab"));
        assert!(matches(r"^[+--]+$", "+,-"), "a Go range from + to -");
        assert!(matches(r"^[[:digit:]]+$", "42"));
    }

    #[test]
    fn unanchored_like_go() {
        assert!(matches(r"el8", "4.18.0-348.el8.x86_64"));
        assert!(matches(r"^.+\-gke$", "5.4.0-1054-gke"));
    }

    #[test]
    fn invalid_patterns_fail() {
        assert!(compile("(").is_err());
        assert!(compile("[a-").is_err());
    }
}
