//! A registry of a test's own: Debian's `docker-registry` on a free port (of loopback,
//! or of the fleet's bridge for the nodes to pull from) with
//! its own storage, plain HTTP or HTTPS with a self-signed certificate (or one issued by
//! a CA of the test's), optionally behind
//! htpasswd authentication. For what the fleet's shared registry cannot show: TLS
//! verification, credentials, a registry that loses or moves an image.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use std::io::Write;

use base64::Engine;
use flate2::Compression;
use flate2::write::GzEncoder;
use oci_client::client::{ClientConfig, ClientProtocol, Config, ImageLayer};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::manifest::{
    IMAGE_CONFIG_MEDIA_TYPE, IMAGE_LAYER_GZIP_MEDIA_TYPE, OciImageManifest,
};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::{Error, IoContext, Result, registry_binary};

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// How long the registry gets to listen.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A running registry; stopped (by its PID) and its storage removed on drop.
#[derive(Debug)]
pub struct RegistryServer {
    /// `<ip>:<port>`: loopback unless started with [`RegistryServer::plain_with_auth_on`].
    pub address: String,
    /// HTTPS, with a certificate for 127.0.0.1 that no one trusts but its CA's holders.
    pub tls: bool,
    /// The one user htpasswd lets in, and their password.
    pub user: Option<(String, String)>,
    child: Child,
    /// Configuration, storage and log; removed on drop.
    _dir: tempfile::TempDir,
}

impl RegistryServer {
    /// Plain HTTP, anyone may pull and push.
    pub fn plain() -> Result<Self> {
        Self::start(LOOPBACK, None, None)
    }

    /// HTTPS with a self-signed certificate, and only `user` with `password` may pull
    /// or push.
    pub fn tls_with_auth(user: &str, password: &str) -> Result<Self> {
        Self::start(
            LOOPBACK,
            Some(Certificate::SelfSigned),
            Some((user.to_owned(), password.to_owned())),
        )
    }

    /// HTTPS with a certificate for 127.0.0.1 issued by the CA `ca_cert_pem` (whose key
    /// is `ca_key_pem`), as a registry behind an internal CA; anyone may pull and push.
    pub fn tls_issued_by(ca_cert_pem: &str, ca_key_pem: &str) -> Result<Self> {
        Self::start(
            LOOPBACK,
            Some(Certificate::IssuedBy {
                ca_cert_pem: ca_cert_pem.to_owned(),
                ca_key_pem: ca_key_pem.to_owned(),
            }),
            None,
        )
    }

    /// [`RegistryServer::tls_issued_by`], its certificate for and listening on `ip` (the
    /// fleet's bridge, which its nodes, its Pods and the hub reach).
    pub fn tls_issued_by_on(ip: IpAddr, ca_cert_pem: &str, ca_key_pem: &str) -> Result<Self> {
        Self::start(
            ip,
            Some(Certificate::IssuedBy {
                ca_cert_pem: ca_cert_pem.to_owned(),
                ca_key_pem: ca_key_pem.to_owned(),
            }),
            None,
        )
    }

    /// Plain HTTP on `ip` (the fleet's bridge, which its nodes, its Pods and the hub
    /// reach), anyone may pull and push.
    pub fn plain_on(ip: IpAddr) -> Result<Self> {
        Self::start(ip, None, None)
    }

    /// Plain HTTP on `ip` (the fleet's bridge, which its nodes and Pods reach), and only
    /// `user` with `password` may pull or push.
    pub fn plain_with_auth_on(ip: IpAddr, user: &str, password: &str) -> Result<Self> {
        Self::start(ip, None, Some((user.to_owned(), password.to_owned())))
    }

    fn start(
        ip: IpAddr,
        certificate: Option<Certificate>,
        user: Option<(String, String)>,
    ) -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("kmm-registry-server-")
            .tempdir()
            .context(|| "creating the registry's directory".into())?;
        let port = TcpListener::bind((ip, 0))
            .and_then(|l| l.local_addr())
            .context(|| format!("finding a free port on {ip}"))?
            .port();
        let address = SocketAddr::new(ip, port).to_string();
        let tls = certificate.is_some();
        let config = config(dir.path(), &address, certificate, user.as_ref())?;
        let log = dir.path().join("registry.log");
        let output = std::fs::File::create(&log)
            .and_then(|file| Ok((file.try_clone()?, file)))
            .context(|| format!("creating {}", log.display()))?;
        let child = Command::new(registry_binary()?)
            .arg("serve")
            .arg(&config)
            .stdout(output.0)
            .stderr(output.1)
            .spawn()
            .context(|| "starting docker-registry".into())?;
        let mut server = Self {
            address,
            tls,
            user,
            child,
            _dir: dir,
        };
        server.wait_listening(&log)?;
        Ok(server)
    }

    fn wait_listening(&mut self, log: &Path) -> Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        while TcpStream::connect(&self.address).is_err() {
            let exited = self
                .child
                .try_wait()
                .context(|| "waiting for docker-registry".into())?;
            if let Some(status) = exited {
                return Err(Error::Component {
                    component: "docker-registry".into(),
                    reason: format!("exited ({status})"),
                    log: log.to_owned(),
                });
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!("docker-registry to listen on {}", self.address),
                    seconds: START_TIMEOUT.as_secs(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// `<address>/<name>`
    pub fn image(&self, name: &str) -> String {
        format!("{}/{name}", self.address)
    }

    /// Pushes an image of one gzip layer holding `files` (path, contents) as
    /// `<address>/<name>`, with this registry's credentials; returns its digest.
    pub async fn push_files(&self, name: &str, files: &[(&str, &[u8])]) -> Result<String> {
        let tar = tar_of(files)?;
        let diff_id = format!("sha256:{:x}", Sha256::digest(&tar));
        let mut gzip = GzEncoder::new(Vec::new(), Compression::default());
        gzip.write_all(&tar)
            .and_then(|()| gzip.try_finish())
            .context(|| format!("compressing the layer of {name}"))?;
        let layer = ImageLayer::new(
            gzip.get_ref().clone(),
            IMAGE_LAYER_GZIP_MEDIA_TYPE.into(),
            None,
        );
        let config = Config::new(
            json!({
                "architecture": "amd64",
                "os": "linux",
                "rootfs": { "type": "layers", "diff_ids": [diff_id] },
            })
            .to_string()
            .into_bytes(),
            IMAGE_CONFIG_MEDIA_TYPE.into(),
            None,
        );
        let reference: Reference = self
            .image(name)
            .parse()
            .map_err(|e| Error::Invalid(format!("image {name}: {e}")))?;
        let layers = [layer];
        let manifest = OciImageManifest::build(&layers, &config, None);
        let client = self.client();
        client
            .push(&reference, &layers, config, &self.auth(), Some(manifest))
            .await?;
        Ok(client
            .fetch_manifest_digest(&reference, &self.auth())
            .await?)
    }

    /// Whether the registry has `<address>/<name>`.
    pub async fn has(&self, name: &str) -> Result<bool> {
        let reference: Reference = self
            .image(name)
            .parse()
            .map_err(|e| Error::Invalid(format!("image {name}: {e}")))?;
        match self
            .client()
            .fetch_manifest_digest(&reference, &self.auth())
            .await
        {
            Ok(_) => Ok(true),
            Err(OciDistributionError::ImageManifestNotFoundError(_)) => Ok(false),
            Err(OciDistributionError::RegistryError { envelope, .. })
                if envelope.errors.iter().any(|e| {
                    matches!(
                        e.code,
                        OciErrorCode::ManifestUnknown | OciErrorCode::NameUnknown
                    )
                }) =>
            {
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// A client for this registry: its protocol, and its certificate accepted.
    pub fn client(&self) -> Client {
        Client::new(ClientConfig {
            protocol: if self.tls {
                ClientProtocol::Https
            } else {
                ClientProtocol::Http
            },
            accept_invalid_certificates: true,
            ..ClientConfig::default()
        })
    }

    /// The credentials this registry lets in.
    pub fn auth(&self) -> RegistryAuth {
        match &self.user {
            Some((user, password)) => RegistryAuth::Basic(user.clone(), password.clone()),
            None => RegistryAuth::Anonymous,
        }
    }

    /// A `.dockerconfigjson` for this registry with these credentials.
    pub fn docker_config_json(&self, user: &str, password: &str) -> String {
        docker_config_json(&self.address, user, password)
    }
}

impl Drop for RegistryServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Writes under `dir` the configuration of a registry that outlives the process writing
/// it (the local fleet's second registry, which the fleet stops by its PID): HTTPS on
/// `address` with a certificate for its IP issued by the CA `ca_cert_pem` (key
/// `ca_key_pem`), and only `user` with `password` may pull or push. Returns the
/// configuration's path, for `docker-registry serve` ([`registry_binary`]).
pub fn tls_with_auth_config(
    dir: &Path,
    address: &str,
    (ca_cert_pem, ca_key_pem): (&str, &str),
    (user, password): (&str, &str),
) -> Result<std::path::PathBuf> {
    config(
        dir,
        address,
        Some(Certificate::IssuedBy {
            ca_cert_pem: ca_cert_pem.to_owned(),
            ca_key_pem: ca_key_pem.to_owned(),
        }),
        Some(&(user.to_owned(), password.to_owned())),
    )
}

/// A `.dockerconfigjson` for `registry` with these credentials.
pub fn docker_config_json(registry: &str, user: &str, password: &str) -> String {
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    json!({ "auths": { registry: { "auth": auth } } }).to_string()
}

/// A tar of regular files, their parent directories implied.
fn tar_of(files: &[(&str, &[u8])]) -> Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::new());
    for (path, contents) in files {
        let mut header = tar::Header::new_gnu();
        header.set_size(contents.len() as u64);
        header.set_mode(0o644);
        builder
            .append_data(&mut header, path.trim_start_matches('/'), *contents)
            .context(|| format!("adding {path} to a layer"))?;
    }
    builder.into_inner().context(|| "finishing a layer".into())
}

/// The registry's TLS certificate for the address it listens on.
enum Certificate {
    SelfSigned,
    IssuedBy {
        ca_cert_pem: String,
        ca_key_pem: String,
    },
}

/// Writes the registry's configuration (and its certificate, key and htpasswd file)
/// under `dir`; returns the configuration's path.
fn config(
    dir: &Path,
    address: &str,
    certificate: Option<Certificate>,
    user: Option<&(String, String)>,
) -> Result<std::path::PathBuf> {
    let write = |name: &str, contents: &[u8]| {
        let path = dir.join(name);
        std::fs::write(&path, contents).context(|| format!("writing {}", path.display()))?;
        Ok::<_, Error>(path)
    };
    let mut http = json!({ "addr": address });
    if let Some(certificate) = certificate {
        let ip = address
            .parse::<SocketAddr>()
            .map_err(|e| Error::Invalid(format!("the registry's address {address}: {e}")))?
            .ip();
        let names = vec![ip.to_string()];
        let (cert, key) = match certificate {
            Certificate::SelfSigned => {
                let certified = rcgen::generate_simple_self_signed(names)?;
                (certified.cert.pem(), certified.signing_key.serialize_pem())
            }
            Certificate::IssuedBy {
                ca_cert_pem,
                ca_key_pem,
            } => {
                let issuer = rcgen::Issuer::from_ca_cert_pem(
                    &ca_cert_pem,
                    rcgen::KeyPair::from_pem(&ca_key_pem)?,
                )?;
                let key = rcgen::KeyPair::generate()?;
                let cert = rcgen::CertificateParams::new(names)?.signed_by(&key, &issuer)?;
                (cert.pem(), key.serialize_pem())
            }
        };
        http["tls"] = json!({
            "certificate": write("cert.pem", cert.as_bytes())?,
            "key": write("key.pem", key.as_bytes())?,
        });
    }
    let mut config = json!({
        "version": 0.1,
        "log": { "level": "warn" },
        "storage": {
            "filesystem": { "rootdirectory": dir.join("storage") },
            "delete": { "enabled": true },
        },
        "http": http,
    });
    if let Some((name, password)) = user {
        // The lowest cost bcrypt allows: the hash guards a throwaway registry.
        let hash = bcrypt::hash_with_result(password, 4)
            .map_err(|e| Error::Invalid(format!("hashing the registry password: {e}")))?
            .format_for_version(bcrypt::Version::TwoY);
        config["auth"] = json!({
            "htpasswd": {
                "realm": "kmm-test",
                "path": write("htpasswd", format!("{name}:{hash}\n").as_bytes())?,
            }
        });
    }
    let text = serde_json::to_vec_pretty(&config)
        .map_err(|e| Error::Invalid(format!("the registry's configuration: {e}")))?;
    // JSON is YAML: docker-registry reads it as is.
    write("config.yml", &text)
}
