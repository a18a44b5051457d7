//! The one visible difference from a kubelet: a process sees the host's filesystem, not
//! a container's, so every volume mount's `mountPath` is rewritten to the directory
//! (or file) the runner materialised for it, wherever it appears in the command, the
//! arguments and the environment values. Only whole path prefixes are rewritten: a
//! `mountPath` must start the string or follow `=`, `:`, `,` or a space, and end it or
//! be followed by `/`; the longest `mountPath` wins. Pure.

use std::path::PathBuf;

/// A volume mount: where the container expects it and where it is on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Mount {
    /// `mountPath`, without a trailing `/`.
    pub container: String,
    pub host: PathBuf,
}

/// Characters after which a path may start: the start of a flag's value
/// (`--dir=/x`), of a list element (`PATH`-like `a:/x`, `a,/x`) or of a word.
const BEFORE: [char; 4] = ['=', ':', ',', ' '];

/// `text` with every mounted path rewritten to its host location.
pub(super) fn translate(text: &str, mounts: &[Mount]) -> String {
    let mut by_length: Vec<&Mount> = mounts.iter().collect();
    by_length.sort_by_key(|m| std::cmp::Reverse(m.container.len()));
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < text.len() {
        let at_boundary = i == 0 || text[..i].ends_with(BEFORE);
        let matched = at_boundary
            .then(|| {
                by_length.iter().find(|m| {
                    let rest = &text[i..];
                    rest.strip_prefix(m.container.as_str())
                        .is_some_and(|after| after.is_empty() || after.starts_with('/'))
                })
            })
            .flatten();
        match matched {
            Some(mount) => {
                out.push_str(&mount.host.to_string_lossy());
                i += mount.container.len();
            }
            None => {
                let c = text[i..].chars().next().unwrap_or_default();
                out.push(c);
                i += c.len_utf8();
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mounts() -> Vec<Mount> {
        [
            ("/var/lib/kmm", "/r/n1/host/var/lib/kmm"),
            ("/var/lib/kmm/cache", "/r/n1/pods/u/volumes/cache"),
            (
                "/var/run/secrets/kubernetes.io/serviceaccount",
                "/r/n1/pods/u/volumes/sa",
            ),
            ("/etc/kmm/token", "/r/n1/pods/u/volumes/token/token"),
            ("/run", "/r/n1/host/run"),
        ]
        .into_iter()
        .map(|(c, h)| Mount {
            container: c.into(),
            host: h.into(),
        })
        .collect()
    }

    fn t(text: &str) -> String {
        translate(text, &mounts())
    }

    #[test]
    fn whole_paths_and_paths_below_a_mount() {
        assert_eq!(t("/var/lib/kmm"), "/r/n1/host/var/lib/kmm");
        assert_eq!(t("/var/lib/kmm/state"), "/r/n1/host/var/lib/kmm/state");
        assert_eq!(t("/run"), "/r/n1/host/run");
        assert_eq!(t("/etc/kmm/token"), "/r/n1/pods/u/volumes/token/token");
        assert_eq!(
            t("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"),
            "/r/n1/pods/u/volumes/sa/ca.crt"
        );
    }

    #[test]
    fn the_longest_mount_path_wins() {
        assert_eq!(t("/var/lib/kmm/cache"), "/r/n1/pods/u/volumes/cache");
        assert_eq!(t("/var/lib/kmm/cache/x"), "/r/n1/pods/u/volumes/cache/x");
        assert_eq!(t("/var/lib/kmm/cached"), "/r/n1/host/var/lib/kmm/cached");
    }

    #[test]
    fn a_mount_path_must_end_the_text_or_be_followed_by_a_slash() {
        assert_eq!(t("/var/lib/kmmx"), "/var/lib/kmmx");
        assert_eq!(t("/runtime"), "/runtime");
        assert_eq!(t("/etc/kmm/tokens"), "/etc/kmm/tokens");
        // Nothing else ends it, not even what may start one.
        assert_eq!(t("/run /run:/run,/run=x"), "/run /run:/run,/run=x");
    }

    #[test]
    fn a_mount_path_must_start_a_value_word_or_list_element() {
        assert_eq!(
            t("--state-dir=/var/lib/kmm"),
            "--state-dir=/r/n1/host/var/lib/kmm"
        );
        assert_eq!(
            t("a:/run/x:/etc/kmm/token"),
            "a:/r/n1/host/run/x:/r/n1/pods/u/volumes/token/token"
        );
        assert_eq!(
            t("/run/,/var/lib/kmm/x"),
            "/r/n1/host/run/,/r/n1/host/var/lib/kmm/x"
        );
        assert_eq!(t("sh -c ls /run"), "sh -c ls /r/n1/host/run");
        // Inside another path, a URL, or quoted: left alone.
        assert_eq!(t("/opt/run"), "/opt/run");
        assert_eq!(t("unix:///run/x.sock"), "unix:///run/x.sock");
        assert_eq!(t("file:/run"), "file:/r/n1/host/run");
        assert_eq!(t("\"/run\""), "\"/run\"");
        assert_eq!(t("x/run"), "x/run");
    }

    #[test]
    fn every_occurrence_and_nothing_else() {
        assert_eq!(
            t("/run/ /run/a=/run"),
            "/r/n1/host/run/ /r/n1/host/run/a=/r/n1/host/run"
        );
        assert_eq!(t(""), "");
        assert_eq!(t("plain ünïcode = :"), "plain ünïcode = :");
        assert_eq!(translate("/run", &[]), "/run");
    }

    #[test]
    fn a_rewritten_path_is_not_rewritten_again() {
        let mounts = [
            Mount {
                container: "/a".into(),
                host: "/b".into(),
            },
            Mount {
                container: "/b".into(),
                host: "/c".into(),
            },
        ];
        assert_eq!(translate("/a/x /b/y", &mounts), "/b/x /c/y");
    }
}
