//! A CA of the tests' own, for registries behind an internal CA.

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};

/// A new self-signed CA named `common_name`: its certificate and its key, both PEM (what
/// [`RegistryServer::tls_issued_by`](crate::RegistryServer::tls_issued_by) takes).
pub fn internal_ca(common_name: &str) -> (String, String) {
    let key = KeyPair::generate().expect("a key pair");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("empty names are valid");
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let cert = params.self_signed(&key).expect("a CA signs itself");
    (cert.pem(), key.serialize_pem())
}
