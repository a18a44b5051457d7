//! The hub's signing between registries behind an internal CA (made here by rcgen; a real
//! `docker-registry` serving a certificate it issued): with the CA trusted it pulls,
//! signs and pushes over verified TLS, no `insecureSkipTLSVerify`; without, it is
//! refused at the pull.

use std::time::Duration;

use kmm_hub::images::SignPlan;
use kmm_hub::serve::signing::{MAX_IMAGE_BYTES, SigningError, sign_image};
use kmm_registry::{RegistryCas, RegistryTls, error_chain};
use kmm_registry_fixture::{RegistryServer, internal_ca};
use kmm_runtime::pki::CertificateAuthority;
use kmm_signing::SigningKey;

const MODULE: &str = "opt/lib/modules/6.1.0/extra/m.ko";

#[tokio::test]
async fn signing_trusts_the_hubs_registry_ca_and_needs_no_skip_verify() {
    let (ca, ca_key) = internal_ca("kmm-hub-test internal CA");
    let registry = {
        let (ca, key) = (ca.clone(), ca_key.clone());
        tokio::task::spawn_blocking(move || RegistryServer::tls_issued_by(&ca, &key))
            .await
            .unwrap()
            .unwrap()
    };
    registry
        .push_files("m:unsigned", &[(MODULE, b"\x7fELF not really a module")])
        .await
        .unwrap();
    let signer =
        CertificateAuthority::generate("kmm-test-signer", Duration::from_secs(3600)).unwrap();
    let key =
        || SigningKey::from_pem(signer.key_pem().as_bytes(), signer.cert_pem().as_bytes()).unwrap();
    let verified = RegistryTls::default();
    let plan = SignPlan {
        unsigned_image: registry.image("m:unsigned"),
        unsigned_tls: verified,
        key_secret: String::new(),
        cert_secret: String::new(),
        files: vec![format!("/{MODULE}")],
    };
    let signed = registry.image("m:signed");

    let refused = sign_image(
        &plan,
        key(),
        &signed,
        verified,
        None,
        &RegistryCas::default(),
        MAX_IMAGE_BYTES,
    )
    .await;
    let Err(SigningError::Pull(error)) = refused else {
        panic!("refused at the pull: {refused:?}");
    };
    assert!(error_chain(&error).contains("UnknownIssuer"), "{error}");

    let cas = RegistryCas::from_pem(ca.as_bytes()).unwrap();
    let digest = sign_image(&plan, key(), &signed, verified, None, &cas, MAX_IMAGE_BYTES)
        .await
        .unwrap();
    assert!(digest.starts_with("sha256:"), "{digest}");
    assert!(registry.has("m:signed").await.unwrap());
}
