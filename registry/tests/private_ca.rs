//! A registry behind an internal CA (made here by rcgen, the registry a real
//! `docker-registry` serving a certificate it issued): a client and a manifest reader
//! trusting that CA verify the registry and read the image, without
//! `insecureSkipTLSVerify`; trusting only the system's CAs, or another internal CA, they
//! are refused.

use kmm_registry::{
    ManifestReader, RegistryCas, RegistryTls, client, client_trusting, parse_reference,
    resolve_digest,
};
use kmm_registry_fixture::{RegistryServer, internal_ca};
use oci_client::secrets::RegistryAuth;

#[tokio::test]
async fn a_registry_behind_an_internal_ca_is_verified_with_that_ca_alone() {
    let (ca, ca_key) = internal_ca("kmm-test internal CA");
    let (other, _) = internal_ca("another internal CA");
    let registry = {
        let (ca, ca_key) = (ca.clone(), ca_key.clone());
        tokio::task::spawn_blocking(move || RegistryServer::tls_issued_by(&ca, &ca_key))
            .await
            .unwrap()
            .unwrap()
    };
    let pushed = registry
        .push_files(
            "kmm/private-ca:1",
            &[("/opt/hello.ko", b"not really a module")],
        )
        .await
        .unwrap();
    let image = registry.image("kmm/private-ca:1");
    let verified = RegistryTls::default();

    let trusting = RegistryCas::from_pem(ca.as_bytes()).unwrap();
    let resolved = resolve_digest(&client_trusting(verified, &trusting), &image, None)
        .await
        .unwrap();
    assert_eq!(resolved, pushed);

    let bundle = format!("{other}{ca}");
    let in_a_bundle = RegistryCas::from_pem(bundle.as_bytes()).unwrap();
    assert_eq!(
        resolve_digest(&client_trusting(verified, &in_a_bundle), &image, None)
            .await
            .unwrap(),
        pushed,
        "any CA of the bundle will do"
    );

    let reference = parse_reference(&image).unwrap();
    let reader = |cas: &RegistryCas| ManifestReader {
        tls: verified,
        cas: cas.clone(),
        max_bytes: 1 << 20,
    };
    let (_, read) = reader(&trusting)
        .image_manifest(
            &client_trusting(verified, &trusting),
            &image,
            &reference,
            &RegistryAuth::Anonymous,
        )
        .await
        .unwrap();
    assert_eq!(read, pushed, "the capped manifest reader trusts it too");

    let wrong = RegistryCas::from_pem(other.as_bytes()).unwrap();
    let error = reader(&wrong)
        .image_manifest(
            &client_trusting(verified, &trusting),
            &image,
            &reference,
            &RegistryAuth::Anonymous,
        )
        .await
        .unwrap_err();
    assert!(error.to_string().contains("UnknownIssuer"), "{error}");
    for refused in [client(verified), client_trusting(verified, &wrong)] {
        let error = resolve_digest(&refused, &image, None).await.unwrap_err();
        let text = kmm_registry::error_chain(&error);
        assert!(
            text.contains("certificate") || text.contains("UnknownIssuer"),
            "{text}"
        );
    }
}
