//! A percentage as the API's int-or-string fields write it (`maxUnavailable`,
//! `maxConcurrency`, `maxFailures`): one reading for all of them.

/// The percentage `text` writes, e.g. `"25%"`: digits, without a leading zero (but `0%`),
/// then `%`. Signs, spaces and decimals are not percentages.
pub(crate) fn percent(text: &str) -> Option<u32> {
    let digits = text.strip_suffix('%')?;
    let plain = !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'));
    plain.then(|| digits.parse().ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::percent;

    #[test]
    fn only_plain_digits_followed_by_percent_are_a_percentage() {
        assert_eq!(percent("25%"), Some(25));
        assert_eq!(percent("0%"), Some(0));
        assert_eq!(percent("150%"), Some(150));
        for bad in ["", "%", "25", "05%", "-5%", "+5%", "2.5%", " 5%", "five%"] {
            assert_eq!(percent(bad), None, "{bad:?}");
        }
    }
}
