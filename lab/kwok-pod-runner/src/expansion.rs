//! `$(VAR)` references in environment values, commands and arguments, expanded by the
//! kubelet's rules (its fork of Go's `os.Expand`, `third_party/forked/golang/expansion`):
//! `$$` is a literal `$` (so `$$(X)` stays `$(X)`), a reference to an unknown variable
//! and an unterminated `$(` are left as written, and a `$` before anything else is kept.
//! Pure.

/// `input` with each `$(NAME)` replaced by `lookup(NAME)` where that is known.
pub(super) fn expand<'a>(input: &str, lookup: impl Fn(&str) -> Option<&'a str>) -> String {
    let mut out = String::with_capacity(input.len());
    let mut rest = input;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let mut chars = after.chars();
        match chars.next() {
            // A trailing `$` is kept as is.
            None => {
                out.push('$');
                rest = after;
            }
            Some('$') => {
                out.push('$');
                rest = chars.as_str();
            }
            Some('(') => match after[1..].find(')') {
                Some(close) => {
                    let name = &after[1..1 + close];
                    match lookup(name) {
                        Some(value) => out.push_str(value),
                        None => {
                            out.push_str("$(");
                            out.push_str(name);
                            out.push(')');
                        }
                    }
                    rest = &after[close + 2..];
                }
                // Unterminated: `$(` is kept and scanning resumes right after it, so a
                // complete reference further on is still expanded.
                None => {
                    out.push_str("$(");
                    rest = &after[1..];
                }
            },
            Some(other) => {
                out.push('$');
                out.push(other);
                rest = chars.as_str();
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn vars() -> BTreeMap<&'static str, &'static str> {
        BTreeMap::from([
            ("POD_IP", "10.101.0.7"),
            ("NODE", "kwok-1"),
            ("EMPTY", ""),
            ("DOLLAR", "$(POD_IP)"),
        ])
    }

    fn expanded(input: &str) -> String {
        let vars = vars();
        expand(input, |name| vars.get(name).copied())
    }

    #[test]
    fn known_references_are_replaced() {
        assert_eq!(expanded("$(POD_IP)"), "10.101.0.7");
        assert_eq!(
            expanded("--addr=$(POD_IP):8080 --node=$(NODE)"),
            "--addr=10.101.0.7:8080 --node=kwok-1"
        );
        assert_eq!(expanded("$(POD_IP)$(NODE)"), "10.101.0.7kwok-1");
        assert_eq!(expanded("a$(EMPTY)b"), "ab");
    }

    #[test]
    fn values_are_not_expanded_again() {
        assert_eq!(expanded("$(DOLLAR)"), "$(POD_IP)");
    }

    #[test]
    fn unknown_references_stay_as_written() {
        assert_eq!(expanded("$(UNKNOWN)"), "$(UNKNOWN)");
        assert_eq!(expanded("x$(UNKNOWN)y$(NODE)"), "x$(UNKNOWN)ykwok-1");
        assert_eq!(expanded("$()"), "$()");
    }

    #[test]
    fn double_dollar_escapes() {
        assert_eq!(expanded("$$(POD_IP)"), "$(POD_IP)");
        assert_eq!(expanded("$$$(POD_IP)"), "$10.101.0.7");
        assert_eq!(expanded("$$$$(POD_IP)"), "$$(POD_IP)");
        assert_eq!(expanded("cost: $$5"), "cost: $5");
        assert_eq!(expanded("$$"), "$");
    }

    #[test]
    fn other_dollars_are_kept() {
        assert_eq!(expanded("$HOME"), "$HOME");
        assert_eq!(expanded("${NODE}"), "${NODE}");
        assert_eq!(expanded("end$"), "end$");
        assert_eq!(expanded("$"), "$");
        assert_eq!(expanded("$é$(NODE)"), "$ékwok-1");
    }

    #[test]
    fn unterminated_references_are_kept_and_scanning_goes_on() {
        assert_eq!(expanded("$(POD_IP"), "$(POD_IP");
        assert_eq!(expanded("$("), "$(");
        assert_eq!(expanded("$(a $(NODE)"), "$(a $(NODE)");
        // The kubelet reads up to the first `)`: the name here is `a $(NODE`.
        assert_eq!(expanded("$(a $(NODE))"), "$(a $(NODE))");
        assert_eq!(expanded("$(x$(NODE)"), "$(x$(NODE)");
    }

    #[test]
    fn plain_text_is_untouched() {
        assert_eq!(expanded(""), "");
        assert_eq!(expanded("plain (text)"), "plain (text)");
        assert_eq!(expanded("ünïcode"), "ünïcode");
    }
}
