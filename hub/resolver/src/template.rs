//! `$VAR` / `${VAR}` substitution, strict: an undefined variable is an error, never "".
//!
//! `$$` is a literal `$`. A `$` not followed by a name or `{` is kept as written, as in
//! upstream KMM's envsubst.

use std::collections::{BTreeMap, BTreeSet};

use thiserror::Error;

/// Why a template could not be expanded.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum TemplateError {
    /// The template references a variable that is not defined here.
    #[error("variable {name} is not defined")]
    Undefined {
        /// The variable's name.
        name: String,
    },
    /// `${` without its closing `}`.
    #[error("unterminated \"${{\" at byte {offset}")]
    Unterminated {
        /// Byte offset of the `$`.
        offset: usize,
    },
    /// `${...}` holding something other than a plain variable name.
    #[error(
        "\"${{{expression}}}\" is not a variable reference; only $NAME and ${{NAME}} are supported"
    )]
    Unsupported {
        /// What stood between the braces.
        expression: String,
    },
}

/// A piece of a parsed template.
#[derive(Debug, PartialEq, Eq)]
enum Piece<'a> {
    Text(&'a str),
    Variable(&'a str),
}

fn is_name_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || c == b'_'
}

fn is_name_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

fn parse(template: &str) -> Result<Vec<Piece<'_>>, TemplateError> {
    let bytes = template.as_bytes();
    let mut pieces = Vec::new();
    let mut text_start = 0;
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'$' {
            i += 1;
            continue;
        }
        let dollar = i;
        match bytes.get(i + 1) {
            Some(b'$') => {
                pieces.push(Piece::Text(&template[text_start..=dollar]));
                i += 2;
                text_start = i;
            }
            Some(b'{') => {
                let close = template[i + 2..]
                    .find('}')
                    .map(|n| i + 2 + n)
                    .ok_or(TemplateError::Unterminated { offset: dollar })?;
                let name = &template[i + 2..close];
                let valid = name.bytes().next().is_some_and(is_name_start)
                    && name.bytes().all(is_name_char);
                if !valid {
                    return Err(TemplateError::Unsupported {
                        expression: name.to_owned(),
                    });
                }
                pieces.push(Piece::Text(&template[text_start..dollar]));
                pieces.push(Piece::Variable(name));
                i = close + 1;
                text_start = i;
            }
            Some(&c) if is_name_start(c) => {
                let end = bytes[i + 1..]
                    .iter()
                    .position(|&c| !is_name_char(c))
                    .map_or(bytes.len(), |n| i + 1 + n);
                pieces.push(Piece::Text(&template[text_start..dollar]));
                pieces.push(Piece::Variable(&template[i + 1..end]));
                i = end;
                text_start = i;
            }
            _ => i += 1,
        }
    }
    pieces.push(Piece::Text(&template[text_start..]));
    pieces.retain(|p| *p != Piece::Text(""));
    Ok(pieces)
}

/// The names a template references, or why it cannot be parsed.
pub fn references(template: &str) -> Result<BTreeSet<String>, TemplateError> {
    Ok(parse(template)?
        .into_iter()
        .filter_map(|piece| match piece {
            Piece::Variable(name) => Some(name.to_owned()),
            Piece::Text(_) => None,
        })
        .collect())
}

/// Expands `template` with `variables`, recording every variable it used into `used`.
pub fn expand(
    template: &str,
    variables: &BTreeMap<&str, String>,
    used: &mut BTreeMap<String, String>,
) -> Result<String, TemplateError> {
    let mut out = String::with_capacity(template.len());
    for piece in parse(template)? {
        match piece {
            Piece::Text(text) => out.push_str(text),
            Piece::Variable(name) => {
                let value = variables
                    .get(name)
                    .ok_or_else(|| TemplateError::Undefined {
                        name: name.to_owned(),
                    })?;
                used.insert(name.to_owned(), value.clone());
                out.push_str(value);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand_with(
        template: &str,
        pairs: &[(&'static str, &str)],
    ) -> Result<String, TemplateError> {
        let vars: BTreeMap<&str, String> = pairs.iter().map(|(k, v)| (*k, v.to_string())).collect();
        expand(template, &vars, &mut BTreeMap::new())
    }

    #[test]
    fn both_forms_expand() {
        let pairs = [("A", "1"), ("AB", "2")];
        assert_eq!(expand_with("x-$A-${AB}-${A}B", &pairs).unwrap(), "x-1-2-1B");
    }

    #[test]
    fn bare_name_is_greedy_like_envsubst() {
        let err = expand_with("$AB_C", &[("AB", "x")]).unwrap_err();
        assert_eq!(
            err,
            TemplateError::Undefined {
                name: "AB_C".into()
            }
        );
    }

    #[test]
    fn dollar_escapes_and_literals() {
        assert_eq!(expand_with("a$$b", &[]).unwrap(), "a$b");
        assert_eq!(expand_with("$$A", &[("A", "x")]).unwrap(), "$A");
        assert_eq!(expand_with("cost: 5$", &[]).unwrap(), "cost: 5$");
        assert_eq!(expand_with("$1 $-", &[]).unwrap(), "$1 $-");
    }

    #[test]
    fn undefined_is_an_error_not_empty() {
        let err = expand_with("img:${NOPE}", &[]).unwrap_err();
        assert_eq!(err.to_string(), "variable NOPE is not defined");
    }

    #[test]
    fn malformed_braces_are_errors() {
        assert_eq!(
            expand_with("x${A", &[("A", "1")]).unwrap_err(),
            TemplateError::Unterminated { offset: 1 }
        );
        assert!(matches!(
            expand_with("${A:-b}", &[("A", "1")]).unwrap_err(),
            TemplateError::Unsupported { .. }
        ));
        assert!(matches!(
            expand_with("${}", &[]).unwrap_err(),
            TemplateError::Unsupported { .. }
        ));
    }

    #[test]
    fn used_variables_are_recorded() {
        let vars: BTreeMap<&str, String> = [("A", "1".to_string()), ("B", "2".to_string())].into();
        let mut used = BTreeMap::new();
        expand("${A}", &vars, &mut used).unwrap();
        assert_eq!(used, BTreeMap::from([("A".to_string(), "1".to_string())]));
    }

    #[test]
    fn references_lists_names() {
        let names = references("$A/${B}:$$C-${A}").unwrap();
        assert_eq!(names.into_iter().collect::<Vec<_>>(), ["A", "B"]);
    }
}
