//! Certificates for the local fleet, made with rcgen: one CA per cluster (it also signs
//! CSRs through kube-controller-manager), serving certificates for 127.0.0.1, and
//! client certificates for the admin identity.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

use crate::{IoContext, Result};

/// A CA whose certificate and key are on disk.
#[derive(Debug)]
pub struct Ca {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// A certificate (or, for a bare key pair, the public key) and its private key.
#[derive(Debug, Clone)]
pub struct Pair {
    pub cert: PathBuf,
    pub key: PathBuf,
}

fn name(common_name: &str, organization: Option<&str>) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    if let Some(o) = organization {
        dn.push(DnType::OrganizationName, o);
    }
    dn
}

fn write(dir: &Path, file: &str, contents: &str) -> Result<PathBuf> {
    let path = dir.join(file);
    std::fs::write(&path, contents).context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

impl Ca {
    pub fn create(dir: &Path, file: &str, common_name: &str) -> Result<Self> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = name(common_name, None);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key)?;
        let pem = cert.pem();
        Ok(Self {
            cert: write(dir, &format!("{file}.crt"), &pem)?,
            key: write(dir, &format!("{file}.key"), &key.serialize_pem())?,
            pem,
            issuer: Issuer::new(params, key),
        })
    }

    /// A serving certificate for loopback (plus extra DNS names and IPs).
    pub fn serving(&self, dir: &Path, file: &str, dns: &[&str], ips: &[&str]) -> Result<Pair> {
        let mut params = CertificateParams::default();
        params.distinguished_name = name(file, None);
        params.subject_alt_names = dns
            .iter()
            .map(|d| Ok(SanType::DnsName((*d).try_into()?)))
            .collect::<Result<Vec<_>, rcgen::Error>>()?;
        for ip in ips {
            let addr = ip
                .parse()
                .map_err(|e| crate::Error::Invalid(format!("IP SAN {ip}: {e}")))?;
            params.subject_alt_names.push(SanType::IpAddress(addr));
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(dir, file, params)
    }

    /// A client certificate for `common_name` in `organization` (a Kubernetes group).
    pub fn client(
        &self,
        dir: &Path,
        file: &str,
        common_name: &str,
        organization: &str,
    ) -> Result<Pair> {
        let mut params = CertificateParams::default();
        params.distinguished_name = name(common_name, Some(organization));
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(dir, file, params)
    }

    fn sign(&self, dir: &Path, file: &str, mut params: CertificateParams) -> Result<Pair> {
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Pair {
            cert: write(dir, &format!("{file}.crt"), &cert.pem())?,
            key: write(dir, &format!("{file}.key"), &key.serialize_pem())?,
        })
    }
}

/// A bare key pair (the service-account token signing key), written as
/// `<file>.key` and `<file>.pub`.
pub fn key_pair(dir: &Path, file: &str) -> Result<Pair> {
    let key = KeyPair::generate()?;
    Ok(Pair {
        cert: write(dir, &format!("{file}.pub"), &key.public_key_pem())?,
        key: write(dir, &format!("{file}.key"), &key.serialize_pem())?,
    })
}
