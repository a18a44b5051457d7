//! Pull credentials from `.dockerconfigjson` / `.dockercfg` content, in memory only.

use std::collections::BTreeMap;
use std::fmt;

use base64::Engine;
use serde::Deserialize;

use crate::PullSecret;

/// A user name and password for one registry. `Debug` never shows the password.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    /// Never includes the content itself.
    #[error("the pull secret is not a valid {kind}: {reason}")]
    Invalid { kind: &'static str, reason: String },
}

#[derive(Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: BTreeMap<String, AuthEntry>,
}

#[derive(Deserialize)]
struct AuthEntry {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

/// The registry host of a docker config key (`https://index.docker.io/v1/` =>
/// `docker.io`, `registry:5000/path` => `registry:5000`).
fn normalize_host(key: &str) -> String {
    let key = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    let host = key.split('/').next().unwrap_or(key).to_ascii_lowercase();
    match host.as_str() {
        "index.docker.io" | "registry-1.docker.io" => "docker.io".into(),
        _ => host,
    }
}

fn decode(kind: &'static str, entry: AuthEntry) -> Result<Credentials, CredentialsError> {
    let invalid = |reason: &str| CredentialsError::Invalid {
        kind,
        reason: reason.into(),
    };
    if let Some(auth) = entry.auth.filter(|a| !a.is_empty()) {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(auth.trim())
            .map_err(|_| invalid("an `auth` value is not base64"))?;
        let text = String::from_utf8(bytes).map_err(|_| invalid("an `auth` value is not UTF-8"))?;
        let (username, password) = text
            .split_once(':')
            .ok_or_else(|| invalid("an `auth` value is not `user:password`"))?;
        return Ok(Credentials {
            username: username.into(),
            password: password.into(),
        });
    }
    match (entry.username, entry.password) {
        (Some(username), Some(password)) => Ok(Credentials { username, password }),
        _ => Err(invalid(
            "an entry has neither `auth` nor `username`/`password`",
        )),
    }
}

/// Credentials per registry host from a pull secret.
pub fn parse(secret: &PullSecret) -> Result<BTreeMap<String, Credentials>, CredentialsError> {
    let (kind, entries) = match secret {
        PullSecret::DockerConfigJson(text) => {
            let config: DockerConfig =
                serde_json::from_str(text).map_err(|e| CredentialsError::Invalid {
                    kind: ".dockerconfigjson",
                    reason: format!("JSON error at line {} column {}", e.line(), e.column()),
                })?;
            (".dockerconfigjson", config.auths)
        }
        PullSecret::DockerCfg(text) => {
            let entries: BTreeMap<String, AuthEntry> =
                serde_json::from_str(text).map_err(|e| CredentialsError::Invalid {
                    kind: ".dockercfg",
                    reason: format!("JSON error at line {} column {}", e.line(), e.column()),
                })?;
            (".dockercfg", entries)
        }
    };
    entries
        .into_iter()
        .map(|(key, entry)| Ok((normalize_host(&key), decode(kind, entry)?)))
        .collect()
}

/// The credentials for `registry` (as in an image reference) from a pull secret.
pub fn for_registry(
    secret: &PullSecret,
    registry: &str,
) -> Result<Option<Credentials>, CredentialsError> {
    Ok(parse(secret)?.remove(&normalize_host(registry)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b64(s: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(s)
    }

    #[test]
    fn dockerconfigjson_and_dockercfg() {
        let json = format!(
            r#"{{"auths":{{"https://index.docker.io/v1/":{{"auth":"{}"}},"127.0.0.1:5000":{{"username":"u","password":"p:w"}}}}}}"#,
            b64("hub:secret")
        );
        let secret = PullSecret::DockerConfigJson(json);
        let hub = for_registry(&secret, "docker.io").unwrap().unwrap();
        assert_eq!(
            (hub.username.as_str(), hub.password.as_str()),
            ("hub", "secret")
        );
        let local = for_registry(&secret, "127.0.0.1:5000").unwrap().unwrap();
        assert_eq!(local.password, "p:w");
        assert_eq!(for_registry(&secret, "quay.io").unwrap(), None);

        let cfg = format!(
            r#"{{"registry.example:443":{{"auth":"{}","email":"x"}}}}"#,
            b64("a:b:c")
        );
        let creds = for_registry(&PullSecret::DockerCfg(cfg), "REGISTRY.example:443")
            .unwrap()
            .unwrap();
        assert_eq!(
            (creds.username.as_str(), creds.password.as_str()),
            ("a", "b:c")
        );
    }

    #[test]
    fn errors_never_show_the_secret() {
        for secret in [
            PullSecret::DockerConfigJson(r#"{"auths":{"r":{"auth":"not base64 s3cr3t!"}}}"#.into()),
            PullSecret::DockerConfigJson(r#"{"auths":{"r":{"auth":"#.into()),
            PullSecret::DockerCfg(format!(r#"{{"r":{{"auth":"{}"}}}}"#, b64("s3cr3t"))),
        ] {
            let err = parse(&secret).unwrap_err().to_string();
            assert!(!err.contains("s3cr3t"), "{err}");
        }
        let creds = Credentials {
            username: "u".into(),
            password: "s3cr3t".into(),
        };
        assert!(!format!("{creds:?}").contains("s3cr3t"));
    }
}
