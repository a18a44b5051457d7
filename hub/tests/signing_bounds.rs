//! Signing holds an image in memory, so an image over the limit is refused from its
//! manifest, before any layer is pulled, and nothing is pushed.

use std::time::Duration;

use kmm_hub::images::SignPlan;
use kmm_hub::serve::signing::{SigningError, sign_image};
use kmm_registry::RegistryTls;
use kmm_registry_fixture::RegistryServer;
use kmm_runtime::pki::CertificateAuthority;
use kmm_signing::SigningKey;

const PLAIN: RegistryTls = RegistryTls {
    insecure: true,
    insecure_skip_tls_verify: false,
};

#[tokio::test]
async fn an_image_over_the_signing_limit_is_refused_before_it_is_pulled() {
    let registry = RegistryServer::plain().unwrap();
    // Bytes gzip cannot shrink, so that the layer itself is over the limit.
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let module: Vec<u8> = (0..64 << 10)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state.to_le_bytes()[0]
        })
        .collect();
    registry
        .push_files(
            "m:unsigned",
            &[("opt/lib/modules/6.1.0/extra/m.ko", module.as_slice())],
        )
        .await
        .unwrap();
    let ca = CertificateAuthority::generate("kmm-test-signer", Duration::from_secs(3600)).unwrap();
    let key = SigningKey::from_pem(ca.key_pem().as_bytes(), ca.cert_pem().as_bytes()).unwrap();
    let plan = SignPlan {
        unsigned_image: registry.image("m:unsigned"),
        unsigned_tls: PLAIN,
        key_secret: String::new(),
        cert_secret: String::new(),
        files: vec!["/opt/lib/modules/6.1.0/extra/m.ko".into()],
    };
    let refused = sign_image(
        &plan,
        key,
        &registry.image("m:signed"),
        PLAIN,
        None,
        &kmm_registry::RegistryCas::default(),
        1024,
    )
    .await;
    let Err(SigningError::TooLarge { size, limit, .. }) = refused else {
        panic!("refused as too large: {refused:?}");
    };
    assert!(size > 1024 && limit == 1024, "{size} {limit}");
    assert!(!registry.has("m:signed").await.unwrap(), "nothing pushed");
}
