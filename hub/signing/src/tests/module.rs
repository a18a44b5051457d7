use openssl::bn::BigNum;
use openssl::cms::{CMSOptions, CmsContentInfo};
use openssl::stack::Stack;
use openssl::x509::store::X509StoreBuilder;

use super::shared;
use super::support::{elf_module, self_signed_with_serial, test_key};
use crate::{HashAlgorithm, SignError, SigningKey, sign_module};

const MAGIC: &[u8] = b"~Module signature appended~\n";

/// The CMS of a signed module, after checking the trailer around it.
fn cms_of(signed: &[u8], bare_len: usize) -> &[u8] {
    let rest = signed.strip_suffix(MAGIC).expect("ends with the marker");
    let (rest, info) = rest.split_at(rest.len() - 12);
    assert_eq!(info[..8], [0, 0, 2, 0, 0, 0, 0, 0], "module_signature");
    let len = u32::from_be_bytes(info[8..].try_into().unwrap()) as usize;
    assert_eq!(rest.len(), bare_len + len, "sig_len");
    &rest[bare_len..]
}

#[test]
fn sha256_signatures_are_what_openssls_cms_builder_makes() {
    let (test, _) = shared();
    let module = elf_module(10_000, 1);
    // The flags sign-file uses; CMS_sign picks SHA-256 for an RSA key.
    let flags = CMSOptions::BINARY
        | CMSOptions::DETACHED
        | CMSOptions::CMS_NOCERTS
        | CMSOptions::NOATTR
        | CMSOptions::NOSMIMECAP;
    // The serial numbers whose INTEGER encodings differ in shape: a random one (as
    // openssl req draws), zero, and ones whose top bit needs a leading zero byte.
    let mut certs = vec![test.cert.clone()];
    for hex in ["0", "80", "FF00", "7F"] {
        let serial = BigNum::from_hex_str(hex).unwrap();
        certs.push(self_signed_with_serial(&test.key, hex, &serial));
    }
    for cert in certs {
        let key = SigningKey::from_pem(&test.key_pem, &cert.to_der().unwrap()).unwrap();
        let signed = sign_module("m.ko", &module, &key, HashAlgorithm::Sha256).unwrap();
        let openssl =
            CmsContentInfo::sign(Some(&cert), Some(&test.key), None, Some(&module), flags)
                .unwrap()
                .to_der()
                .unwrap();
        assert_eq!(
            cms_of(&signed, module.len()),
            openssl,
            "serial {:?}",
            cert.serial_number().to_bn().unwrap().to_hex_str().unwrap()
        );
        assert_eq!(&signed[..module.len()], module);
    }
}

#[test]
fn openssl_verifies_every_hash_and_refuses_a_changed_module() {
    let (test, key) = shared();
    let module = elf_module(5_000, 2);
    let mut certs = Stack::new().unwrap();
    certs.push(test.cert.clone()).unwrap();
    let mut store = X509StoreBuilder::new().unwrap();
    store.add_cert(test.cert.clone()).unwrap();
    let store = store.build();
    for hash in HashAlgorithm::ALL {
        let signed = sign_module("m.ko", &module, key, hash).unwrap();
        let der = cms_of(&signed, module.len());
        let mut cms = CmsContentInfo::from_der(der).unwrap();
        cms.verify(
            Some(&certs),
            Some(&store),
            Some(&module),
            None,
            CMSOptions::BINARY,
        )
        .unwrap_or_else(|e| panic!("{hash}: {e}"));
        let mut changed = module.clone();
        changed[100] ^= 1;
        let mut cms = CmsContentInfo::from_der(der).unwrap();
        let verified = cms.verify(
            Some(&certs),
            Some(&store),
            Some(&changed),
            None,
            CMSOptions::BINARY,
        );
        assert!(verified.is_err(), "{hash}: a changed module verified");
        // The digest algorithm is named where the kernel reads it from.
        assert!(
            der.windows(hash.oid().len()).any(|w| w == hash.oid()),
            "{hash}"
        );
    }
}

#[test]
fn re_signing_replaces_the_old_signature() {
    let (_, key) = shared();
    let old = test_key(2048, "the previous key");
    let old = SigningKey::from_pem(&old.key_pem, &old.cert_pem).unwrap();
    let bare = elf_module(4_096, 3);
    let expected = sign_module("m.ko", &bare, key, HashAlgorithm::Sha256).unwrap();
    let signed_by_old = sign_module("m.ko", &bare, &old, HashAlgorithm::Sha512).unwrap();
    assert_ne!(signed_by_old, expected);
    let resigned = sign_module("m.ko", &signed_by_old, key, HashAlgorithm::Sha256).unwrap();
    assert_eq!(resigned, expected);
    // Idempotent: signing the signed module again changes nothing.
    let again = sign_module("m.ko", &resigned, key, HashAlgorithm::Sha256).unwrap();
    assert_eq!(again, expected);
}

#[test]
fn empty_and_non_elf_inputs_are_refused_naming_the_file() {
    let (_, key) = shared();
    let err = sign_module("/opt/empty.ko", b"", key, HashAlgorithm::Sha256).unwrap_err();
    assert!(matches!(err, SignError::Empty { .. }), "{err:?}");
    assert!(err.to_string().contains("/opt/empty.ko"), "{err}");

    let err = sign_module("/opt/a.txt", b"hello\n", key, HashAlgorithm::Sha256).unwrap_err();
    assert!(matches!(err, SignError::NotElf { .. }), "{err:?}");
    assert!(err.to_string().contains("/opt/a.txt"), "{err}");
    assert!(err.is_input_fault());
    assert!(!SignError::Write(std::io::Error::other("disk full")).is_input_fault());

    // A signature and nothing before it.
    let signed = sign_module("m.ko", &elf_module(100, 4), key, HashAlgorithm::Sha256).unwrap();
    let only_signature = &signed[100..];
    let err = sign_module("sig.ko", only_signature, key, HashAlgorithm::Sha256).unwrap_err();
    assert!(matches!(err, SignError::Empty { .. }), "{err:?}");
}

#[test]
fn the_signature_is_detached_from_the_module() {
    let (_, key) = shared();
    for len in [64, 1 << 20] {
        let module = elf_module(len, 5);
        let signed = sign_module("m.ko", &module, key, HashAlgorithm::Sha512).unwrap();
        let cms = cms_of(&signed, len);
        // 256 bytes of RSA 2048 signature plus the fixed structure around it.
        assert!((256..600).contains(&cms.len()), "{}", cms.len());
    }
}
