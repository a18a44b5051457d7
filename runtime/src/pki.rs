//! Certificates the components issue to each other: the hub's CA (proxy client
//! certificates, the hub's serving certificate) and the spoke proxy's CA (its serving
//! certificate for node agents). Private keys are only ever in memory here, wrapped so
//! that they are wiped on drop and never printed by `Debug`.
//!
//! CA keys are RSA: OCM's addon-manager signs the proxies' client certificates with the
//! hub's CA key and can only sign with RSA. Leaf keys are ECDSA P-256 (smaller, faster).

use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PKCS_RSA_SHA256, PKCS_RSA_SHA384, PKCS_RSA_SHA512,
    RsaKeySize, SanType,
};
use time::OffsetDateTime;
use zeroize::Zeroizing;

/// Tolerance for clocks that are slightly behind the issuer's.
const BACKDATE: Duration = Duration::from_secs(5 * 60);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the CA certificate or key is not valid PEM: {0}")]
    InvalidCa(rcgen::Error),
    #[error("DNS name {name:?} is not valid in a certificate: {source}")]
    InvalidDnsName { name: String, source: rcgen::Error },
    #[error("cannot sign the certificate for {common_name:?}: {source}")]
    Sign {
        common_name: String,
        source: rcgen::Error,
    },
}

/// What a certificate is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Usage {
    Server,
    Client,
}

/// A certificate to issue.
#[derive(Clone, Debug)]
pub struct Leaf {
    pub common_name: String,
    /// Subject organizations (Kubernetes and OCM read them as groups).
    pub organizations: Vec<String>,
    pub dns_names: Vec<String>,
    pub ip_addresses: Vec<IpAddr>,
    pub usage: Usage,
    pub not_before: OffsetDateTime,
    pub not_after: OffsetDateTime,
}

impl Leaf {
    /// A serving certificate valid from a few minutes ago for `validity`.
    pub fn server(
        common_name: &str,
        dns_names: &[String],
        ip_addresses: &[IpAddr],
        validity: Duration,
    ) -> Self {
        let (not_before, not_after) = window(validity);
        Self {
            common_name: common_name.to_owned(),
            organizations: Vec::new(),
            dns_names: dns_names.to_vec(),
            ip_addresses: ip_addresses.to_vec(),
            usage: Usage::Server,
            not_before,
            not_after,
        }
    }

    /// A client certificate valid from a few minutes ago for `validity`.
    pub fn client(common_name: &str, organizations: &[String], validity: Duration) -> Self {
        let (not_before, not_after) = window(validity);
        Self {
            common_name: common_name.to_owned(),
            organizations: organizations.to_vec(),
            dns_names: Vec::new(),
            ip_addresses: Vec::new(),
            usage: Usage::Client,
            not_before,
            not_after,
        }
    }
}

fn window(validity: Duration) -> (OffsetDateTime, OffsetDateTime) {
    let now = OffsetDateTime::now_utc();
    (now - BACKDATE, now + validity)
}

/// An issued certificate and its private key, both PEM.
pub struct IssuedCertificate {
    pub cert_pem: String,
    pub key_pem: Zeroizing<String>,
}

impl fmt::Debug for IssuedCertificate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IssuedCertificate")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

/// A certificate authority held in memory.
pub struct CertificateAuthority {
    cert_pem: String,
    key_pem: Zeroizing<String>,
    issuer: Issuer<'static, KeyPair>,
}

impl fmt::Debug for CertificateAuthority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertificateAuthority")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .finish_non_exhaustive()
    }
}

impl CertificateAuthority {
    /// A new self-signed CA valid for `validity`, with an RSA-2048 key (PKCS#8) signing
    /// with SHA-256.
    pub fn generate(common_name: &str, validity: Duration) -> Result<Self, Error> {
        let sign_error = |source| Error::Sign {
            common_name: common_name.to_owned(),
            source,
        };
        let key =
            KeyPair::generate_rsa_for(&PKCS_RSA_SHA256, RsaKeySize::_2048).map_err(sign_error)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = distinguished_name(common_name, &[]);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        (params.not_before, params.not_after) = window(validity);
        let cert = params.self_signed(&key).map_err(sign_error)?;
        Ok(Self {
            cert_pem: cert.pem(),
            key_pem: Zeroizing::new(key.serialize_pem()),
            issuer: Issuer::new(params, key),
        })
    }

    /// A CA read back from its PEM certificate and key (e.g. from a Secret).
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, Error> {
        let key = KeyPair::from_pem(key_pem).map_err(Error::InvalidCa)?;
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key).map_err(Error::InvalidCa)?;
        Ok(Self {
            cert_pem: cert_pem.to_owned(),
            key_pem: Zeroizing::new(key_pem.to_owned()),
            issuer,
        })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// Whether the CA's key is RSA (the only kind OCM's addon-manager signs with).
    pub fn is_rsa(&self) -> bool {
        let algorithm = self.issuer.key().algorithm();
        [&PKCS_RSA_SHA256, &PKCS_RSA_SHA384, &PKCS_RSA_SHA512].contains(&algorithm)
    }

    /// Issues `leaf` with a fresh key.
    pub fn issue(&self, leaf: &Leaf) -> Result<IssuedCertificate, Error> {
        let sign_error = |source| Error::Sign {
            common_name: leaf.common_name.clone(),
            source,
        };
        let mut params = CertificateParams::default();
        params.distinguished_name = distinguished_name(&leaf.common_name, &leaf.organizations);
        for name in &leaf.dns_names {
            let dns = name
                .as_str()
                .try_into()
                .map_err(|source| Error::InvalidDnsName {
                    name: name.clone(),
                    source,
                })?;
            params.subject_alt_names.push(SanType::DnsName(dns));
        }
        params
            .subject_alt_names
            .extend(leaf.ip_addresses.iter().map(|ip| SanType::IpAddress(*ip)));
        params.extended_key_usages = vec![match leaf.usage {
            Usage::Server => ExtendedKeyUsagePurpose::ServerAuth,
            Usage::Client => ExtendedKeyUsagePurpose::ClientAuth,
        }];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.not_before = leaf.not_before;
        params.not_after = leaf.not_after;
        let key = KeyPair::generate().map_err(sign_error)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(sign_error)?;
        Ok(IssuedCertificate {
            cert_pem: cert.pem(),
            key_pem: Zeroizing::new(key.serialize_pem()),
        })
    }
}

fn distinguished_name(common_name: &str, organizations: &[String]) -> DistinguishedName {
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, common_name);
    for organization in organizations {
        name.push(DnType::OrganizationName, organization.as_str());
    }
    name
}

#[cfg(test)]
mod tests {
    use x509_parser::extensions::GeneralName;
    use x509_parser::oid_registry::OID_PKCS1_SHA256WITHRSA;
    use x509_parser::pem::parse_x509_pem;
    use x509_parser::public_key::PublicKey;

    use super::*;

    const DAY: Duration = Duration::from_secs(24 * 3600);

    fn parse(pem: &str) -> x509_parser::pem::Pem {
        parse_x509_pem(pem.as_bytes()).unwrap().1
    }

    #[test]
    fn a_generated_ca_has_an_rsa_2048_pkcs8_key_and_signs_with_sha256() {
        let ca = CertificateAuthority::generate("kmm-hub-ca", DAY).unwrap();
        assert!(ca.is_rsa());
        // PKCS#8 ("PRIVATE KEY"), which OCM's addon-manager reads, not PKCS#1 only.
        assert!(ca.key_pem().starts_with("-----BEGIN PRIVATE KEY-----"));
        let pem = parse(ca.cert_pem());
        let cert = pem.parse_x509().unwrap();
        let Ok(PublicKey::RSA(key)) = cert.public_key().parsed() else {
            panic!("not an RSA key: {:?}", cert.public_key().algorithm);
        };
        assert_eq!(key.key_size(), 2048);
        assert_eq!(cert.signature_algorithm.algorithm, OID_PKCS1_SHA256WITHRSA);
        cert.verify_signature(None).unwrap();

        let leaf = ca.issue(&Leaf::client("c", &[], DAY)).unwrap();
        let pem = parse(&leaf.cert_pem);
        let leaf = pem.parse_x509().unwrap();
        assert_eq!(leaf.signature_algorithm.algorithm, OID_PKCS1_SHA256WITHRSA);
        assert!(matches!(leaf.public_key().parsed(), Ok(PublicKey::EC(_))));
    }

    #[test]
    fn a_ca_with_an_ec_key_is_read_but_is_not_rsa() {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).unwrap();
        let ca = CertificateAuthority::from_pem(&cert.pem(), &key.serialize_pem()).unwrap();
        assert!(!ca.is_rsa());
        ca.issue(&Leaf::client("c", &[], DAY)).unwrap();
    }

    #[test]
    fn a_client_certificate_carries_the_subject_as_given_and_chains_to_the_ca() {
        let ca = CertificateAuthority::generate("kmm-hub-ca", DAY).unwrap();
        let groups = vec!["system:open-cluster-management:addon:kmm".to_owned()];
        let issued = ca
            .issue(&Leaf::client(
                "system:open-cluster-management:cluster:c1:addon:kmm:agent:a",
                &groups,
                DAY,
            ))
            .unwrap();
        let pem = parse(&issued.cert_pem);
        let cert = pem.parse_x509().unwrap();
        let cn = cert.subject().iter_common_name().next().unwrap();
        assert_eq!(
            cn.as_str().unwrap(),
            "system:open-cluster-management:cluster:c1:addon:kmm:agent:a"
        );
        let o: Vec<_> = cert
            .subject()
            .iter_organization()
            .map(|o| o.as_str().unwrap())
            .collect();
        assert_eq!(o, ["system:open-cluster-management:addon:kmm"]);
        let ca_pem = parse(ca.cert_pem());
        let ca_cert = ca_pem.parse_x509().unwrap();
        assert_eq!(cert.issuer(), ca_cert.subject());
        cert.verify_signature(Some(ca_cert.public_key())).unwrap();
        assert!(
            cert.extended_key_usage()
                .unwrap()
                .unwrap()
                .value
                .client_auth
        );
    }

    #[test]
    fn a_ca_read_back_from_pem_issues_certificates_the_original_verifies() {
        let original = CertificateAuthority::generate("kmm-hub-ca", DAY).unwrap();
        let reread =
            CertificateAuthority::from_pem(original.cert_pem(), original.key_pem()).unwrap();
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let issued = reread
            .issue(&Leaf::server(
                "kmm-hub",
                &["localhost".to_owned()],
                &[ip],
                DAY,
            ))
            .unwrap();
        let pem = parse(&issued.cert_pem);
        let cert = pem.parse_x509().unwrap();
        let ca_pem = parse(original.cert_pem());
        cert.verify_signature(Some(ca_pem.parse_x509().unwrap().public_key()))
            .unwrap();
        let sans = cert.subject_alternative_name().unwrap().unwrap();
        assert!(
            sans.value
                .general_names
                .contains(&GeneralName::DNSName("localhost"))
        );
        assert!(
            sans.value
                .general_names
                .contains(&GeneralName::IPAddress(&[127, 0, 0, 1]))
        );
        assert!(
            cert.extended_key_usage()
                .unwrap()
                .unwrap()
                .value
                .server_auth
        );
    }

    #[test]
    fn validity_follows_the_leaf() {
        let ca = CertificateAuthority::generate("ca", DAY).unwrap();
        let mut leaf = Leaf::client("expired", &[], DAY);
        leaf.not_before = OffsetDateTime::now_utc() - 2 * DAY;
        leaf.not_after = OffsetDateTime::now_utc() - DAY;
        let issued = ca.issue(&leaf).unwrap();
        let pem = parse(&issued.cert_pem);
        assert!(!pem.parse_x509().unwrap().validity().is_valid());
    }

    #[test]
    fn keys_never_show_in_debug_output() {
        let ca = CertificateAuthority::generate("ca", DAY).unwrap();
        let issued = ca.issue(&Leaf::client("c", &[], DAY)).unwrap();
        assert!(!format!("{ca:?}").contains("PRIVATE KEY"));
        assert!(!format!("{issued:?}").contains("PRIVATE KEY"));
        assert!(issued.key_pem.contains("PRIVATE KEY"));
    }

    #[test]
    fn garbage_is_refused_as_a_ca() {
        let error = CertificateAuthority::from_pem("not pem", "nor this").unwrap_err();
        assert!(error.to_string().contains("not valid PEM"), "{error}");
    }

    #[test]
    fn an_invalid_dns_name_is_named() {
        let ca = CertificateAuthority::generate("ca", DAY).unwrap();
        let error = ca
            .issue(&Leaf::server("s", &["bäd-name".to_owned()], &[], DAY))
            .unwrap_err();
        assert!(error.to_string().contains("bäd-name"), "{error}");
    }
}
